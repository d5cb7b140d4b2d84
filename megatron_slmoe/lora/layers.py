"""LoRA on Megatron-Core modules and on the stacked latent experts.

Every LoRA module keeps its frozen base module and adds ``s * B(A(dropout(x)))`` with
``s = alpha / r``; A is drawn like PEFT (kaiming-uniform, a = sqrt(5)) and B is zero, so the model
is unchanged at step 0.

**In place.** ``add_lora(module, ...)`` turns the base module object itself into its LoRA subclass
(``LoRAColumnParallelLinear`` is a ``ColumnParallelLinear``, ...): the frozen base parameters keep
their names (``linear_qkv.weight``), so Megatron's state dicts, the dist-checkpoint keys of the base
model and code that checks module types are unchanged; the adapter adds ``lora_A.weight`` /
``lora_B.weight`` (experts: ``fc1_lora_A`` ... stacked per local expert). ``remove_lora`` undoes it.

**Tensor parallelism.** With the TP group of the base linear (size t, rank i):

* ``ColumnParallelLinear`` (output sharded; qkv, fc1): A [r, in] is replicated, B [out/t, r] is
  sharded like the base weight (rows ``[gate_i; up_i]`` for a gated fc1, stride 2, as Megatron's).
  The LoRA branch sees the same input as the base: with sequence parallelism it is gathered with
  Megatron's ``gather_from_sequence_parallel_region`` (backward: split, see below). Then
  ``h = A x`` [T, r] is identical on every rank; it goes through
  ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce of dL/dh backward), and
  ``y_i = s * B_i h`` is this rank's slice of the TP=1 output. Backward: dL/dh summed over the TP
  ranks is the TP=1 dL/dh, so dA = dh^T x is the full gradient on every rank (A needs no further
  reduction and is not marked ``sequence_parallel``) and dx = dh A is full too: the sequence
  gather's backward only splits it (no reduce-scatter), without SP it is added as it is. The extra
  communication is an all-reduce of [T, r] per linear in backward (and, with SP, the all-gather of
  the input in forward).
* ``RowParallelLinear`` (input sharded; proj, fc2): A [r, in/t] is sharded on dim 1, B [out, r] is
  replicated. ``h_i = A_i x_i`` is a partial sum; ``h = sum_i h_i`` is formed exactly where the base
  output is: ``reduce_scatter_to_sequence_parallel_region`` with SP (h is then [T/t, r], sequence
  sharded, so B sees sequence-sharded input and is marked ``sequence_parallel`` for
  finalize_model_grads), ``reduce_from_tensor_model_parallel_region`` without (B's gradient is
  then full and identical on every rank). ``y = s * B h`` equals the TP=1 output (its sequence
  shard with SP).
* Router and latent projections are replicated with sequence-sharded inputs: A and B replicated,
  marked ``sequence_parallel`` exactly like their base weight.
* Routed experts (``LoRALatentSwiGLUExperts``): per local expert A/B for fc1 and fc2, marked
  ``allreduce = False`` (reduced over expert-data-parallel ranks), one adapter per global expert.

**Dropout** of the LoRA input draws from the default RNG where the input is replicated over TP
(the gathered column input: every TP rank must use the same mask), from Megatron's
tensor-parallel tracker where it is sharded (row input, sequence-sharded router/latent input with
SP), and from the expert-parallel tracker for the experts.

**Initialisation** is layout independent: A is drawn in full from a generator seeded by
``(init_seed, global tensor name)`` and each rank keeps its slice, so TP/EP/PP layouts start from
the same adapter.

**Checkpoints.** ``sharded_state_dict`` gives the LoRA tensors their TP axis (and the swiglu split
for a gated fc1's B, as Megatron's MLP does for the base weight), or the global expert axis for the
experts, so Megatron dist checkpointing moves them between TP/EP/PP layouts. ``lora_pieces()`` says
where each local LoRA tensor sits in the unsharded, globally named tensors of an adapter file
(see ``megatron_slmoe.lora.adapter``).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
from megatron.core.utils import (
    get_pg_rank,
    get_pg_size,
    make_sharded_tensor_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
)

from megatron_slmoe.lora.config import LoRAConfig
from megatron_slmoe.moe.experts import LatentSwiGLUExperts
from megatron_slmoe.moe.latent import LatentProjection
from megatron_slmoe.ops.lora_expert import expert_activation, lora_grouped_linear

_TP_RNG = "model-parallel-rng"  # Megatron's tensor-parallel tracker (distinct per TP rank)


# --- pieces: where local LoRA tensors sit in the adapter's global tensors ------------------------


@dataclass
class LoRAPiece:
    """A block of one global adapter tensor held by this rank."""

    name: str
    """Global tensor name in adapter_model.safetensors."""
    global_shape: tuple[int, ...]
    index: tuple[slice, ...]
    """Where ``local`` sits in the global tensor."""
    local: torch.Tensor
    """A view of this rank's parameter (writing into it writes the parameter)."""
    replicated_over_tp: bool
    """Every rank of the module's TP group holds the same block."""
    expert: bool
    """An expert tensor: replicas live on the expert-data-parallel ranks."""


