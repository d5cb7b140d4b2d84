"""What a multimodal family's vision side is to the rest of the package: an :class:`ImageModel`
(its tower and projector, replicated on the first pipeline stage) and where each of its tensors
is stored in the family's checkpoints (:class:`VisionSource`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_slmoe.lora.targets import DeclaresLoRARegions


@dataclass(frozen=True)
class VisionSource:
    """Where a vision module's tensor is stored: ``key``, or part ``part`` of ``parts`` equal
    rows of it (a fused qkv), with rotary rows stored interleaved per head (``rope_heads``
    heads: the hub layout of MoonViT's q and k) to put in transformers' half-split order."""

    key: str
    part: int = 0
    parts: int = 1
    rope_heads: Optional[int] = None

    def stored_shape(self, shape: tuple) -> tuple:
        return (shape[0] * self.parts, *shape[1:])

    def convert(self, stored: torch.Tensor) -> torch.Tensor:
        tensor = stored.chunk(self.parts, dim=0)[self.part]
        if self.rope_heads:
            rows = tensor.shape[0]
            rest = tensor.shape[1:]
            tensor = (tensor.reshape(self.rope_heads, rows // self.rope_heads // 2, 2, *rest)
                      .transpose(1, 2).reshape(rows, *rest))
        return tensor


class ImageModel(torch.nn.Module, DeclaresLoRARegions):
    """A family's vision tower and projector: ``forward(pixel_values, image_grid_thw)`` -> one
    language-width embedding per image token ``[tokens, hidden]``, images in order, or that and
    a list of DeepStack features of the same shape (one per ``deepstack_layers``). Its LoRA
    regions are declared (``DeclaresLoRARegions``); its tensors are read by ``hf_sources``."""

    hf_prefix: str = "model."
    """Where the checkpoint stores this module's tensors by their own names."""

    @property
    def deepstack_layers(self) -> int:
        """How many of the first decoder layers take DeepStack features from the tower."""
        return 0

    def hf_sources(self, name: str) -> list[VisionSource]:
        """Where the checkpoint stores tensor ``name`` of this module, preferred first."""
        return [VisionSource(self.hf_prefix + name)]

    def layer_shape(self) -> dict[str, int]:
        """What the memory check prices per tower layer (``hf.tower_model.vision_census``):
        layers, hidden, heads, ffn_hidden, patches_per_position."""
        raise NotImplementedError

    def blank_image(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The smallest input the tower takes (one merged patch of zeros) and its grid: run when
        a micro-batch has no image but the tower trains."""
        raise NotImplementedError
