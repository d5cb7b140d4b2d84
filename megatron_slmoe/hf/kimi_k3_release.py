"""Random-weight Kimi K3 text checkpoints in the release's layout (``slmoe-make-hf-checkpoint
--preset kimi-k3`` and ``kimi-k3-tiny``): no transformers class exists for K3, so its tensors
are listed here from the release's tensor table (shared/KIMI_K3.md) rather than from a model.

Layout: ``language_model.model.`` prefix and ``language_model.lm_head``; every layer's
Attention-Residual mixes and output gate ``g_proj``; KDA layers (``linear_attn_config.kda_layers``,
1-based) with fp32 convolutions, ``A_log`` (the used heads, zero-padded to a multiple of 128),
``dt_bias`` and ``o_norm``; gated NoPE MLA layers; the dense first layer(s) ``mlp``; then
``block_sparse_moe`` with the fp32 correction bias, the latent projections and norm, shared
experts, and routed experts ``experts.E.w1|w3|w2`` as MXFP4 ``weight_packed`` + ``weight_scale``
(``ops.quantized_weights.encode_mxfp4``). One shard per decoder layer (and one for embeddings,
head and final norms), each made, written and dropped before the next.

Values: matrices N(0, 1/fan_in) (activations stay of unit scale at any width), the embedding
N(0, 1), norm weights 1, convolution taps N(0, 1/kernel), ``A_log`` log U(1, 16) on the used
heads, ``dt_bias`` N(0, 1), the correction bias N(0, 0.1).
"""

from __future__ import annotations

import copy
import math
import os
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch

from megatron_slmoe.families import family_for
from megatron_slmoe.families.errors import HFCheckpointError
from megatron_slmoe.families.kimi_k3.family import HEAD, MODEL, stored_a_log_size
from megatron_slmoe.hf.synthetic import write_shards
from megatron_slmoe.ops.quantized_weights import MXFP4_GROUP, encode_mxfp4
from megatron_slmoe.utils.atomic import write_json_atomic

_RELEASE_TEXT: dict[str, Any] = {
    "model_type": "kimi_linear", "hidden_size": 7168, "vocab_size": 163840,
    "intermediate_size": 33792, "rms_norm_eps": 1e-5, "hidden_act": "situ",
    "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "attn_res_block_size": 12,
    "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": True, "mla_use_output_gate": True,
    "linear_attn_config": {"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                           "gate_lower_bound": -5.0, "use_full_rank_gate": True},
    "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
    "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584,
    "latent_moe_use_norm": True, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
    "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "num_expert_group": 1,
    "topk_group": 1, "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
    "tie_word_embeddings": False,
}
"""The release's text_config (KIMI_K3.md), less the layer count and layer lists, which follow
``--num-layers``."""

PRESETS: dict[str, dict[str, Any]] = {
    "kimi-k3": _RELEASE_TEXT,
    # The widths of the tests' tiny K3 (tests/helpers/kimi_k3_reference.tiny_config): expert
    # widths multiples of MXFP4's 32-input groups.
    "kimi-k3-tiny": {
        **_RELEASE_TEXT, "hidden_size": 64, "vocab_size": 128, "intermediate_size": 96,
        "attn_res_block_size": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "linear_attn_config": {**_RELEASE_TEXT["linear_attn_config"], "num_heads": 4,
                               "head_dim": 8},
        "num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 32,
        "routed_expert_hidden_size": 32, "bos_token_id": 0, "eos_token_id": 1,
        "pad_token_id": 2,
    },
}
"""Name -> text_config fields (``--set`` changes them; ``linear_attn_config.*`` too)."""

_QUANTIZATION = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "float", "strategy": "group", "group_size": MXFP4_GROUP,
        "symmetric": True, "scale_dtype": "torch.uint8"}}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "lm_head", "re:.*vision_tower.*", "re:.*mm_projector.*"],
}
"""``text_config.quantization_config`` as the release gives it (only ``experts.E.w1|w2|w3`` are
packed, whatever the ignore list leaves out)."""


