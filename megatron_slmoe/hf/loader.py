"""Streaming, rank-local import of a Hugging Face checkpoint into an already built Megatron model.

``load_hf_weights(model_chunks, hf_dir)`` fills every tensor of this rank's model chunks from the
checkpoint. What a rank holds is Megatron's own account of it: each chunk's
``sharded_state_dict()`` gives every local tensor with its global name (global layer number), its
global shape and the box of it this rank holds (TP slice, EP experts; with the gated-MLP split of
``linear_fc1``). The family's mapping table turns a global tensor into pieces of HF tensors
(``mappings.kinds``); the part of each piece inside the local box is read with
``safe_open(...).get_slice`` and copied in place. So a rank reads only its own slices, never a whole
checkpoint, and its peak host memory while loading is its own shard plus one source tensor and
a bounded window of mapped file pages (``checkpoint.SliceReader`` unmaps a file every 64 MiB it
touched).

Checks, each one :class:`HFCheckpointError` line naming the file and the tensor: a tensor the model
needs that is in no shard, a tensor whose shape disagrees with ``config.json``, a local tensor the
table does not cover completely. Checks that need no process group run first in
:func:`open_hf_checkpoint` (see there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch

from megatron_slmoe.hf.checkpoint import HFCheckpoint, SliceReader
from megatron_slmoe.hf.errors import HFCheckpointError
from megatron_slmoe.hf.mappings import Family, family_for
from megatron_slmoe.hf.mappings.kinds import Overlap
from megatron_slmoe.hf.vision_sources import check_vision_tensors, load_vision_weights
from megatron_slmoe.model.tower_language import TowerLanguageModel


@dataclass
class HFModel:
    """An opened checkpoint with its family and the ModelConfig its config.json describes."""

    checkpoint: HFCheckpoint
    family: Family
    model_config: object  # megatron_slmoe ModelConfig


def open_hf_checkpoint(hf_dir, check_shapes: bool = True) -> HFModel:
    """Open and check a checkpoint directory without any process group: config.json, the
    architecture, the index and shards (missing, truncated, misplaced tensors), and, with
    ``check_shapes``, every tensor's presence and shape against the model config.json describes
    (transformers builds that model on the meta device). Raises HFCheckpointError (one line)."""
    checkpoint = hf_dir if isinstance(hf_dir, HFCheckpoint) else HFCheckpoint.open(hf_dir)
    family = family_for(checkpoint.config, checkpoint.config_path)
    model_config = family.model_config(checkpoint.config, checkpoint.config_path)
    if check_shapes:
        check_against_config(checkpoint, family)
    return HFModel(checkpoint, family, model_config)


def check_against_config(checkpoint: HFCheckpoint, family: Family) -> None:
    """Every tensor of the HF model that ``config.json`` describes is in a shard, in either expert
    layout, with the shape the config implies."""
    hf_config = family.hf_config(checkpoint.config_path)
    with torch.device("meta"):
        model = family.hf_model_class().from_config(hf_config)
    shapes = {key: info.shape for key, info in checkpoint.tensors.items()}
    seen: set[int] = set()
    vision = family.vision_module(hf_config, device="meta")
    if vision is not None:  # read by its own names (hf.vision_sources)
        check_vision_tensors(vision, checkpoint)
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied weights are stored once
            continue
        seen.add(id(tensor))
        if vision is not None and name.startswith(tuple(
                vision.hf_prefix + child for child, _ in vision.named_children())):
            continue
        for key, want in family.layouts.canonical(name, tuple(tensor.shape)):
            found = family.layouts.resolve(key, shapes, want)
            if found is None:
                raise HFCheckpointError(f"{checkpoint.directory}: tensor {key} is in no shard "
                                        f"(config.json describes a model that has it)")
            if found.shape != want:
                raise HFCheckpointError(f"{checkpoint.where(found.stored)} has shape "
                                        f"{list(found.shape)}; {checkpoint.config_path} implies "
                                        f"{list(want)} for {key}")


@dataclass
class LoadReport:
    tensors: int = 0
    """Local Megatron tensors filled."""
    reads: int = 0
    """Slices read from the checkpoint."""
    bytes_read: int = 0
    """Bytes of the slices read (after FP8 dequantisation)."""


def sharded_tensors(state) -> Iterator:
    """The ShardedTensors of a (nested) sharded state dict, factories built (their tensors are
    views of the parameters)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(state, dict):
        for value in state.values():
            yield from sharded_tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from sharded_tensors(value)
    elif isinstance(state, ShardedTensorFactory):
        yield from sharded_tensors(state.build())
    elif isinstance(state, ShardedTensor):
        yield state


