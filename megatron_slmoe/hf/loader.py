"""Streaming, rank-local import of a Hugging Face checkpoint into an already built Megatron model.

``load_hf_weights(model_chunks, hf_dir)`` fills every tensor of this rank's model chunks from the
checkpoint. What a rank holds is Megatron's own account of it: each chunk's
``sharded_state_dict()`` gives every local tensor with its global name (global layer number), its
global shape and the box of it this rank holds (TP slice, EP experts; with the gated-MLP split of
``linear_fc1``). The family's mapping table turns a global tensor into pieces of HF tensors
(``families.kinds``); the part of each piece inside the local box is read with
``safe_open(...).get_slice`` and copied in place. So a rank reads only its own slices, never a whole
checkpoint, and its peak host memory while loading is its own shard plus one source tensor and
a bounded window of mapped file pages (``checkpoint.SliceReader`` unmaps a file every 64 MiB it
touched).

Routed experts held packed (``--expert-weights packed``, :func:`expert_weights_layout`) are
filled from the checkpoint's packed bytes and scales as stored (``SliceReader.read_packed``):
their sharded state dict names the buffers (``..._weight_packed`` / ``..._weight_scale``), the
table's pieces of the logical weight say which rows of which packed HF tensor go where, and
nothing is decoded (:func:`plan_packed_reads`).

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

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.hf.checkpoint import HFCheckpoint, SliceReader
from megatron_slmoe.families.errors import HFCheckpointError
from megatron_slmoe.families import Family, family_for
from megatron_slmoe.hf.vision_sources import check_vision_tensors, load_vision_weights
from megatron_slmoe.model.tower_language import TowerLanguageModel
from megatron_slmoe.moe.config import PackedExperts
from megatron_slmoe.ops.quantized_weights import (
    BLOCK_FP8,
    INT4,
    MXFP4,
    PackedWeight,
    QuantizedWeightError,
)

_ROUTED_EXPERT = ".experts."  # in the HF names of routed experts (not shared_experts)
_SCALE_DTYPES = {"U8": "uint8", "BF16": "bfloat16", "F16": "float16", "F32": "float32"}
# packed buffer dtype -> (format, inputs per element)
_PACKED_BUFFER = {torch.uint8: (MXFP4, 2), torch.int32: (INT4, 8),
                  torch.float8_e4m3fn: (BLOCK_FP8, 1)}


@dataclass
class HFModel:
    """An opened checkpoint with its family and the ModelConfig its config.json describes."""

    checkpoint: HFCheckpoint
    family: Family
    model_config: object  # megatron_slmoe ModelConfig

    @property
    def multimodal(self) -> bool:
        """Whether this checkpoint holds its family's vision side."""
        return self.family.has_vision(self.checkpoint.config)


def open_hf_checkpoint(hf_dir, check_shapes: bool = True) -> HFModel:
    """Open and check a checkpoint directory without any process group: config.json, the
    architecture, the index and shards (missing, truncated, misplaced tensors), and, with
    ``check_shapes``, every tensor's presence and shape against the model config.json describes
    (transformers builds that model on the meta device). Raises HFCheckpointError (one line)."""
    checkpoint = hf_dir if isinstance(hf_dir, HFCheckpoint) else HFCheckpoint.open(hf_dir)
    family = family_for(checkpoint.config, checkpoint.config_path)
    model_config = family.model_config(checkpoint.config, checkpoint.config_path)
    with SliceReader(checkpoint) as reader:
        checked = family.check_tensors(model_config, checkpoint.tensors, reader.read)
    if check_shapes and not checked:
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


def _pieces_read(hf: HFModel, table, shapes: dict, key: str, shape: tuple, box,
                 local_elements: int) -> Iterator[tuple]:
    """(piece, its overlap with this rank's ``box``, the stored HF tensor found for it) for each
    of the table's pieces of Megatron tensor ``key`` that the box touches; once the caller has
    taken them all, that they covered its ``local_elements``. One line each where the table has
    no rule, a piece is in no shard, or the pieces fall short."""
    checkpoint = hf.checkpoint
    pieces = table.pieces(key, shape)
    if pieces is None:
        raise HFCheckpointError(f"{checkpoint.config_path}: the {hf.family.name} table has "
                                f"no rule for Megatron tensor {key}")
    covered = 0
    for piece in pieces:
        overlap = piece.within(box)
        if overlap is None:
            continue
        found = hf.family.layouts.resolve(piece.hf_key, shapes, piece.hf_shape)
        if found is None:
            raise HFCheckpointError(f"{checkpoint.directory}: tensor {piece.hf_key} "
                                    f"(for Megatron {key}) is in no shard")
        yield piece, overlap, found
        covered += math.prod(s.stop - s.start for s in overlap.local_index)
    if covered != local_elements:
        raise HFCheckpointError(f"{checkpoint.config_path}: the {hf.family.name} table covers "
                                f"{covered} of the {local_elements} local elements of Megatron "
                                f"tensor {key}")