def _full(n: int) -> slice:
    return slice(0, n)


def _shard(rank: int, size: int, local: int) -> slice:
    return slice(rank * local, (rank + 1) * local)


# --- helpers -------------------------------------------------------------------------------------


def _seed_for(name: str, seed: int) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_lora_a(global_shape: tuple[int, ...], name: str, seed: int) -> torch.Tensor:
    """The full initial LoRA A of global tensor ``name`` (fp32, CPU): PEFT's kaiming-uniform
    (a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))) from a generator seeded by (seed, name)."""
    generator = torch.Generator(device="cpu").manual_seed(_seed_for(name, seed))
    tensor = torch.empty(global_shape, dtype=torch.float32)
    torch.nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
    return tensor


def _dropout(x: torch.Tensor, p: float, training: bool, tracker: Optional[str]) -> torch.Tensor:
    if not training or p == 0.0:
        return x
    if tracker is None:
        return F.dropout(x, p, training=True)
    with get_cuda_rng_tracker().fork(tracker):
        return F.dropout(x, p, training=True)


def _new_param(shape, like: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(shape, dtype=like.dtype, device=like.device))


class LoRAFactor(torch.nn.Module):
    """One LoRA factor as a module holding ``weight``, so that names read ``lora_A.weight``."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def extra_repr(self) -> str:
        return f"shape={tuple(self.weight.shape)}"


def _tp_group(module) -> torch.distributed.ProcessGroup:
    group = getattr(module, "tp_group", None)
    return group if group is not None else parallel_state.get_tensor_model_parallel_group()


class LoRAModule:
    """Behaviour shared by the LoRA subclasses: a mixin listed before the base module class
    (after it for routers, see ``lora_router_class``)."""

    lora_name: str
    """Global name of the adapted module (``decoder.layers.3.self_attention.linear_qkv``)."""
    lora_rank: int
    lora_alpha: float
    lora_scaling: float
    lora_dropout: float
    _lora_base_class: type

    def _lora_setup(self, lora_config: LoRAConfig, name: str, base_class: type) -> None:
        self.lora_name = name
        self.lora_rank = lora_config.rank
        self.lora_alpha = float(lora_config.alpha)
        self.lora_scaling = lora_config.scaling
        self.lora_dropout = float(lora_config.dropout)
        self._lora_base_class = base_class

    def lora_parameters(self) -> list[torch.nn.Parameter]:
        raise NotImplementedError

    def lora_pieces(self) -> list[LoRAPiece]:
        raise NotImplementedError

    def _lora_init_a(self, seed: int) -> None:
        """Fill every A from its layout-independent draw, B with zeros."""
        with torch.no_grad():
            for piece in self.lora_pieces():
                if ".lora_A." in piece.name:
                    full = init_lora_a(piece.global_shape, piece.name, seed)
                    piece.local.copy_(full[piece.index])
                else:
                    piece.local.zero_()

    def lora_delta(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(base weight, s * B A in fp32 shaped like it) for every adapted weight."""
        raise NotImplementedError

    def _lora_strip(self) -> None:
        raise NotImplementedError

    def merge_lora_(self) -> None:
        """Fold ``W += s * B A`` into the frozen base weight(s) (this rank's shards)."""
        with torch.no_grad():
            for weight, delta in self.lora_delta():
                weight.copy_((weight.float() + delta).to(weight.dtype))

    def remove_lora(self):
        """Drop the adapter and give the module back its base class; returns the module."""
        self._lora_strip()
        for attr in ("lora_name", "lora_rank", "lora_alpha", "lora_scaling", "lora_dropout"):
            self.__dict__.pop(attr, None)
        base_class = self._lora_base_class
        del self._lora_base_class
        self.__class__ = base_class
        return self


