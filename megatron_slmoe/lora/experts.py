"""LoRA on the routed experts: per local expert A/B for fc1 and fc2 on the fused grouped op, marked
as expert weights (``moe.experts.mark_expert_parameter``), one adapter per global expert."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
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
from megatron_slmoe.moe.experts import LatentSwiGLUExperts, mark_expert_parameter
from megatron_slmoe.ops.lora_expert import (
    LoRAGroupedWeights,
    expert_activation,
    lora_expert_mlp,
    lora_grouped_linear,
)

# --- routed experts ------------------------------------------------------------------------------


_EXPERT_LORA = ("fc1_lora_A", "fc1_lora_B", "fc2_lora_A", "fc2_lora_B")


class LoRALatentSwiGLUExperts(LoRAModule, LatentSwiGLUExperts):
    """``LatentSwiGLUExperts`` with one LoRA per expert on fc1 and/or fc2.

    Same interface ``forward(rows_RL, tokens_per_expert_E, probs_R)``; with both projections
    adapted it is the expert MLP op ``lora_expert_mlp`` (one fused grouped op per projection:
    frozen stacked W plus s * B_e A_e per expert), the router probability applied by the fc2 op to
    its output rows (fc2 being linear, the same as scaling its input like the base experts). A LoRA tensors are [E_local, r, in], B [E_local, out, r]; an unadapted projection has
    none and runs the base math.
    """

    def __init__(self, config, num_local_experts: int, local_expert_offset: int,
                 lora_config: LoRAConfig, name: str = "experts", fc1: bool = True,
                 fc2: bool = True) -> None:
        super().__init__(config, num_local_experts, local_expert_offset)
        self._lora_attach(lora_config, name, fc1, fc2, LatentSwiGLUExperts)

    @classmethod
    def from_base(cls, base: LatentSwiGLUExperts, lora_config: LoRAConfig, name: str,
                  fc1: bool = True, fc2: bool = True) -> "LoRALatentSwiGLUExperts":
        if type(base) is not LatentSwiGLUExperts:
            raise TypeError(f"{name}: expected LatentSwiGLUExperts, got {type(base).__name__}")
        base.__class__ = cls
        base._lora_attach(lora_config, name, fc1, fc2, LatentSwiGLUExperts)
        return base

    def _lora_attach(self, lora_config, name, fc1, fc2, base_class) -> None:
        if not (fc1 or fc2):
            raise ValueError(f"{name}: expert LoRA needs fc1 or fc2")
        self._lora_setup(lora_config, name, base_class)
        self.fc1_weight.requires_grad_(False)
        self.fc2_weight.requires_grad_(False)
        r, e = lora_config.rank, self.num_local_experts
        for proj, on in (("fc1", fc1), ("fc2", fc2)):
            weight = getattr(self, f"{proj}_weight")
            out_features, in_features = weight.shape[1:]
            if on:
                setattr(self, f"{proj}_lora_A", new_param((e, r, in_features), weight))
                setattr(self, f"{proj}_lora_B", new_param((e, out_features, r), weight))
            else:
                self.register_parameter(f"{proj}_lora_A", None)
                self.register_parameter(f"{proj}_lora_B", None)
        for param in self.lora_parameters():
            mark_lora(param)
            mark_expert_parameter(param)
        self._lora_init_a(lora_config.init_seed)

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
            parts = [F.linear(x, weight[e]) for e, x in enumerate(x_RI.split(counts.tolist()))]
            return torch.cat(parts) if parts else x_RI.new_zeros(0, weight.shape[1])
        with self._dropout_rng():
            return lora_grouped_linear(x_RI, weight, lora_a, lora_b, counts, self.lora_scaling,
                                       self._dropout_p(), probs_R)

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
            with self._dropout_rng():
                return lora_expert_mlp(
                    rows_RL, counts,
                    LoRAGroupedWeights(self.fc1_weight, self.fc1_lora_A, self.fc1_lora_B),
                    LoRAGroupedWeights(self.fc2_weight, self.fc2_lora_A, self.fc2_lora_B),
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
                shape = tuple(param.shape[1:])
                for e in range(self.num_local_experts):
                    name = (f"{self.lora_name}.{self.local_expert_offset + e}.{linear}"
                            f".lora_{factor}.weight")
                    pieces.append(LoRAPiece(name, shape, tuple(full_slice(n) for n in shape),
                                            param.data[e], True, True))
        return pieces

    def lora_delta(self):
        deltas = []
        for proj in ("fc1", "fc2"):
            lora_a, lora_b = getattr(self, f"{proj}_lora_A"), getattr(self, f"{proj}_lora_B")
            if lora_a is not None:
                delta = self.lora_scaling * torch.bmm(lora_b.float(), lora_a.float())
                deltas.append((getattr(self, f"{proj}_weight"), delta))
        return deltas

    def _lora_strip(self) -> None:
        for name in _EXPERT_LORA:
            delattr(self, name)

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
            # The global expert axis after any layer axes, as the base expert weights.
            sharded[key] = ShardedTensor.from_rank_offsets(
                key, param, *sharded_offsets, (len(sharded_offsets), ep_rank, ep_size),
                replica_id=replica_id, prepend_axis_num=len(sharded_offsets))
        return sharded
