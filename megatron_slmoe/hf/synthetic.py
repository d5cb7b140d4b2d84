"""Random-weight Hugging Face checkpoints with real layer shapes and fewer layers, for measuring
memory, import and speed where the real checkpoint (hundreds of GB) does not fit.

``write_random_checkpoint`` builds the family's transformers model on the meta device (names and
shapes only), then writes its weights shard by shard: one safetensors file per decoder layer (and
one for the embeddings and the head), each made, written and dropped before the next, so the
whole model is never in memory (peak: one layer). Experts are stored as transformers 5 holds them
(fused 3D tensors), which the import reads like the per-expert layout of published checkpoints.
Weights are N(0, ``init_std``), norms 1, biases 0.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections import OrderedDict
from typing import Any, Callable, Iterable, Optional

import torch

from megatron_slmoe.families import family_for
from megatron_slmoe.families.base import ConfigReader
from megatron_slmoe.families.errors import HFCheckpointError
from megatron_slmoe.utils.atomic import atomic_directory, write_json_atomic

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    # Qwen3-30B-A3B's layer (config.json of Qwen/Qwen3-30B-A3B), with the layer count a flag.
    "qwen3-30b-a3b": ("qwen3_moe", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, router_aux_loss_coef=0.001)),
    # DeepSeek-V3's layer (config.json of deepseek-ai/DeepSeek-V3: MLA, 256 experts of 2048 with
    # a shared one, top-8 of 4 groups out of 8, sigmoid scores with a bias), written in the
    # --dtype given rather than as block-scaled FP8 (the import reads FP8 blocks too).
    "deepseek-v3": ("deepseek_v3", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=3,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, max_position_embeddings=163840, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False)),
}
"""Name -> (transformers model_type, config fields)."""

_LAYER = re.compile(r"^(model\.layers\.\d+)\.")


def hf_config(model_type: str, num_layers: int, **fields):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, num_hidden_layers=num_layers, **fields)


def checked_config(model_type: str, num_layers: int, fields: dict[str, Any], where: str):
    """``hf_config`` of ``fields`` over the model type's defaults, read first as the import reads
    a config.json (the family's schema: ``families.family_for(...).model_config``), so that an
    unknown field, a mistyped or impossible value (a width of 0, fewer experts than the top-k)
    is one HFCheckpointError line naming it, not a traceback or a checkpoint of it."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    default = AutoConfig.for_model(model_type)
    defaults = default.to_dict()
    known = {*defaults, *getattr(default, "attribute_map", {}),
             *(f.name for f in dataclasses.fields(default) if dataclasses.is_dataclass(default)),
             *(alias for names in ConfigReader.ALIASES.values() for alias in names),
             *next((preset for kind, preset in PRESETS.values() if kind == model_type), {})}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise HFCheckpointError(f"{where}: {unknown[0]!r} is not a field of a {model_type} "
                                f"config")
    config = {**defaults, **fields, "num_hidden_layers": num_layers,
              "architectures": [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]}
    family_for(config, where).model_config(config, where)
    return hf_config(model_type, num_layers, **fields)


def largest_shard(config, dtype: torch.dtype) -> tuple[str, int]:
    """(name, bytes of memory) of the shard that ``write_random_checkpoint`` holds at its peak:
    its tensors in ``dtype``, and one tensor drawn in fp32."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {group: sum(shape.numel() for _, shape in weights) * itemsize
             + max(shape.numel() for _, shape in weights) * 4
             for group, weights in _groups(meta).items()}
    name = max(sizes, key=sizes.get)
    return name, sizes[name]


def _groups(meta_model) -> "OrderedDict[str, list[tuple[str, torch.Size]]]":
    """The model's weights by shard: one per decoder layer, one for everything else."""
    groups: OrderedDict[str, list] = OrderedDict()
    for name, tensor in meta_model.state_dict().items():
        match = _LAYER.match(name)
        groups.setdefault(match.group(1) if match else "model", []).append((name, tensor.shape))
    return groups


def _random(name: str, shape: torch.Size, gen: torch.Generator, std: float,
            dtype: torch.dtype) -> torch.Tensor:
    if name.endswith("norm.weight") or "layernorm" in name or name.endswith("_norm.weight"):
        return torch.ones(shape, dtype=dtype)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype)
    return (torch.randn(shape, generator=gen) * std).to(dtype)


def write_random_checkpoint(config, output: str, *, seed: int = 0, init_std: float = 0.02,
                            dtype: torch.dtype = torch.float32,
                            add_files: Optional[Callable[[str], None]] = None) -> dict[str, int]:
    """Write ``config``'s model with random weights into the new directory ``output`` (config,
    sharded safetensors with their index; ``add_files(directory)`` adds more, e.g. a tokenizer,
    before it appears); returns {shard file: bytes}."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    groups = _groups(meta)
    gen = torch.Generator().manual_seed(seed)
    config.architectures = [type(meta).__name__]
    shards = ({name: _random(name, shape, gen, init_std, dtype) for name, shape in weights}
              for weights in groups.values())
    return write_shards(output, config.save_pretrained, shards, len(groups), digits=5,
                        add_files=add_files)


def write_shards(output: str, write_config: Callable[[str], None],
                 shards: Iterable[dict[str, torch.Tensor]], count: int, *, digits: int,
                 add_files: Optional[Callable[[str], None]] = None) -> dict[str, int]:
    """The one writer of a sharded checkpoint into the new directory ``output``, which appears
    whole or not at all: ``write_config(directory)``, then each of the ``count`` tensor dicts that
    ``shards`` makes as ``model-<n>-of-<count>.safetensors`` (``digits`` wide), written and
    dropped before the next is made (peak: one shard), their index, then ``add_files(directory)``.
    Returns {shard file: bytes}."""
    from safetensors.torch import save_file

    sizes: dict[str, int] = {}
    weight_map: dict[str, str] = {}
    with atomic_directory(output) as staging:
        write_config(staging)
        for number, shard in enumerate(shards):
            filename = f"model-{number + 1:0{digits}d}-of-{count:0{digits}d}.safetensors"
            save_file(shard, os.path.join(staging, filename), metadata={"format": "pt"})
            sizes[filename] = os.path.getsize(os.path.join(staging, filename))
            weight_map.update(dict.fromkeys(shard, filename))
            del shard  # one shard in memory at a time
        write_json_atomic(os.path.join(staging, "model.safetensors.index.json"),
                          {"metadata": {"total_size": sum(sizes.values())},
                           "weight_map": weight_map})
        if add_files is not None:
            add_files(staging)
    return sizes
