"""Merge an adapter into its Hugging Face base and write a full HF checkpoint.

Every weight of the model the base ``config.json`` describes is read from the base checkpoint (in
either expert layout, FP8 dequantised), gets ``s * B A`` of its LoRA where the adapter has one
(``mappings.lora``: the same rows the weight tables give), and is written in the layout
``save_pretrained`` writes (experts one per key): sharded safetensors written one tensor at a time,
``model.safetensors.index.json``, ``config.json`` (without the FP8 quantization settings when the
base had them) and the tokenizer files, staged and renamed into place. Peak memory: one weight
and its LoRA factors. No process group: the base weights never changed in training, so the base
checkpoint and the layout-independent adapter file are all it needs.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

import torch

from megatron_slmoe.hf.checkpoint import SliceReader
from megatron_slmoe.hf.errors import HFCheckpointError
from megatron_slmoe.hf.loader import HFModel, open_hf_checkpoint
from megatron_slmoe.hf.mappings.lora import HFLoRA, hf_loras, megatron_lora_modules
from megatron_slmoe.hf.safetensors_stream import (
    DTYPE_NAMES,
    PlannedTensor,
    WindowedReader,
    write_streamed,
)
from megatron_slmoe.hf.vision_sources import find_source

INDEX = "model.safetensors.index.json"
_TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def hf_memory_weights(hf: HFModel) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every weight of the model as transformers holds it in memory (experts
    fused in transformers 5), tied weights once."""
    from megatron_slmoe.hf.peft_export import hf_meta_model

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
    from megatron_slmoe.lora.adapter import ADAPTER_WEIGHTS, read_adapter_config

    hf = hf_dir if isinstance(hf_dir, HFModel) else open_hf_checkpoint(hf_dir, check_shapes=True)
    checkpoint = hf.checkpoint
    shapes = {key: info.shape for key, info in checkpoint.tensors.items()}
    source = None
    loras: dict[str, HFLoRA] = {}
    scaling = 0.0
    if adapter_dir is not None:
        lora_config, _ = read_adapter_config(adapter_dir)
        scaling = lora_config.scaling
        source = WindowedReader(os.path.join(adapter_dir, ADAPTER_WEIGHTS))
        table = hf.family.table(hf.model_config)
        adapter_shapes = {n: tuple(source.get_slice(n).get_shape()) for n in source.keys()}
        for module in megatron_lora_modules(adapter_shapes):
            a = adapter_shapes[f"{module}.lora_A.weight"]
            b = adapter_shapes[f"{module}.lora_B.weight"]
            for lora in hf_loras(table, module, b[0], a[1], hf.family.name):
                loras[lora.hf_weight] = lora
    reader = SliceReader(checkpoint)
    planned = []
    # A multimodal family's vision module is read by its own names (hf.vision_sources) and
    # written as transformers 5 names it.
    vision = hf.family.vision_module(hf.family.hf_config(checkpoint.config_path), device="meta")
    vision_shapes = {} if vision is None else {
        vision.hf_prefix + name: tuple(t.shape)
        for name, t in vision.state_dict(keep_vars=True).items()}
    def merged_weight(key: str, shape: tuple) -> PlannedTensor:
        found = hf.family.layouts.resolve(key, shapes, shape)
        if found is None or found.shape != shape:
            raise HFCheckpointError(f"{checkpoint.directory}: tensor {key} {list(shape)} is in "
                                    f"no shard")
        info = checkpoint.tensors[found.stored]
        dtype = torch.bfloat16 if info.is_fp8 else _TORCH_DTYPES[info.dtype]
        lora = loras.pop(key, None)
        if lora is not None and (lora.out_features, lora.in_features) != tuple(shape):
            raise HFCheckpointError(
                f"LoRA on Megatron {lora.megatron} gives {key} [{lora.out_features}, "
                f"{lora.in_features}], but the base weight is {list(shape)} (an adapter for "
                f"another base model?)")

        def produce(found=found, lora=lora, dtype=dtype):
            weight = reader.read(found.stored, found.index)
            if found.transposed:
                weight = weight.transpose(-1, -2)
            return _merged(weight, lora, source, scaling).to(dtype).contiguous()

        return PlannedTensor(key, dtype, tuple(shape), produce)

    for name, shape in hf_memory_weights(hf):
        if name in vision_shapes:
            planned.append(_vision_tensor(vision, name, vision_shapes[name], checkpoint, reader,
                                          loras, source, scaling))
            continue
        parts = [merged_weight(key, part_shape)
                 for key, part_shape in hf.family.layouts.canonical(name, shape)]
        rule = hf.family.layouts.fused_rule(name, shape)
        if rule is None or not hf.family.merged_experts_fused:
            planned += parts
        else:
            planned.append(_fused(name, shape, parts, rule))
    if loras:
        raise HFCheckpointError(f"the adapter has LoRA for {next(iter(loras))}, which the "
                                f"{hf.family.name} model does not have")
    try:
        return write_hf_checkpoint(output, planned, checkpoint, max_shard_bytes)
    finally:
        reader.close()
        if source is not None:
            source.close()


def _merged(weight: torch.Tensor, lora: Optional[HFLoRA], source, scaling: float) -> torch.Tensor:
    """``weight`` + s B A of its LoRA (fp32), or ``weight`` without one."""
    if lora is None:
        return weight
    b = source.get_tensor(f"{lora.megatron}.lora_B.weight").float()
    rows = torch.empty(lora.out_features, b.shape[1])
    for row in lora.rows:
        rows[row.hf[0]:row.hf[1]] = b[row.megatron[0]:row.megatron[1]]
    a = source.get_tensor(f"{lora.megatron}.lora_A.weight").float()
    return weight.float() + scaling * (rows @ a)


def _vision_tensor(vision, key: str, shape: tuple, checkpoint, reader, loras: dict, source,
                   scaling: float) -> PlannedTensor:
    name = key[len(vision.hf_prefix):]
    found = find_source(vision, name, shape, checkpoint)
    dtype = _TORCH_DTYPES[checkpoint.tensors[found.key].dtype]
    lora = loras.pop(key, None)

    def produce():
        weight = found.convert(reader.read(found.key))
        return _merged(weight, lora, source, scaling).to(dtype).contiguous()

    return PlannedTensor(key, dtype, shape, produce)


def write_hf_checkpoint(output: str, planned: list[PlannedTensor], checkpoint,
                        max_shard_bytes: int) -> str:
    """Write ``planned`` (produced one at a time) as an HF checkpoint directory ``output`` (new or
    empty): shards of about ``max_shard_bytes`` and their index, the base ``checkpoint``'s
    config.json (without FP8 quantization settings: weights are written dequantised) and
    tokenizer files; staged and renamed into place."""
    from megatron_slmoe.hf.convert import TOKENIZER_FILES
    from megatron_slmoe.utils.atomic import atomic_directory, write_json_atomic

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
        config = dict(checkpoint.config)
        config.pop("quantization_config", None)
        write_json_atomic(os.path.join(staging, "config.json"), config)
        for name in TOKENIZER_FILES:
            path = os.path.join(checkpoint.directory, name)
            if os.path.isfile(path):
                shutil.copyfile(path, os.path.join(staging, name))
    return output
