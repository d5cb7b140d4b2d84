"""Where the tensors of a vision module that is transformers' own (``TowerLanguageModel.vision``)
are in a checkpoint, and reading them: each tensor whole (the module is replicated), from the
first of its stored names the checkpoint has (``ImageModel.hf_sources``), cut and reordered
where the checkpoint fuses or permutes it."""

from __future__ import annotations

import torch

from megatron_slmoe.hf.checkpoint import HFCheckpoint, SliceReader
from megatron_slmoe.families.errors import HFCheckpointError
from megatron_slmoe.families.vision import ImageModel, VisionSource


def find_source(vision: ImageModel, name: str, shape: tuple,
                checkpoint: HFCheckpoint) -> VisionSource:
    """The first stored form of the vision module's tensor ``name`` [``shape``] the checkpoint
    has; one HFCheckpointError line when none, or when it has another shape."""
    sources = vision.hf_sources(name)
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


def check_vision_tensors(vision: ImageModel, checkpoint: HFCheckpoint) -> None:
    """Every tensor of a vision module (built on any device, the meta device too) is in the
    checkpoint with its shape; one HFCheckpointError line otherwise."""
    for name, tensor in vision.state_dict(keep_vars=True).items():
        find_source(vision, name, tuple(tensor.shape), checkpoint)


def load_vision_weights(vision: ImageModel, checkpoint: HFCheckpoint,
                        reader: SliceReader) -> int:
    """Copy every tensor of a vision module from the checkpoint (``ImageModel.hf_sources``);
    the count copied."""
    copied = 0
    with torch.no_grad():
        for name, tensor in vision.state_dict(keep_vars=True).items():
            source = find_source(vision, name, tuple(tensor.shape), checkpoint)
            tensor.copy_(source.convert(reader.read(source.key)))
            copied += 1
    return copied