def _mark_lora(param: torch.nn.Parameter) -> None:
    param.is_lora = True
    param.requires_grad_(True)


# --- linear layers -------------------------------------------------------------------------------


class _LoRALinear(LoRAModule):
    """A/B as ``lora_A`` / ``lora_B`` child modules of a 2-D base ``weight``."""

    def _lora_make(self, shape_a, shape_b, tp_sharded: Optional[dict] = None) -> None:
        """Create A and B; ``tp_sharded`` maps "lora_A"/"lora_B" to (partition dim, stride)."""
        self.lora_A = LoRAFactor(_new_param(shape_a, self.weight))
        self.lora_B = LoRAFactor(_new_param(shape_b, self.weight))
        for which in ("lora_A", "lora_B"):
            param = getattr(self, which).weight
            _mark_lora(param)
            if tp_sharded and which in tp_sharded:
                set_tensor_model_parallel_attributes(param, True, *tp_sharded[which])
            else:
                set_defaults_if_not_set_tensor_model_parallel_attributes(param)

    def lora_parameters(self):
        return [self.lora_A.weight, self.lora_B.weight]

    def lora_delta(self):
        delta = self.lora_scaling * (self.lora_B.weight.float() @ self.lora_A.weight.float())
        return [(self.weight, delta)]

    def _lora_strip(self) -> None:
        del self.lora_A
        del self.lora_B

    def _lora_branch_replicated(self, x: torch.Tensor, tracker: Optional[str],
                                dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        x = _dropout(x, self.lora_dropout, self.training, tracker)
        a, b = self.lora_A.weight, self.lora_B.weight
        if dtype is not None:
            x, a, b = x.to(dtype), a.to(dtype), b.to(dtype)
        return F.linear(F.linear(x, a), b) * self.lora_scaling

    def _replicated_pieces(self) -> list[LoRAPiece]:
        a, b = self.lora_A.weight, self.lora_B.weight
        return [
            LoRAPiece(f"{self.lora_name}.lora_A.weight", tuple(a.shape),
                      tuple(_full(n) for n in a.shape), a.data, True, False),
            LoRAPiece(f"{self.lora_name}.lora_B.weight", tuple(b.shape),
                      tuple(_full(n) for n in b.shape), b.data, True, False),
        ]

    def _lora_sharded(self, sharded, prefix, sharded_offsets, metadata, tp_axes: dict[str, int],
                      glu_b: bool = False):
        """Replace the LoRA entries of the base module's sharded state dict by ours."""
        singleton_local_shards = metadata.get("singleton_local_shards", False)
        groups = dict(tp_group=_tp_group(self), dp_cp_group=metadata["dp_cp_group"])
        for which in ("lora_A", "lora_B"):
            key = f"{prefix}{which}.weight"
            tensor = getattr(self, which).weight
            axis = tp_axes.get(which)
            if axis is None:
                entry = make_sharded_tensor_for_checkpoint(tensor, key, sharded_offsets, **groups)
            else:
                entry = make_tp_sharded_tensor_for_checkpoint(
                    tensor, key, axis, None, sharded_offsets, **groups)
                if which == "lora_B" and glu_b:
                    entry = apply_swiglu_sharded_factory(entry, sharded_offsets,
                                                         singleton_local_shards)
            sharded[key] = entry
        return sharded


class LoRAColumnParallelLinear(_LoRALinear, ColumnParallelLinear):
    """ColumnParallelLinear + LoRA: A [r, in] replicated, B [out/tp, r] sharded like the weight."""

    lora_glu: bool
    """fc1 of a gated MLP: B's local rows are [gate_i; up_i] (checkpointed like the weight)."""

    @classmethod
    def from_base(cls, base: ColumnParallelLinear, lora_config: LoRAConfig, name: str,
                  glu: bool = False) -> "LoRAColumnParallelLinear":
        if type(base) is not ColumnParallelLinear:
            raise TypeError(f"{name}: LoRA supports Megatron's ColumnParallelLinear, "
                            f"not {type(base).__name__}")
        if base.is_expert or base.disable_grad_reduce:
            raise TypeError(f"{name}: LoRA does not support expert or grad-reduce-disabled "
                            f"ColumnParallelLinear")
        base.__class__ = cls
        base._lora_setup(lora_config, name, ColumnParallelLinear)
        base.lora_glu = glu
        r = lora_config.rank
        base._lora_make((r, base.input_size), (base.output_size_per_partition, r),
                        {"lora_B": (0, getattr(base.weight, "partition_stride", 1))})
        base._lora_init_a(lora_config.init_seed)
        return base

    def forward(self, input_, weight=None, runtime_gather_output=None):
        output, output_bias = super().forward(input_, weight, runtime_gather_output)
        gather_output = self.gather_output if runtime_gather_output is None else runtime_gather_output
        return output + self._lora_column(input_, gather_output), output_bias

    def _lora_column(self, x: torch.Tensor, gather_output: bool) -> torch.Tensor:
        group = _tp_group(self)
        if self.sequence_parallel:
            # The base gathers the sequence too; our dL/dx is already full: backward splits.
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False,
                                                     group=group)
        x = _dropout(x, self.lora_dropout, self.training, None)  # same mask on every TP rank
        h = F.linear(x, self.lora_A.weight)
        h = copy_to_tensor_model_parallel_region(h, group=group)  # backward: sum dL/dh over TP
        y = F.linear(h, self.lora_B.weight) * self.lora_scaling
        if gather_output:
            y = gather_from_tensor_model_parallel_region(y, group=group)
        return y

    def lora_pieces(self):
        group = _tp_group(self)
        rank, size = get_pg_rank(group), get_pg_size(group)
        a, b = self.lora_A.weight, self.lora_B.weight
        r = self.lora_rank
        pieces = [LoRAPiece(f"{self.lora_name}.lora_A.weight", tuple(a.shape),
                            (_full(r), _full(a.shape[1])), a.data, True, False)]
        name_b = f"{self.lora_name}.lora_B.weight"
        out_local = b.shape[0]
        if self.lora_glu:
            half = out_local // 2
            total_half = half * size
            for part in range(2):  # gate rows, then up rows
                rows = slice(part * total_half + rank * half, part * total_half + (rank + 1) * half)
                pieces.append(LoRAPiece(name_b, (2 * total_half, r), (rows, _full(r)),
                                        b.data[part * half:(part + 1) * half], False, False))
        else:
            pieces.append(LoRAPiece(name_b, (out_local * size, r),
                                    (_shard(rank, size, out_local), _full(r)), b.data, False,
                                    False))
        return pieces

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return self._lora_sharded(sharded, prefix, sharded_offsets, metadata, {"lora_B": 0},
                                  glu_b=self.lora_glu)

    def _lora_strip(self) -> None:
        super()._lora_strip()
        self.__dict__.pop("lora_glu", None)


