"""Where the tensors of a vision module that is transformers' own (``TowerLanguageModel.vision``)
are in a checkpoint, and reading them: each tensor whole (the module is replicated), from the
first of its stored names the checkpoint has (a module lists them in ``hf_sources``; by default
its own name under ``hf_prefix``), cut and reordered where the checkpoint fuses or permutes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_slmoe.hf.checkpoint import HFCheckpoint, SliceReader
from megatron_slmoe.hf.errors import HFCheckpointError


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


def vision_sources(vision: torch.nn.Module, name: str) -> list[VisionSource]:
    """A vision module's stored names for its tensor ``name``, preferred first: the module's own
    ``hf_sources`` if it has them, else its name under ``hf_prefix``."""
    if hasattr(vision, "hf_sources"):
        return vision.hf_sources(name)
    return [VisionSource(vision.hf_prefix + name)]


def find_source(vision, name: str, shape: tuple, checkpoint: HFCheckpoint) -> VisionSource:
    """The first stored form of the vision module's tensor ``name`` [``shape``] the checkpoint
    has; one HFCheckpointError line when none, or when it has another shape."""
    sources = vision_sources(vision, name)
    found = next((s for s in sources if s.key in checkpoint.tensors), None)
    if found is None:
        raise HFCheckpointError(f"{checkpoint.directory}: tensor {sources[0].key} (vision) is "
                                f"in no shard")
    stored = tuple(checkpoint.tensors[found.key].shape)
    if stored != found.stored_shape(shape):
        raise HFCheckpointError(f"{checkpoint.where(found.key)} has shape {list(stored)}; "
                                f"{checkpoint.config_path} implies "
                                f"{list(found.stored_shape(shape))} for {found.key}")
    return found


def check_vision_tensors(vision: torch.nn.Module, checkpoint: HFCheckpoint) -> None:
    """Every tensor of a vision module (built on any device, the meta device too) is in the
    checkpoint with its shape; one HFCheckpointError line otherwise."""
    for name, tensor in vision.state_dict(keep_vars=True).items():
        find_source(vision, name, tuple(tensor.shape), checkpoint)


def load_vision_weights(vision: torch.nn.Module, checkpoint: HFCheckpoint,
                        reader: SliceReader) -> int:
    """Copy every tensor of a vision module from the checkpoint (see :func:`vision_sources`);
    the count copied."""
    copied = 0
    with torch.no_grad():
        for name, tensor in vision.state_dict(keep_vars=True).items():
            source = find_source(vision, name, tuple(tensor.shape), checkpoint)
            tensor.copy_(source.convert(reader.read(source.key)))
            copied += 1
    return copied
