"""LoRA on the router's gating linear (full width, replicated; sequence-sharded input under SP:
A and B are marked ``sequence_parallel`` like the router weight), computed in the router dtype."""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
from megatron.core.utils import (
    get_pg_size,
)

from megatron_slmoe.lora.config import LoRAConfig
from megatron_slmoe.lora.base import (
    TP_RNG,
    LoRALinearMixin,
    tp_group,
)


class LoRARouterMixin(LoRALinearMixin):
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
        sp = self.config.sequence_parallel and get_pg_size(tp_group(self)) > 1
        return logits + self._lora_branch_replicated(input, TP_RNG if sp else None,
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