class LoRARowParallelLinear(_LoRALinear, RowParallelLinear):
    """RowParallelLinear + LoRA: A [r, in/tp] sharded like the weight, B [out, r] replicated."""

    @classmethod
    def from_base(cls, base: RowParallelLinear, lora_config: LoRAConfig,
                  name: str) -> "LoRARowParallelLinear":
        if type(base) is not RowParallelLinear:
            raise TypeError(f"{name}: LoRA supports Megatron's RowParallelLinear, "
                            f"not {type(base).__name__}")
        if base.is_expert:
            raise TypeError(f"{name}: LoRA does not support expert RowParallelLinear")
        base.__class__ = cls
        base._lora_setup(lora_config, name, RowParallelLinear)
        r = lora_config.rank
        base._lora_make((r, base.input_size_per_partition), (base.output_size, r),
                        {"lora_A": (1, getattr(base.weight, "partition_stride", 1))})
        # With SP, B sees this rank's sequence shard: finalize_model_grads sums it over TP.
        base.lora_B.weight.sequence_parallel = bool(base.sequence_parallel)
        base._lora_init_a(lora_config.init_seed)
        return base

    def forward(self, input_):
        output, output_bias = super().forward(input_)
        return output + self._lora_row(input_), output_bias

    def _lora_row(self, x: torch.Tensor) -> torch.Tensor:
        group = _tp_group(self)
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, group=group)
        tracker = _TP_RNG if get_pg_size(group) > 1 else None
        x = _dropout(x, self.lora_dropout, self.training, tracker)
        h = F.linear(x, self.lora_A.weight)  # partial sum over this rank's input slice
        if self.sequence_parallel:
            h = reduce_scatter_to_sequence_parallel_region(h, group=group)
        else:
            h = reduce_from_tensor_model_parallel_region(h, group=group)
        return F.linear(h, self.lora_B.weight) * self.lora_scaling

    def lora_pieces(self):
        group = _tp_group(self)
        rank, size = get_pg_rank(group), get_pg_size(group)
        a, b = self.lora_A.weight, self.lora_B.weight
        r, in_local = a.shape
        return [
            LoRAPiece(f"{self.lora_name}.lora_A.weight", (r, in_local * size),
                      (_full(r), _shard(rank, size, in_local)), a.data, False, False),
            LoRAPiece(f"{self.lora_name}.lora_B.weight", tuple(b.shape),
                      (_full(b.shape[0]), _full(r)), b.data, True, False),
        ]

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return self._lora_sharded(sharded, prefix, sharded_offsets, metadata, {"lora_A": 1})