def layer_lists(num_layers: int) -> tuple[list[int], list[int]]:
    """K3's pattern for ``num_layers`` (1-based, as ``linear_attn_config``): MLA every fourth layer
    and the last one, KDA the others (93 layers: MLA 4, 8, ..., 92, 93)."""
    full = [i for i in range(1, num_layers + 1) if i % 4 == 0 or i == num_layers]
    return full, [i for i in range(1, num_layers + 1) if i not in full]


def release_config(preset: str, num_layers: int, changes: dict[str, Any], where: str) -> dict:
    """The checkpoint's config.json: the preset's text_config with ``changes`` (``a.b`` names a
    field of a nested mapping), ``num_layers`` layers in K3's pattern, read as the import reads it
    (the K3 family's schema) so that a bad value is one HFCheckpointError line."""
    text = copy.deepcopy(PRESETS[preset])
    full, kda = layer_lists(num_layers)
    text["num_hidden_layers"] = num_layers
    text["linear_attn_config"].update(full_attn_layers=full, kda_layers=kda)
    for name, value in changes.items():
        *parents, leaf = name.split(".")
        holder = text
        for parent in parents:
            holder = holder.get(parent) if isinstance(holder, dict) else None
        if not isinstance(holder, dict) or leaf not in holder:
            raise HFCheckpointError(f"{where}: {name!r} is not a field of a Kimi K3 text_config")
        holder[leaf] = value
    text["quantization_config"] = copy.deepcopy(_QUANTIZATION)
    config = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
              "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"],
              "pad_token_id": text["pad_token_id"],
              "tie_word_embeddings": text["tie_word_embeddings"], "dtype": "bfloat16",
              "text_config": text}
    family_for(config, where).model_config(config, where)
    expert_width = text.get("routed_expert_hidden_size") or text["hidden_size"]
    for name, width in (("moe_intermediate_size", text["moe_intermediate_size"]),
                        ("routed_expert_hidden_size" if text.get("routed_expert_hidden_size")
                         else "hidden_size", expert_width)):
        if width % MXFP4_GROUP:
            raise HFCheckpointError(f"{where}: {name} {width} is not a multiple of "
                                    f"{MXFP4_GROUP} (MXFP4 scales 32 inputs each)")
    return config


# (name, shape, kind): kind "matrix", "norm", "fp32:<what>", "mxfp4" (the unpacked shape).
_Tensor = tuple[str, tuple[int, ...], str]


