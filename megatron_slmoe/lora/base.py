"""What every LoRA module shares: the mixin that turns a base module into its LoRA subclass in
place, the layout-independent initialisation, LoRA dropout, and the pieces that say where a rank's
LoRA tensors sit in the adapter file's global tensors.

Every LoRA module keeps its frozen base module and adds ``s * B(A(dropout(x)))`` with
``s = alpha / r``; A is drawn like PEFT (kaiming-uniform, a = sqrt(5)) and B is zero, so the model
is unchanged at step 0.

**In place.** ``from_base(module, ...)`` turns the base module object itself into its LoRA subclass
(``LoRAColumnParallelLinear`` is a ``ColumnParallelLinear``, ...): the frozen base parameters keep
their names (``linear_qkv.weight``), so Megatron's state dicts, the dist-checkpoint keys of the base
model and code that checks module types are unchanged; the adapter adds ``lora_A.weight`` /
``lora_B.weight`` (experts: ``fc1_lora_A`` ... stacked per local expert). ``remove_lora`` undoes it.

**Dropout** of the LoRA input draws from the default RNG where the input is replicated over TP
(the gathered column input: every TP rank must use the same mask), from Megatron's
tensor-parallel tracker where it is sharded (row input, sequence-sharded router/latent input with
SP), and from the expert-parallel tracker for the experts.

**Initialisation** is layout independent: A is drawn in full from a generator seeded by
``(init_seed, global tensor name)`` and each rank keeps its slice, so TP/EP/PP layouts start from
the same adapter.

**Checkpoints.** Each module's ``sharded_state_dict`` gives the LoRA tensors their TP axis, or the
global expert axis for the experts, so Megatron dist checkpointing moves them between TP/EP/PP
layouts. ``lora_pieces()`` says where each local LoRA tensor sits in the unsharded, globally named
tensors of an adapter file (see ``megatron_slmoe.lora.adapter``).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import (
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.utils import (
    make_sharded_tensor_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
)

from megatron_slmoe.lora.config import LoRAConfig

TP_RNG = "model-parallel-rng"  # Megatron's tensor-parallel tracker (distinct per TP rank)


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


def full_slice(n: int) -> slice:
    return slice(0, n)


def shard_slice(rank: int, size: int, local: int) -> slice:
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


def lora_dropout(x: torch.Tensor, p: float, training: bool, tracker: Optional[str]) -> torch.Tensor:
    if not training or p == 0.0:
        return x
    if tracker is None:
        return F.dropout(x, p, training=True)
    with get_cuda_rng_tracker().fork(tracker):
        return F.dropout(x, p, training=True)


def new_param(shape, like: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(shape, dtype=like.dtype, device=like.device))


class LoRAFactor(torch.nn.Module):
    """One LoRA factor as a module holding ``weight``, so that names read ``lora_A.weight``."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def extra_repr(self) -> str:
        return f"shape={tuple(self.weight.shape)}"


def tp_group(module) -> torch.distributed.ProcessGroup:
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


def mark_lora(param: torch.nn.Parameter) -> None:
    param.is_lora = True
    param.requires_grad_(True)



# --- linear layers -------------------------------------------------------------------------------


class LoRALinearMixin(LoRAModule):
    """A/B as ``lora_A`` / ``lora_B`` child modules of a 2-D base ``weight``."""

    def _lora_make(self, shape_a, shape_b, tp_sharded: Optional[dict] = None) -> None:
        """Create A and B; ``tp_sharded`` maps "lora_A"/"lora_B" to (partition dim, stride)."""
        self.lora_A = LoRAFactor(new_param(shape_a, self.weight))
        self.lora_B = LoRAFactor(new_param(shape_b, self.weight))
        for which in ("lora_A", "lora_B"):
            param = getattr(self, which).weight
            mark_lora(param)
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
        x = lora_dropout(x, self.lora_dropout, self.training, tracker)
        a, b = self.lora_A.weight, self.lora_B.weight
        if dtype is not None:
            x, a, b = x.to(dtype), a.to(dtype), b.to(dtype)
        return F.linear(F.linear(x, a), b) * self.lora_scaling

    def _replicated_pieces(self) -> list[LoRAPiece]:
        a, b = self.lora_A.weight, self.lora_B.weight
        return [
            LoRAPiece(f"{self.lora_name}.lora_A.weight", tuple(a.shape),
                      tuple(full_slice(n) for n in a.shape), a.data, True, False),
            LoRAPiece(f"{self.lora_name}.lora_B.weight", tuple(b.shape),
                      tuple(full_slice(n) for n in b.shape), b.data, True, False),
        ]

    def _lora_sharded(self, sharded, prefix, sharded_offsets, metadata, tp_axes: dict[str, int],
                      glu_b: bool = False):
        """Replace the LoRA entries of the base module's sharded state dict by ours."""
        singleton_local_shards = metadata.get("singleton_local_shards", False)
        groups = dict(tp_group=tp_group(self), dp_cp_group=metadata["dp_cp_group"])
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


# --- in-place wrapping ---------------------------------------------------------------------------


def is_lora_module(module: torch.nn.Module) -> bool:
    return isinstance(module, LoRAModule)