class LoRALatentProjection(_LoRALinear, LatentProjection):
    """Latent projection + LoRA (replicated, sequence-sharded input under SP)."""

    @classmethod
    def from_base(cls, base: LatentProjection, lora_config: LoRAConfig,
                  name: str) -> "LoRALatentProjection":
        if type(base) is not LatentProjection:
            raise TypeError(f"{name}: expected a LatentProjection, got {type(base).__name__}")
        base.__class__ = cls
        base._lora_setup(lora_config, name, LatentProjection)
        out_features, in_features = base.weight.shape
        base._lora_make((lora_config.rank, in_features), (out_features, lora_config.rank))
        for param in base.lora_parameters():
            param.sequence_parallel = bool(getattr(base.weight, "sequence_parallel", False))
        base._lora_init_a(lora_config.init_seed)
        return base

    def forward(self, x):
        sp = self.config.sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1
        return super().forward(x) + self._lora_branch_replicated(x, _TP_RNG if sp else None)

    def lora_pieces(self):
        return self._replicated_pieces()

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return self._lora_sharded(sharded, prefix, sharded_offsets, metadata, {})


class LoRARouterMixin(_LoRALinear):
    """Router + LoRA on its gating linear, computed in the router dtype (fp32 logits)."""

    @classmethod
    def from_base(cls, base: TopKRouter, lora_config: LoRAConfig, name: str):
        if not isinstance(base, TopKRouter):
            raise TypeError(f"{name}: expected a Megatron TopKRouter, got {type(base).__name__}")
        base_class = type(base)
        base.__class__ = lora_router_class(base_class)
        base._lora_setup(lora_config, name, base_class)
        num_experts, hidden = base.weight.shape
        base._lora_make((lora_config.rank, hidden), (num_experts, lora_config.rank))
        for param in base.lora_parameters():
            param.sequence_parallel = bool(getattr(base.weight, "sequence_parallel", False))
        base._lora_init_a(lora_config.init_seed)
        return base

    # The router classes come first in the LoRA router's bases (Python refuses the in-place class
    # change otherwise: Router derives from ABC), so these overrides are copied into the class
    # namespace by lora_router_class and call the base class explicitly.

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        logits = self._lora_base_class.gating(self, input)
        sp = self.config.sequence_parallel and get_pg_size(_tp_group(self)) > 1
        return logits + self._lora_branch_replicated(input, _TP_RNG if sp else None,
                                                     dtype=logits.dtype)

    def lora_pieces(self):
        return self._replicated_pieces()

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sharded = self._lora_base_class.sharded_state_dict(self, prefix, sharded_offsets, metadata)
        return self._lora_sharded(sharded, prefix, sharded_offsets, metadata, {})


