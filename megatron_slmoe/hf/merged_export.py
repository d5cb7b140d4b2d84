"""Merge an adapter into its Hugging Face base and write a full HF checkpoint.

Every weight of the model the base ``config.json`` describes is read from the base checkpoint (in
either expert layout, FP8 dequantised), gets ``s * B A`` of its LoRA where the adapter has one
(``hf.lora_mapping``: the same rows the weight tables give), and is written in the layout
``save_pretrained`` writes (experts one per key): sharded safetensors written one tensor at a time,
``model.safetensors.index.json``, the base's ``config.json`` (its quantization settings kept) and
the tokenizer files, staged and renamed into place. A weight the base stores quantised is written
in its format again: packed by compressed-tensors (``<name>_packed`` + ``<name>_scale``: K3's
MXFP4 experts, INT4) or block-scaled FP8 (``<name>`` in float8_e4m3fn + ``<name>_scale_inv``:
DeepSeek-V3), its stored bytes as they are without a LoRA, re-encoded from the merged weight with
``ops.quantized_weights`` with one; each re-encoded weight's error against the BF16 merge (what a
dequantised export would write) is recorded, and per format the count, max and mean of it are
written to ``requantization.json`` beside the shards (:class:`RequantizationReport`). Peak
memory: one weight and its LoRA factors. No process group: the base weights never changed in
training, so the base checkpoint and the layout-independent adapter file are all it needs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Optional

import torch

from megatron_slmoe.families.errors import HFCheckpointError
from megatron_slmoe.hf.checkpoint import (
    PACKED_SCALE_SUFFIX,
    PACKED_SUFFIX,
    SCALE_SUFFIX,
    SliceReader,
)
from megatron_slmoe.hf.convert import TOKENIZER_FILES
from megatron_slmoe.hf.loader import HFModel, open_hf_checkpoint
from megatron_slmoe.hf.lora_mapping import HFLoRA, hf_loras, megatron_lora_modules
from megatron_slmoe.hf.peft_export import hf_meta_model
from megatron_slmoe.hf.safetensors_stream import (
    DTYPE_NAMES,
    PlannedTensor,
    WindowedReader,
    write_streamed,
)
from megatron_slmoe.hf.shared_outer_export import expand_to_per_expert
from megatron_slmoe.hf.vision_sources import find_source
from megatron_slmoe.lora.adapter import ADAPTER_WEIGHTS, read_adapter_config
from megatron_slmoe.ops.quantized_weights import (
    BLOCK_FP8,
    MXFP4,
    decode_block_fp8,
    decode_int4,
    decode_mxfp4,
    encode_block_fp8,
    encode_int4,
    encode_mxfp4,
)
from megatron_slmoe.utils.atomic import atomic_directory, write_json_atomic

INDEX = "model.safetensors.index.json"
REQUANTIZATION_REPORT = "requantization.json"
_SHAPE_SUFFIX = "_shape"  # compressed-tensors' weight_shape of a pack-quantized weight
_TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


class RequantizationReport:
    """The error of every weight the merged export re-encodes in its stored format: the
    norm-relative distance ||Q(W) - W|| / ||W|| of what is written, decoded, from the BF16 merge
    W; per format the count, max (with its weight) and mean (:meth:`summary`, :meth:`line`)."""

    def __init__(self) -> None:
        self.errors: dict[str, list[tuple[str, float]]] = {}

    def add(self, fmt: str, name: str, merged: torch.Tensor, written: torch.Tensor) -> None:
        want = merged.to(torch.bfloat16).double()
        error = (written.double() - want).norm() / want.norm().clamp_min(torch.finfo(torch.float64).tiny)
        self.errors.setdefault(fmt, []).append((name, float(error)))

    def summary(self) -> dict:
        return {"against": "the BF16 merge", "error": "||Q(W) - W|| / ||W|| per weight",
                "formats": {fmt: self._stats(fmt) for fmt in sorted(self.errors)},
                "line": self.line()}

    def line(self) -> str:
        if not self.errors:
            return "requantisation: no weight re-encoded (no LoRA on a packed weight)"
        parts = []
        for fmt in sorted(self.errors):
            s = self._stats(fmt)
            parts.append(f"{fmt}: {s['weights']} weights, max {s['max_rel']:.2e}, mean {s['mean_rel']:.2e}")
        return "requantisation error vs the BF16 merge (||Q(W) - W|| / ||W||): " + "; ".join(parts)

    def _stats(self, fmt: str) -> dict:
        errors = self.errors[fmt]
        worst_weight, worst = max(errors, key=lambda item: item[1])
        return {"weights": len(errors), "max_rel": worst, "max_weight": worst_weight,
                "mean_rel": sum(e for _, e in errors) / len(errors)}


def hf_memory_weights(hf: HFModel) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every weight of the model as transformers holds it in memory (experts
    fused in transformers 5), tied weights once."""
    meta = hf_meta_model(hf)
    seen, out = set(), []
    for name, tensor in meta.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied weights are written once
            continue
        seen.add(id(tensor))
        out.append((name, tuple(tensor.shape)))
    return out