def tensors(config: dict) -> "OrderedDict[str, list[_Tensor]]":
    """Every text tensor of ``config``'s checkpoint by shard: "model" (embeddings, head, final
    norms), then one per layer."""
    t = config["text_config"]
    h, layers = t["hidden_size"], t["num_hidden_layers"]
    lin = t["linear_attn_config"]
    kda_heads, kda_dim, kernel = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    heads = t["num_attention_heads"]
    latent = t.get("routed_expert_hidden_size")
    width, ffn, experts = latent or h, t["moe_intermediate_size"], t["num_experts"]
    groups: OrderedDict[str, list[_Tensor]] = OrderedDict()
    groups["model"] = [
        (f"{MODEL}.embed_tokens.weight", (t["vocab_size"], h), "embedding"),
        (f"{MODEL}.norm.weight", (h,), "norm"),
        (f"{MODEL}.output_attn_res_norm.weight", (h,), "norm"),
        (f"{MODEL}.output_attn_res_proj.weight", (1, h), "matrix"),
    ] + ([] if t["tie_word_embeddings"] else
         [(f"{HEAD}.weight", (t["vocab_size"], h), "matrix")])
    for i in range(layers):
        p = f"{MODEL}.layers.{i}"
        a = f"{p}.self_attn"
        out: list[_Tensor] = [
            (f"{p}.input_layernorm.weight", (h,), "norm"),
            (f"{p}.post_attention_layernorm.weight", (h,), "norm"),
            (f"{p}.self_attention_res_norm.weight", (h,), "norm"),
            (f"{p}.self_attention_res_proj.weight", (1, h), "matrix"),
            (f"{p}.mlp_res_norm.weight", (h,), "norm"),
            (f"{p}.mlp_res_proj.weight", (1, h), "matrix"),
        ]
        if i + 1 in lin["kda_layers"]:
            w = kda_heads * kda_dim
            out += [(f"{a}.{n}.weight", (w, h), "matrix") for n in ("q_proj", "k_proj", "v_proj",
                                                                     "g_proj")]
            out += [(f"{a}.{n}_conv1d.weight", (w, 1, kernel), "fp32:conv") for n in "qkv"]
            out += [(f"{a}.f_a_proj.weight", (kda_dim, h), "matrix"),
                    (f"{a}.f_b_proj.weight", (w, kda_dim), "matrix"),
                    (f"{a}.A_log", (stored_a_log_size(kda_heads),), f"fp32:a_log:{kda_heads}"),
                    (f"{a}.dt_bias", (w,), "fp32:normal"),
                    (f"{a}.b_proj.weight", (kda_heads, h), "matrix"),
                    (f"{a}.o_norm.weight", (kda_dim,), "fp32:ones"),
                    (f"{a}.o_proj.weight", (h, w), "matrix")]
        else:
            q, kv, rope = t["q_lora_rank"], t["kv_lora_rank"], t["qk_rope_head_dim"]
            nope, v = t["qk_nope_head_dim"], t["v_head_dim"]
            out += [(f"{a}.q_a_proj.weight", (q, h), "matrix"),
                    (f"{a}.q_a_layernorm.weight", (q,), "norm"),
                    (f"{a}.q_b_proj.weight", (heads * (nope + rope), q), "matrix"),
                    (f"{a}.kv_a_proj_with_mqa.weight", (kv + rope, h), "matrix"),
                    (f"{a}.kv_a_layernorm.weight", (kv,), "norm"),
                    (f"{a}.kv_b_proj.weight", (heads * (nope + v), kv), "matrix"),
                    (f"{a}.g_proj.weight", (heads * v, h), "matrix"),
                    (f"{a}.o_proj.weight", (h, heads * v), "matrix")]
        moe = i >= t["first_k_dense_replace"] and i % t["moe_layer_freq"] == 0
        if not moe:
            dense = t["intermediate_size"]
            out += [(f"{p}.mlp.gate_proj.weight", (dense, h), "matrix"),
                    (f"{p}.mlp.up_proj.weight", (dense, h), "matrix"),
                    (f"{p}.mlp.down_proj.weight", (h, dense), "matrix")]
        else:
            m = f"{p}.block_sparse_moe"
            out += [(f"{m}.gate.weight", (experts, h), "matrix"),
                    (f"{m}.gate.e_score_correction_bias", (experts,), "fp32:bias")]
            if latent:
                out += [(f"{m}.routed_expert_down_proj.weight", (latent, h), "matrix"),
                        (f"{m}.routed_expert_up_proj.weight", (h, latent), "matrix")]
                if t.get("latent_moe_use_norm", True):
                    out.append((f"{m}.routed_expert_norm.weight", (latent,), "norm"))
            shared = t["num_shared_experts"] * ffn
            if shared:
                out += [(f"{m}.shared_experts.gate_proj.weight", (shared, h), "matrix"),
                        (f"{m}.shared_experts.up_proj.weight", (shared, h), "matrix"),
                        (f"{m}.shared_experts.down_proj.weight", (h, shared), "matrix")]
            for e in range(experts):
                out += [(f"{m}.experts.{e}.w1.weight", (ffn, width), "mxfp4"),
                        (f"{m}.experts.{e}.w3.weight", (ffn, width), "mxfp4"),
                        (f"{m}.experts.{e}.w2.weight", (width, ffn), "mxfp4")]
        groups[f"layer {i}"] = out
    return groups