_ROUTER_OVERRIDES = ("gating", "sharded_state_dict", "lora_pieces")
_ROUTER_CLASSES: dict[type, type] = {}


def lora_router_class(router_class: type) -> type:
    """The LoRA subclass of a router class (one per class, importable from this module)."""
    if router_class not in _ROUTER_CLASSES:
        name = f"LoRA{router_class.__name__}"
        namespace = {"__module__": __name__, "__qualname__": name}
        namespace.update({attr: LoRARouterMixin.__dict__[attr] for attr in _ROUTER_OVERRIDES})
        cls = type(name, (router_class, LoRARouterMixin), namespace)
        globals().setdefault(name, cls)
        _ROUTER_CLASSES[router_class] = cls
    return _ROUTER_CLASSES[router_class]


# --- routed experts ------------------------------------------------------------------------------


_EXPERT_LORA = ("fc1_lora_A", "fc1_lora_B", "fc2_lora_A", "fc2_lora_B")


class LoRALatentSwiGLUExperts(LoRAModule, LatentSwiGLUExperts):
    """``LatentSwiGLUExperts`` with one LoRA per expert on fc1 and/or fc2.

    Same interface ``forward(rows_RL, tokens_per_expert_E, probs_R)``; each adapted projection runs
    through the fused grouped op ``lora_grouped_linear`` (frozen stacked W plus s * B_e A_e per
    expert), and the router probability scales the activation before fc2 exactly as in the base
    experts. A LoRA tensors are [E_local, r, in], B [E_local, out, r]; an unadapted projection has
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
                setattr(self, f"{proj}_lora_A", _new_param((e, r, in_features), weight))
                setattr(self, f"{proj}_lora_B", _new_param((e, out_features, r), weight))
            else:
                self.register_parameter(f"{proj}_lora_A", None)
                self.register_parameter(f"{proj}_lora_B", None)
        for param in self.lora_parameters():
            _mark_lora(param)
            param.allreduce = False  # expert parameters: reduced over expert-data-parallel ranks
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        self._lora_init_a(lora_config.init_seed)

    def lora_parameters(self):
        return [p for p in (getattr(self, n) for n in _EXPERT_LORA) if p is not None]

    def _projection(self, proj: str, x_RI: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        weight = getattr(self, f"{proj}_weight")
        lora_a, lora_b = getattr(self, f"{proj}_lora_A"), getattr(self, f"{proj}_lora_B")
        if lora_a is None:  # not adapted: the base experts' math
            parts = [F.linear(x, weight[e]) for e, x in enumerate(x_RI.split(counts.tolist()))]
            return torch.cat(parts) if parts else x_RI.new_zeros(0, weight.shape[1])
        p = self.lora_dropout if self.training else 0.0
        if p > 0.0:
            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                return lora_grouped_linear(x_RI, weight, lora_a, lora_b, counts,
                                           self.lora_scaling, p)
        return lora_grouped_linear(x_RI, weight, lora_a, lora_b, counts, self.lora_scaling, 0.0)

    def forward(self, rows_RL: torch.Tensor, tokens_per_expert_E: torch.Tensor,
                probs_R: torch.Tensor) -> torch.Tensor:
        counts = tokens_per_expert_E.to(device="cpu", dtype=torch.int64)
        act_RF = expert_activation(self._projection("fc1", rows_RL, counts),
                                   self.config.activation_func, self.config.gated_linear_unit)
        return self._projection("fc2", act_RF * probs_R.unsqueeze(-1).to(act_RF.dtype), counts)

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
                    pieces.append(LoRAPiece(name, shape, tuple(_full(n) for n in shape),
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


# --- in-place wrapping ---------------------------------------------------------------------------


def is_lora_module(module: torch.nn.Module) -> bool:
    return isinstance(module, LoRAModule)


def lora_parameter_ids(modules) -> set[int]:
    return {id(p) for m in modules for p in m.lora_parameters()}