def hf_weights(hf: HFModel) -> list[tuple[str, tuple[int, ...]]]:
    """(canonical key, shape) of every weight of the model, as save_pretrained names them."""
    return [part for name, shape in hf_memory_weights(hf)
            for part in hf.family.layouts.canonical(name, shape)]


def _fused(name: str, shape: tuple, parts: list[PlannedTensor], rule) -> PlannedTensor:
    """The fused expert tensor ``name`` of ``shape`` [experts, ...] made of its experts' merged
    tensors ``parts`` (expert after expert, each its ``rule.parts`` in order)."""
    per_expert = len(rule.parts)

    def produce():
        tensors = [p.produce() for p in parts]
        return torch.stack([torch.cat(tensors[e:e + per_expert], dim=rule.dim - 1)
                            for e in range(0, len(tensors), per_expert)])

    return PlannedTensor(name, parts[0].dtype, shape, produce)


def _shards(planned: list[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in planned:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def export_merged(adapter_dir: Optional[str], hf_dir, output: str,
                  max_shard_bytes: int = 5 * 2**30) -> str:
    """Write the base ``hf_dir`` with the adapter ``adapter_dir`` merged (None: the base alone)
    as an HF checkpoint into the new (or empty) directory ``output``; returns its path."""
    if adapter_dir is not None and read_adapter_config(adapter_dir)[0].expert_layout \
            == "shared-outer":
        # Merged from the exactly equal per-expert adapter (hf.shared_outer_export).
        scratch = tempfile.mkdtemp(prefix=".expanded-", dir=os.path.dirname(
            os.path.abspath(output)))
        try:
            expand_to_per_expert(adapter_dir, scratch)
            return export_merged(scratch, hf_dir, output, max_shard_bytes)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    hf = hf_dir if isinstance(hf_dir, HFModel) else open_hf_checkpoint(hf_dir, check_shapes=True)
    checkpoint = hf.checkpoint
    shapes = {key: info.shape for key, info in checkpoint.tensors.items()}
    source = None
    loras: dict[str, HFLoRA] = {}
    alpha = 0.0
    if adapter_dir is not None:
        lora_config, _ = read_adapter_config(adapter_dir)
        alpha = lora_config.alpha
        source = WindowedReader(os.path.join(adapter_dir, ADAPTER_WEIGHTS))
        table = hf.family.table(hf.model_config)
        adapter_shapes = {n: tuple(source.get_slice(n).get_shape()) for n in source.keys()}
        for module in megatron_lora_modules(adapter_shapes):
            a = adapter_shapes[f"{module}.lora_A.weight"]
            b = adapter_shapes[f"{module}.lora_B.weight"]
            for lora in hf_loras(table, module, b[0], a[1], hf.family.name):
                loras[lora.hf_weight] = lora
    reader = SliceReader(checkpoint)
    report = RequantizationReport()
    planned = []
    # A multimodal family's vision module is read by its own names (hf.vision_sources) and
    # written as transformers 5 names it.
    vision = hf.family.vision_module(hf.family.hf_config(checkpoint.config_path), device="meta") \
        if hf.multimodal else None
    vision_shapes = {} if vision is None else {
        vision.hf_prefix + name: tuple(t.shape)
        for name, t in vision.state_dict(keep_vars=True).items()}
    def merged_weight(key: str, shape: tuple) -> list[PlannedTensor]:
        found = hf.family.layouts.resolve(key, shapes, shape)
        if found is None or found.shape != shape:
            raise HFCheckpointError(f"{checkpoint.directory}: tensor {key} {list(shape)} is in "
                                    f"no shard")
        info = checkpoint.tensors[found.stored]
        lora = loras.pop(key, None)
        if lora is not None and (lora.out_features, lora.in_features) != tuple(shape):
            raise HFCheckpointError(
                f"LoRA on Megatron {lora.megatron} gives {key} [{lora.out_features}, "
                f"{lora.in_features}], but the base weight is {list(shape)} (an adapter for "
                f"another base model?)")
        if info.packed is not None:
            return _packed_weight(key, found, info, lora, checkpoint, reader, source, alpha, report)
        if info.is_fp8:
            return _fp8_weight(key, found, lora, checkpoint, reader, source, alpha, report)
        dtype = _TORCH_DTYPES[info.dtype]

        def produce(found=found, lora=lora, dtype=dtype):
            merged = _merged(_read_canonical(reader, found), lora, source, alpha)
            return merged.to(dtype).contiguous()

        return [PlannedTensor(key, dtype, tuple(shape), produce)]

    for name, shape in hf_memory_weights(hf):
        if name in vision_shapes:
            planned.append(_vision_tensor(vision, name, vision_shapes[name], checkpoint, reader,
                                          loras, source, alpha))
            continue
        parts = [planned_part for key, part_shape in hf.family.layouts.canonical(name, shape)
                 for planned_part in merged_weight(key, part_shape)]
        rule = hf.family.layouts.fused_rule(name, shape)
        if rule is None or not hf.family.merged_experts_fused:
            planned += parts
        else:
            planned.append(_fused(name, shape, parts, rule))
    if loras:
        raise HFCheckpointError(f"the adapter has LoRA for {next(iter(loras))}, which the "
                                f"{hf.family.name} model does not have")
    try:
        return write_hf_checkpoint(output, planned, checkpoint, max_shard_bytes,
                                   report if report_requantization(checkpoint) else None)
    finally:
        reader.close()
        if source is not None:
            source.close()


def report_requantization(checkpoint) -> bool:
    """Whether the export of ``checkpoint`` re-encodes weights (it stores packed ones) and so
    writes :data:`REQUANTIZATION_REPORT`."""
    return any(info.packed or info.is_fp8 for info in checkpoint.tensors.values())


def _packed_weight(key: str, found, info, lora: Optional[HFLoRA], checkpoint, reader, source,
                   alpha: float, report: RequantizationReport) -> list[PlannedTensor]:
    """The packed pair of ``key`` (``info``: its catalogue entry): the stored bytes without a
    LoRA; with one, the merged weight encoded in the stored format (MXFP4's shared exponents
    from the merged values; INT4's scales in the stored scales' dtype), its error recorded in
    ``report``."""
    if found.transposed or found.index:
        raise HFCheckpointError(f"{checkpoint.directory}: packed tensor {found.stored} is read "
                                f"as {key} through a layout change; packed weights are written "
                                f"only as stored (under a new name at most)")
    # Stored name -> written name (a renaming layout, e.g. Kimi-K2.5's original one, writes them
    # under the model's names); INT4's weight_shape goes with its pair.
    names = {info.packed: key + PACKED_SUFFIX, info.scale: key + PACKED_SCALE_SUFFIX}
    if found.stored + _SHAPE_SUFFIX in checkpoint.tensors:
        names[found.stored + _SHAPE_SUFFIX] = key + _SHAPE_SUFFIX
    scale_dtype = _TORCH_DTYPES[checkpoint.tensors[info.scale].dtype]
    encoded: dict[str, torch.Tensor] = {}

    def produce(name: str) -> torch.Tensor:
        if lora is None or name not in (info.packed, info.scale):
            return reader.read(name)
        if not encoded:
            merged = _merged(reader.read(found.stored).float(), lora, source, alpha)
            if info.dtype == MXFP4:
                packed, scales = encode_mxfp4(merged)
                written = decode_mxfp4(packed, scales)
            else:
                packed, scales = encode_int4(merged.to(scale_dtype), info.group)
                written = decode_int4(packed, scales, info.group)
            report.add(info.dtype, key, merged, written)
            encoded.update({info.packed: packed, info.scale: scales})
        return encoded.pop(name).contiguous()

    return [PlannedTensor(out, _TORCH_DTYPES[checkpoint.tensors[name].dtype],
                          tuple(checkpoint.tensors[name].shape), lambda name=name: produce(name))
            for name, out in names.items()]


def _fp8_weight(key: str, found, lora: Optional[HFLoRA], checkpoint, reader, source,
                alpha: float, report: RequantizationReport) -> list[PlannedTensor]:
    """The block-FP8 pair of ``key`` (``key`` and ``key_scale_inv``): the stored bytes without a
    LoRA where the layout keeps the stored tensor as it is; otherwise the (merged) weight encoded
    in the checkpoint's blocks, its error recorded in ``report`` (transformers' FP8 loader
    expects every weight it was quantised with in FP8, so none may be written dequantised)."""
    block = checkpoint.fp8_block_size()
    stored_scale = checkpoint.scale_of(found.stored)
    scale_dtype = _TORCH_DTYPES[checkpoint.tensors[stored_scale].dtype]
    verbatim = lora is None and not found.transposed and not found.index
    pending: dict[str, torch.Tensor] = {}

    def produce(name: str) -> torch.Tensor:
        if not pending:
            if verbatim:
                values, scales = reader.read_packed(found.stored)
            else:
                merged = _merged(_read_canonical(reader, found), lora, source, alpha)
                values, scales = encode_block_fp8(merged, block)
                scales = scales.to(scale_dtype)
                report.add(BLOCK_FP8, key, merged, decode_block_fp8(values, scales, block))
            pending.update({key: values, key + SCALE_SUFFIX: scales})
        return pending.pop(name).contiguous()

    rows, cols = found.shape
    scale_shape = (-(-rows // block[0]), -(-cols // block[1]))
    return [PlannedTensor(key, torch.float8_e4m3fn, tuple(found.shape), lambda: produce(key)),
            PlannedTensor(key + SCALE_SUFFIX, scale_dtype, scale_shape,
                          lambda: produce(key + SCALE_SUFFIX))]


def _read_canonical(reader, found) -> torch.Tensor:
    """The weight ``found`` (a layout's resolution) names, read and turned as the model holds it."""
    weight = reader.read(found.stored, found.index)
    return weight.transpose(-1, -2) if found.transposed else weight


def _merged(weight: torch.Tensor, lora: Optional[HFLoRA], source, alpha: float) -> torch.Tensor:
    """``weight`` + s B A of its LoRA (fp32, s = alpha / its rank), or ``weight`` without one."""
    if lora is None:
        return weight
    b = source.get_tensor(f"{lora.megatron}.lora_B.weight").float()
    rows = torch.empty(lora.out_features, b.shape[1])
    for row in lora.rows:
        rows[row.hf[0]:row.hf[1]] = b[row.megatron[0]:row.megatron[1]]
    a = source.get_tensor(f"{lora.megatron}.lora_A.weight").float()
    return weight.float() + alpha / a.shape[0] * (rows @ a)


def _vision_tensor(vision, key: str, shape: tuple, checkpoint, reader, loras: dict, source,
                   alpha: float) -> PlannedTensor:
    name = key[len(vision.hf_prefix):]
    found = find_source(vision, name, shape, checkpoint)
    dtype = _TORCH_DTYPES[checkpoint.tensors[found.key].dtype]
    lora = loras.pop(key, None)

    def produce():
        weight = found.convert(reader.read(found.key))
        return _merged(weight, lora, source, alpha).to(dtype).contiguous()

    return PlannedTensor(key, dtype, shape, produce)


def write_hf_checkpoint(output: str, planned: list[PlannedTensor], checkpoint,
                        max_shard_bytes: int, report: Optional[RequantizationReport] = None) -> str:
    """Write ``planned`` (produced one at a time) as an HF checkpoint directory ``output`` (new or
    empty): shards of about ``max_shard_bytes`` and their index, the base ``checkpoint``'s
    config.json (quantised weights are written in their format: its quantization settings hold)
    and tokenizer files, and ``report``'s summary (filled while the shards are produced) as
    :data:`REQUANTIZATION_REPORT`; staged and renamed into place."""
    shards = _shards(planned, max_shard_bytes)
    output = os.path.abspath(output)
    with atomic_directory(output) as staging:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = (f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1
                    else "model.safetensors")
            write_streamed(os.path.join(staging, name), shard, metadata={"format": "pt"})
            weight_map.update({t.name: name for t in shard})
        if len(shards) > 1:
            write_json_atomic(os.path.join(staging, INDEX), {
                "metadata": {"total_size": sum(t.nbytes for t in planned)},
                "weight_map": weight_map})
        write_json_atomic(os.path.join(staging, "config.json"), checkpoint.config)
        if report is not None:
            write_json_atomic(os.path.join(staging, REQUANTIZATION_REPORT), report.summary())
        for name in TOKENIZER_FILES:
            path = os.path.join(checkpoint.directory, name)
            if os.path.isfile(path):
                shutil.copyfile(path, os.path.join(staging, name))
    return output