def plan_reads(model_chunks: Iterable, hf: HFModel, packed: Optional[dict] = None
               ) -> list[tuple]:
    """(stored HF key, index into it, overlap, local tensor, whether what is read is stored
    transposed) for every slice this rank needs. Packed expert buffers go to ``packed`` (logical
    key -> {"packed": ShardedTensor, "scale": ShardedTensor}) for :func:`plan_packed_reads`."""
    table = hf.family.table(hf.model_config)
    checkpoint = hf.checkpoint
    shapes = {key: info.shape for key, info in checkpoint.tensors.items()}
    reads = []
    for chunk in model_chunks:
        state = chunk.sharded_state_dict()
        if isinstance(chunk, TowerLanguageModel):  # the vision module is read by its own names
            state = {k: v for k, v in state.items() if not k.startswith("vision.")}
        for st in sharded_tensors(state):
            if packed is not None and st.key.endswith(("weight_packed", "weight_scale")):
                packed.setdefault(st.key.rsplit("_", 1)[0], {})[st.key.rsplit("_", 1)[1]] = st
                continue
            for piece, overlap, found in _pieces_read(hf, table, shapes, st.key,
                                                      tuple(st.global_shape), local_box(st),
                                                      st.data.numel()):
                if found.shape != piece.hf_shape:
                    raise HFCheckpointError(
                        f"{checkpoint.where(found.stored)} has shape {list(found.shape)}; "
                        f"{checkpoint.config_path} implies {list(piece.hf_shape)} for "
                        f"{piece.hf_key} (Megatron {st.key})")
                reads.append((found.stored, found.compose(overlap.hf_index), overlap, st.data,
                              found.transposed))
    return reads