def local_box(st) -> tuple[tuple[int, int], ...]:
    if st.prepend_axis_num or st.flattened_range is not None:
        raise HFCheckpointError(f"Megatron tensor {st.key}: stacked or flattened shards are not "
                                f"supported by the HF import")
    return tuple((off, off + n) for off, n in zip(st.global_offset, st.local_shape))


def plan_reads(model_chunks: Iterable, hf: HFModel) -> list[tuple]:
    """(stored HF key, index into it, overlap, local tensor, whether what is read is stored
    transposed) for every slice this rank needs."""
    table = hf.family.table(hf.model_config)
    checkpoint = hf.checkpoint
    shapes = {key: info.shape for key, info in checkpoint.tensors.items()}
    reads = []
    for chunk in model_chunks:
        state = chunk.sharded_state_dict()
        if isinstance(chunk, TowerLanguageModel):  # the vision module is read by its own names
            state = {k: v for k, v in state.items() if not k.startswith("vision.")}
        for st in sharded_tensors(state):
            box = local_box(st)
            pieces = table.pieces(st.key, tuple(st.global_shape))
            if pieces is None:
                raise HFCheckpointError(f"{checkpoint.config_path}: the {hf.family.name} table has "
                                        f"no rule for Megatron tensor {st.key}")
            covered = 0
            for piece in pieces:
                overlap = piece.within(box)
                if overlap is None:
                    continue
                found = hf.family.layouts.resolve(piece.hf_key, shapes, piece.hf_shape)
                if found is None:
                    raise HFCheckpointError(f"{checkpoint.directory}: tensor {piece.hf_key} "
                                            f"(for Megatron {st.key}) is in no shard")
                if found.shape != piece.hf_shape:
                    raise HFCheckpointError(
                        f"{checkpoint.where(found.stored)} has shape {list(found.shape)}; "
                        f"{checkpoint.config_path} implies {list(piece.hf_shape)} for "
                        f"{piece.hf_key} (Megatron {st.key})")
                reads.append((found.stored, found.compose(overlap.hf_index), overlap, st.data,
                              found.transposed))
                covered += math.prod(s.stop - s.start for s in overlap.local_index)
            if covered != st.data.numel():
                raise HFCheckpointError(f"{checkpoint.config_path}: the {hf.family.name} table "
                                        f"covers {covered} of the {st.data.numel()} local "
                                        f"elements of Megatron tensor {st.key}")
    return reads


def _start(index: tuple) -> tuple:
    return tuple(i if isinstance(i, int) else i.start for i in index)


def load_hf_weights(model_chunks, hf_dir, hf: Optional[HFModel] = None,
                    unmap_after_bytes: int = 64 * 2**20) -> LoadReport:
    """Fill this rank's ``model_chunks`` (Megatron modules, one per virtual pipeline stage, or a
    single module) from the HF checkpoint ``hf_dir``, reading only this rank's slices.

    ``hf`` is the :func:`open_hf_checkpoint` of ``hf_dir`` when the caller already opened it (the
    model was built from ``hf.model_config``); ``unmap_after_bytes`` bounds the mapped file pages
    (``SliceReader``). Every rank calls it; no collective is involved."""
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    hf = hf or open_hf_checkpoint(hf_dir, check_shapes=False)
    # An image-text model whose vision module is transformers' own: the language model is read
    # by the table, the vision module by its own names.
    visions = [c.vision for c in model_chunks
               if isinstance(c, TowerLanguageModel) and c.vision is not None]
    reads = plan_reads(model_chunks, hf)
    order = sorted(range(len(reads)), key=lambda i: (
        hf.checkpoint.tensors[reads[i][0]].file, reads[i][0], _start(reads[i][1])))
    report = LoadReport(tensors=len({id(r[3]) for r in reads}))
    with SliceReader(hf.checkpoint, unmap_after_bytes) as reader, torch.no_grad():
        for i in order:
            stored, index, overlap, local, transposed = reads[i]
            data = reader.read(stored, index)
            overlap.to_megatron(data.transpose(-1, -2) if transposed else data, local)
            report.reads += 1
        for vision in visions:
            copied = load_vision_weights(vision, hf.checkpoint, reader)
            report.tensors += copied
            report.reads += copied
        report.bytes_read = reader.bytes_read
    return report
