"""LoRA on the latent projections d -> l and l -> d (replicated; sequence-sharded input under SP:
A and B are marked ``sequence_parallel`` like the base weight)."""

from __future__ import annotations

from megatron.core import parallel_state
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

from megatron_slmoe.lora.config import LoRAConfig
from megatron_slmoe.lora.base import (
    TP_RNG,
    LoRALinearMixin,
)
from megatron_slmoe.moe.latent import LatentProjection


class LoRALatentProjection(LoRALinearMixin, LatentProjection):
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
        return super().forward(x) + self._lora_branch_replicated(x, TP_RNG if sp else None)

    def lora_pieces(self):
        return self._replicated_pieces()

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return self._lora_sharded(sharded, prefix, sharded_offsets, metadata, {})
