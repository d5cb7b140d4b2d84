"""LoRA on the routed experts, in one of two layouts (``--expert-lora-layout``), r the experts'
rank, l the width the experts work in (the latent, else the hidden size), f their FFN width, E
the local experts, s = alpha / r:

* ``per-expert``: every expert its own A and B on fc1 (gate|up) and fc2 (down), on the fused
  grouped op (``ops.lora_expert.lora_expert_mlp``): fc1_lora_A [E, r, l], fc1_lora_B [E, 2f, r],
  fc2_lora_A [E, r, f], fc2_lora_B [E, l, r]. One adapter per global expert.
* ``shared-outer`` (SGLang's ``experts_shared_outer_loras``, miles' Kimi K3 LoRA): the factors
  on the l side are shared by all experts of the layer, the ones on the f side are per expert:

      fc1_lora_A [2r, l]   shared: rows 0..r-1 the gate's A (SGLang/miles w1_lora_A [r, l]),
                           rows r..2r-1 the up's A (w3_lora_A [r, l]); [r, l] when not gated
      fc1_lora_B [E, 2f, r] per expert: rows 0..f-1 the gate's B (w1_lora_B [E, f, r]), the
                           next f the up's (w3_lora_B); the gate's pairs with the gate's A
      fc2_lora_A [E, r, f] per expert (w2_lora_A)
      fc2_lora_B [l, r]    shared (w2_lora_B)

  so expert e's gate gets s B_gate,e A_gate, its up s B_up,e A_up and its down s B A_e, each of
  rank r: 3 f r per expert and 3 l r per layer (2 l r not gated). The shared factor of a
  projection is one GEMM over all of the layer's rows on this rank
  (``ops.lora_expert.shared_outer_expert_mlp``), the per-expert ones grouped per expert.

Expert-parallel: every EP rank holds the shared factors whole, and the rows of a layer are spread
over the EP ranks' experts, so each rank's gradient of a shared factor is a partial sum. The
factors pass through Megatron's copy-to-region op on the EP group (identity forward, all-reduce
of the gradient backward), so each rank's gradient is the whole layer's; DDP then reduces them
over the expert-data-parallel ranks as the experts' (``mark_expert_parameter``: expert DP ranks
hold the same experts, and DDP scales expert gradients as dense ones). Replicas on EP ranks > 0
are marked ``shared`` so the expert optimizer's grad norm (reduced over the EP ranks) counts
them once. Their adapter tensors and dist-checkpoint entries are replicated, not expert-sharded.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)

from megatron_slmoe.lora.config import LoRAConfig
from megatron_slmoe.lora.base import (
    LoRAModule,
    LoRAPiece,
    full_slice,
    mark_lora,
    new_param,
)
from megatron_slmoe.moe.experts import LatentSwiGLUExperts, dense_tile, mark_expert_parameter
from megatron_slmoe.ops.lora_expert import (
    LoRAGroupedWeights,
    expert_activation,
    lora_expert_mlp,
    lora_grouped_linear,
    shared_outer_expert_mlp,
    shared_outer_grouped_linear,
)

# --- routed experts ------------------------------------------------------------------------------


_EXPERT_LORA = ("fc1_lora_A", "fc1_lora_B", "fc2_lora_A", "fc2_lora_B")


class LoRALatentSwiGLUExperts(LoRAModule, LatentSwiGLUExperts):
    """``LatentSwiGLUExperts`` with one LoRA per expert on fc1 and/or fc2.

    Same interface ``forward(rows_RL, tokens_per_expert_E, probs_R)``; with both projections
    adapted it is the expert MLP op ``lora_expert_mlp`` (one fused grouped op per projection:
    frozen stacked W plus s * B_e A_e per expert), the router probability applied by the fc2 op to
    its output rows (fc2 being linear, the same as scaling its input like the base experts).
    Per-expert: A tensors are [E_local, r, in], B [E_local, out, r]; shared-outer: the module
    doc's shapes, on ``shared_outer_expert_mlp``. An unadapted projection has none and runs the
    base math.
    """

    def __init__(self, config, num_local_experts: int, local_expert_offset: int,
                 lora_config: LoRAConfig, name: str = "experts", fc1: bool = True,
                 fc2: bool = True, rank: int | None = None) -> None:
        super().__init__(config, num_local_experts, local_expert_offset)
        self._lora_attach(lora_config, name, fc1, fc2, LatentSwiGLUExperts, rank)

    @classmethod
    def from_base(cls, base: LatentSwiGLUExperts, lora_config: LoRAConfig, name: str,
                  fc1: bool = True, fc2: bool = True, rank: int | None = None
                  ) -> "LoRALatentSwiGLUExperts":
        if type(base) is not LatentSwiGLUExperts:
            raise TypeError(f"{name}: expected LatentSwiGLUExperts, got {type(base).__name__}")
        base.__class__ = cls
        base._lora_attach(lora_config, name, fc1, fc2, LatentSwiGLUExperts, rank)
        return base

    def _lora_attach(self, lora_config, name, fc1, fc2, base_class, rank=None) -> None:
        if not (fc1 or fc2):
            raise ValueError(f"{name}: expert LoRA needs fc1 or fc2")
        self._lora_setup(lora_config, name, base_class)
        # The experts' own rank (--expert-lora-rank / --moe-rank-scaling), alpha kept.
        if rank is None:
            rank = lora_config.expert_rank_for(self.config.moe_router_topk)
        self.lora_rank, self.lora_scaling = rank, lora_config.scaling_for(rank)
        self.lora_layout = lora_config.expert_layout
        if self.packed is None:  # packed experts hold buffers: frozen already
            self.fc1_weight.requires_grad_(False)
            self.fc2_weight.requires_grad_(False)
        r, e = self.lora_rank, self.num_local_experts
        # The adapters' dtype and device: the dense weights', or the run's for packed ones.
        run_dtype = torch.empty(0, dtype=self.config.params_dtype, device=self.fc1_weight.device)
        for proj, on in (("fc1", fc1), ("fc2", fc2)):
            weight = getattr(self, f"{proj}_weight")
            out_features, in_features = weight.shape[1:]
            if on:
                like = weight if self.packed is None else run_dtype
                shape_a, shape_b = (e, r, in_features), (e, out_features, r)
                if self.lora_layout == "shared-outer" and proj == "fc1":
                    shape_a = (self._fc1_groups() * r, in_features)
                elif self.lora_layout == "shared-outer":
                    shape_b = (out_features, r)
                setattr(self, f"{proj}_lora_A", new_param(shape_a, like))
                setattr(self, f"{proj}_lora_B", new_param(shape_b, like))
            else:
                self.register_parameter(f"{proj}_lora_A", None)
                self.register_parameter(f"{proj}_lora_B", None)
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        for param in self.lora_parameters():
            mark_lora(param)
            mark_expert_parameter(param)
            if param.dim() == 2:  # a shared factor: one copy per EP group in the grad norm
                param.shared = ep_rank != 0
        self._lora_init_a(lora_config.init_seed)

    def _fc1_groups(self) -> int:
        """fc1's output groups, each with its own shared A: gate and up, or one."""
        return 2 if self.config.gated_linear_unit else 1

    def _reduced_over_ep(self, param: torch.Tensor) -> torch.Tensor:
        """A shared factor as used in forward: its backward sums the gradient over the EP ranks
        (each holds a part of the layer's rows)."""
        if parallel_state.get_expert_model_parallel_world_size() == 1:
            return param
        return copy_to_tensor_model_parallel_region(
            param, group=parallel_state.get_expert_model_parallel_group())

    def lora_parameters(self):
        return [p for p in (getattr(self, n) for n in _EXPERT_LORA) if p is not None]

    def _projection(self, proj: str, x_RI: torch.Tensor, counts: torch.Tensor,
                    probs_R: torch.Tensor | None = None) -> torch.Tensor:
        """One projection of all local experts; ``probs_R`` scales its output rows."""
        weight = getattr(self, f"{proj}_weight")
        lora_a, lora_b = getattr(self, f"{proj}_lora_A"), getattr(self, f"{proj}_lora_B")
        if lora_a is None or self.lora_scaling == 0.0:  # not adapted, or disabled: the base math
            if probs_R is not None:
                x_RI = x_RI * probs_R.unsqueeze(-1).to(x_RI.dtype)
            parts = [F.linear(x, dense_tile(weight[e], x.dtype))
                     for e, x in enumerate(x_RI.split(counts.tolist()))]
            return torch.cat(parts) if parts else x_RI.new_zeros(0, weight.shape[1])
        with self._dropout_rng():
            if self.lora_layout == "shared-outer":
                return shared_outer_grouped_linear(
                    x_RI, weight, *self._factors(proj), counts, self.lora_scaling,
                    self._dropout_p(), probs_R, self._fc1_groups() if proj == "fc1" else 1)
            return lora_grouped_linear(x_RI, weight, lora_a, lora_b, counts, self.lora_scaling,
                                       self._dropout_p(), probs_R)

    def _factors(self, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A and B of ``proj`` as the op takes them (a shared factor reduced over EP backward)."""
        factors = [getattr(self, f"{proj}_lora_{which}") for which in ("A", "B")]
        return tuple(self._reduced_over_ep(f) if f.dim() == 2 else f for f in factors)

    def _dropout_p(self) -> float:
        return self.lora_dropout if self.training else 0.0

    def _dropout_rng(self):
        """LoRA dropout of expert rows draws from the expert-parallel RNG stream."""
        if self._dropout_p() == 0.0:
            return contextlib.nullcontext()
        return get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name())

    def forward(self, rows_RL: torch.Tensor, tokens_per_expert_E: torch.Tensor,
                probs_R: torch.Tensor) -> torch.Tensor:
        counts = tokens_per_expert_E.to(device="cpu", dtype=torch.int64)
        if self.fc1_lora_A is not None and self.fc2_lora_A is not None:
            mlp = shared_outer_expert_mlp if self.lora_layout == "shared-outer" else lora_expert_mlp
            with self._dropout_rng():
                return mlp(
                    rows_RL, counts,
                    LoRAGroupedWeights(self.fc1_weight, *self._factors("fc1")),
                    LoRAGroupedWeights(self.fc2_weight, *self._factors("fc2")),
                    self.lora_scaling, self._dropout_p(),
                    activation_func=self.config.activation_func,
                    gated=self.config.gated_linear_unit, probs_T=probs_R)
        act_RF = expert_activation(self._projection("fc1", rows_RL, counts),
                                   self.config.activation_func, self.config.gated_linear_unit)
        return self._projection("fc2", act_RF, counts, probs_R)

    def lora_pieces(self):
        pieces = []
        for proj, linear in (("fc1", "linear_fc1"), ("fc2", "linear_fc2")):
            for factor in ("A", "B"):
                param = getattr(self, f"{proj}_lora_{factor}")
                if param is None:
                    continue
                if param.dim() == 2:  # shared by the layer's experts: replicated, not per expert
                    shape = tuple(param.shape)
                    pieces.append(LoRAPiece(f"{self.lora_name}.{linear}.lora_{factor}.weight",
                                            shape, tuple(full_slice(n) for n in shape),
                                            param.data, True, False))
                    continue
                shape = tuple(param.shape[1:])
                for e in range(self.num_local_experts):
                    name = (f"{self.lora_name}.{self.local_expert_offset + e}.{linear}"
                            f".lora_{factor}.weight")
                    pieces.append(LoRAPiece(name, shape, tuple(full_slice(n) for n in shape),
                                            param.data[e], True, True))
        return pieces

    def lora_delta(self):
        if self.packed is not None:  # a merge would need a requantisation: the export's job
            raise ValueError(f"{self.lora_name}: the experts are held packed; merge their LoRA "
                             f"with slmoe-convert-hf export (it requantises) or build with "
                             f"--expert-weights dequantize")
        deltas = []
        for proj in ("fc1", "fc2"):
            lora_a, lora_b = getattr(self, f"{proj}_lora_A"), getattr(self, f"{proj}_lora_B")
            if lora_a is None:
                continue
            a, b = lora_a.float(), lora_b.float()
            if a.dim() == 2:  # shared A [g r, in]: group j of B_e's rows with A's j-th r rows
                g = self._fc1_groups()
                e, out_features, r = b.shape
                delta = torch.einsum("ejor,jri->ejoi", b.view(e, g, out_features // g, r),
                                     a.view(g, r, -1)).reshape(e, out_features, -1)
            elif b.dim() == 2:  # shared B [out, r]
                delta = torch.matmul(b, a)
            else:
                delta = torch.bmm(b, a)
            deltas.append((getattr(self, f"{proj}_weight"), self.lora_scaling * delta))
        return deltas

    def _lora_strip(self) -> None:
        for name in _EXPERT_LORA:
            delattr(self, name)
        self.__dict__.pop("lora_layout", None)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        ep_size = parallel_state.get_expert_model_parallel_world_size()
        replica_id = (0, parallel_state.get_expert_tensor_parallel_rank(),
                      parallel_state.get_expert_data_parallel_rank())
        for name in _EXPERT_LORA:
            param = getattr(self, name)
            if param is None:
                continue
            key = f"{prefix}{name}"
            if param.dim() == 2:  # shared: the same on every EP and expert-DP rank
                sharded[key] = ShardedTensor.from_rank_offsets(
                    key, param, *sharded_offsets,
                    replica_id=(0, parallel_state.get_expert_tensor_parallel_rank(),
                                parallel_state.get_expert_data_parallel_rank() * ep_size
                                + ep_rank),
                    prepend_axis_num=len(sharded_offsets))
                continue
            # The global expert axis after any layer axes, as the base expert weights.
            sharded[key] = ShardedTensor.from_rank_offsets(
                key, param, *sharded_offsets, (len(sharded_offsets), ep_rank, ep_size),
                replica_id=replica_id, prepend_axis_num=len(sharded_offsets))
        return sharded