def _stored_bytes(shape: tuple[int, ...], kind: str, itemsize: int) -> int:
    n = math.prod(shape)
    if kind == "mxfp4":
        return n // 2 + n // MXFP4_GROUP
    return n * (4 if kind.startswith("fp32") else itemsize)


DRAW_ELEMENTS = 1 << 22
"""Random values are drawn (and experts encoded) a block of rows of at most this many elements
at a time, so that a realistic width's scratch stays small beside its stored tensors."""
DRAW_SCRATCH = 16
"""Bytes of scratch per drawn element: the fp32 draw, the encoder's scaled fp32 copy, codes."""


def largest_shard(config: dict, dtype: torch.dtype) -> tuple[str, int]:
    """(shard, bytes of memory) the writer holds at its peak: a shard's stored tensors and one
    block of drawn rows with its encoding scratch."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {group: sum(_stored_bytes(shape, kind, itemsize) for _, shape, kind in items)
             + min(max(math.prod(shape) for _, shape, _ in items), DRAW_ELEMENTS) * DRAW_SCRATCH
             for group, items in tensors(config).items()}
    name = max(sizes, key=sizes.get)
    return name, sizes[name]


def _values(name: str, shape: tuple[int, ...], kind: str, gen: torch.Generator,
            dtype: torch.dtype, std: Optional[float] = None) -> dict[str, torch.Tensor]:
    if kind == "embedding":  # N(0, 1): a matrix drawn with std 1
        return _values(name, shape, "matrix", gen, dtype, std=1.0)
    if kind == "norm":
        return {name: torch.ones(shape, dtype=dtype)}
    if kind == "fp32:ones":
        return {name: torch.ones(shape)}
    if kind == "fp32:conv":
        return {name: torch.randn(shape, generator=gen) / math.sqrt(shape[-1])}
    if kind == "fp32:normal":
        return {name: torch.randn(shape, generator=gen)}
    if kind == "fp32:bias":
        return {name: torch.randn(shape, generator=gen) * 0.1}
    if kind.startswith("fp32:a_log:"):
        used = int(kind.rsplit(":", 1)[1])
        a_log = torch.zeros(shape)
        a_log[:used] = torch.rand(used, generator=gen).mul(15).add(1).log()
        return {name: a_log}
    std = 1 / math.sqrt(shape[-1]) if std is None else std
    rows, width = shape[0], math.prod(shape[1:])
    step = max(1, DRAW_ELEMENTS // width)
    blocks = ((start, min(start + step, rows)) for start in range(0, rows, step))
    if kind == "mxfp4":
        packed = torch.empty(rows, width // 2, dtype=torch.uint8)
        scale = torch.empty(rows, width // MXFP4_GROUP, dtype=torch.uint8)
        for start, stop in blocks:
            block = torch.randn(stop - start, width, generator=gen) * std
            packed[start:stop], scale[start:stop] = encode_mxfp4(block)
        return {name + "_packed": packed, name + "_scale": scale}
    weight = torch.empty(rows, width, dtype=dtype)
    for start, stop in blocks:
        weight[start:stop] = torch.randn(stop - start, width, generator=gen) * std
    return {name: weight.view(shape)}


def write_release_checkpoint(config: dict, output: str, *, seed: int = 0,
                             dtype: torch.dtype = torch.bfloat16,
                             add_files: Optional[Callable[[str], None]] = None) -> dict[str, int]:
    """Write ``config``'s K3 text checkpoint with random weights into the new directory
    ``output`` (config.json, shards, their index; ``add_files(directory)`` adds more before it
    appears); returns {shard file: bytes}."""
    groups = tensors(config)
    gen = torch.Generator().manual_seed(seed)
    shards = ({key: value for name, shape, kind in items
               for key, value in _values(name, shape, kind, gen, dtype).items()}
              for items in groups.values())
    return write_shards(
        output, lambda staging: write_json_atomic(os.path.join(staging, "config.json"), config),
        shards, len(groups), digits=6, add_files=add_files)