def plan_packed_reads(buffers: dict, hf: HFModel) -> list[tuple]:
    """(stored HF key, index into its logical shape, format, scale block, inputs per element,
    local packed view, local scale view) for every slice of packed expert weights this rank holds.
    ``buffers``: logical Megatron key -> its "packed" and "scale" ShardedTensors (as
    ``plan_reads`` collects them). The pieces are the table's for the logical weight; each must be
    a packed HF weight of the same format and group, stored [out, in] (one line each where not)."""
    table = hf.family.table(hf.model_config)
    checkpoint = hf.checkpoint
    shapes = {key: info.shape for key, info in checkpoint.tensors.items()}
    reads = []
    for key, pair in buffers.items():
        packed_st, scale_st = pair.get("packed"), pair.get("scale")
        if packed_st is None or scale_st is None or packed_st.data.dtype not in _PACKED_BUFFER:
            raise HFCheckpointError(f"Megatron tensor {key}: packed weights need their "
                                    f"uint8/int32/float8 values and their scales")
        fmt, per = _PACKED_BUFFER[packed_st.data.dtype]
        columns = packed_st.global_shape[-1] * per
        br, group = (checkpoint.fp8_block_size() if fmt == BLOCK_FP8
                     else (1, columns // scale_st.global_shape[-1]))
        shape = (*packed_st.global_shape[:-1], columns)
        box = (*local_box(packed_st)[:-1], (0, columns))
        for piece, overlap, found in _pieces_read(hf, table, shapes, key, shape, box,
                                                  packed_st.data.numel() * per):
            info = checkpoint.tensors[found.stored]
            kept = [h for h in piece.hf_dims if h is not None]
            same = (info.is_fp8 and info.packed is None if fmt == BLOCK_FP8
                    else info.packed is not None and info.dtype == fmt and info.group == group)
            *lead, rows, cols = overlap.local_index
            if (not same or found.transposed or kept != sorted(kept)
                    or found.shape != piece.hf_shape or rows.start % br):
                raise HFCheckpointError(
                    f"{checkpoint.where(found.stored)} is {info.dtype} {list(found.shape)}"
                    f"{f' in groups of {info.group}' if info.packed else ''}; the experts are held "
                    f"packed as {fmt} {list(piece.hf_shape)} in groups of {group} "
                    f"(--expert-weights dequantize reads it as any weight)")
            reads.append((found.stored, found.compose(overlap.hf_index), fmt, (br, group), per,
                          packed_st.data[(*lead, rows, slice(cols.start // per, cols.stop // per))],
                          scale_st.data[(*lead, slice(rows.start // br, math.ceil(rows.stop / br)),
                                         slice(cols.start // group,
                                               math.ceil(cols.stop / group)))]))
    return reads


def expert_weights_layout(hf: HFModel, choice: str, finetune_mode: str
                          ) -> Optional[PackedExperts]:
    """How the routed experts of ``hf`` are held (``--expert-weights``): packed as stored (MXFP4,
    INT4 pack-quantized or block-FP8 experts, frozen), or None (dense parameters, packed weights
    decoded on read). ``auto`` is packed wherever that is possible; ``packed`` where it is not is
    one ConfigError line saying why. ``dequantize`` of packable experts gives their layout with
    ``held=False`` (the planner prices the packed alternative)."""
    checkpoint = hf.checkpoint
    tensors = checkpoint.tensors
    kinds = set()
    for key, info in tensors.items():
        if _ROUTED_EXPERT not in key:
            continue
        if info.packed is not None:
            kinds.add((info.dtype, info.group, tensors[info.scale].dtype, 1))
        elif info.is_fp8:
            rows, cols = checkpoint.fp8_block_size()
            scale = tensors.get(checkpoint.scale_of(key))
            kinds.add((BLOCK_FP8, cols, scale.dtype, rows))
    t = hf.model_config.transformer
    reason = None
    if finetune_mode == "full":
        reason = "--finetune-mode full trains the experts, and packed weights are frozen"
    elif not kinds:
        reason = "its routed experts are not packed"
    elif len(kinds) > 1:
        reason = f"its routed experts mix packed layouts {sorted(kinds)}"
    elif next(iter(kinds))[2] not in _SCALE_DTYPES:
        reason = f"its expert scales are {next(iter(kinds))[2]}"
    elif t.get("gated_linear_unit") and t.get("moe_ffn_hidden_size", 0) % next(iter(kinds))[3]:
        reason = (f"the experts' gate and up halves ({t.get('moe_ffn_hidden_size')} rows) cut its "
                  f"FP8 blocks of {next(iter(kinds))[3]} rows")
    if reason is not None:
        if choice == "packed":
            raise ConfigError(f"--expert-weights packed: {checkpoint.directory}: {reason}; use "
                              f"--expert-weights dequantize")
        return None
    fmt, group, scale_dtype, block_rows = next(iter(kinds))
    return PackedExperts(fmt, group, _SCALE_DTYPES[scale_dtype], held=choice != "dequantize",
                         block_rows=block_rows)


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
    packed_buffers: dict = {}
    reads = plan_reads(model_chunks, hf, packed_buffers)
    packed_reads = plan_packed_reads(packed_buffers, hf)
    order = sorted(range(len(reads)), key=lambda i: (
        hf.checkpoint.tensors[reads[i][0]].file, reads[i][0], _start(reads[i][1])))
    report = LoadReport(tensors=len({id(r[3]) for r in reads}) + 2 * len(packed_buffers))
    with SliceReader(hf.checkpoint, unmap_after_bytes) as reader, torch.no_grad():
        for i in order:
            stored, index, overlap, local, transposed = reads[i]
            data = reader.read(stored, index)
            overlap.to_megatron(data.transpose(-1, -2) if transposed else data, local)
            report.reads += 1
        for stored, index, fmt, block, per, packed_local, scale_local in packed_reads:
            packed, scale = reader.read_packed(stored, index)
            try:  # scales checked as read: nothing runs on NaN or truncated scales
                PackedWeight(fmt, packed, scale, (packed.shape[0], packed.shape[1] * per), block,
                             name=hf.checkpoint.where(stored))
            except QuantizedWeightError as err:
                raise HFCheckpointError(str(err)) from None
            packed_local.copy_(packed.reshape(packed_local.shape))
            scale_local.copy_(scale.reshape(scale_local.shape))
            report.reads += 1
        for vision in visions:
            copied = load_vision_weights(vision, hf.checkpoint, reader)
            report.tensors += copied
            report.reads += copied
        report.bytes_read = reader.bytes_read
    return report
