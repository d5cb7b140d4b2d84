"""Kimi K3 (``KimiK3ForConditionalGeneration``): the text model of the release.

``text_config`` (``model_type kimi_linear``) describes a hybrid of Kimi Delta Attention and gated
NoPE multi-latent attention layers (``linear_attn_config``: 1-based layer lists), block Attention
Residuals (``attn_res_block_size``), SiTU-GLU MLPs, a dense first layer and latent MoE layers
(``routed_expert_hidden_size``: the experts work in that width, ``routed_expert_norm`` normalises
their combined output, the sigmoid router's correction bias only selects). They become a
Megatron-Core GPT model with the model file's ``blocks`` (``model.layer_blocks``) and
``slmoe.latent_norm``.

The release's layout (prefix ``language_model.model.``, head ``language_model.lm_head``): layer 0's
``mlp``, the others' ``block_sparse_moe`` (``experts.E.w1|w3|w2``: gate, up, down, stored MXFP4 as
``weight_packed`` + ``weight_scale``, which the checkpoint reader decodes), KDA's ``A_log`` of
the used heads zero-padded to a multiple of 128 (96 in 128 for K3; the rule for other head counts
is unconfirmed: this one is assumed and a checkpoint that differs is refused by its shape), the
convolutions, ``A_log``, ``dt_bias``, ``o_norm`` and the router's correction bias in fp32.

No transformers class exists for K3 (the release ships remote code), so the family checks the
checkpoint's tensors itself (:meth:`KimiK3Family.check_tensors`) and reads ``config.json`` into
its own small config object (:class:`KimiK3Config`).

A checkpoint with a ``vision_config`` holds the MoonViT3D tower and ``patchmergerv2`` projector
at its top level (``vision_tower.*``, ``mm_projector.*``; ``vision``): it becomes the image-text
model of ``hf.tower_model`` (the language model under ``language_model.``), images written into
the text as ``<|media_pad|>`` runs (``media_placeholder_token_id``), one per merged 2 x 2 patch.
A checkpoint without one is the text model alone.
"""

from __future__ import annotations

import json
import math
import os
import types
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.data.errors import DataError
from megatron_slmoe.data.native_resolution import check_fits_tower
from megatron_slmoe.families.base import (
    ConfigReader,
    MultimodalFamily,
    layer_freq,
    layernorm_rules,
    stored_layout_model,
)
from megatron_slmoe.families.errors import HFCheckpointError
from megatron_slmoe.families.kimi_k3.processor import (
    KimiK3ImagePatches,
    KimiK3Media,
    KimiK3VideoPatches,
)
from megatron_slmoe.families.kimi_k3.vision import KimiK3Vision, MoonViT3DConfig
from megatron_slmoe.families.kinds import Direct, MappingTable, PerExpert, Rule, Stack
from megatron_slmoe.families.layouts import Layouts
from megatron_slmoe.model.model_file import BlocksConfig, ModelConfig
from megatron_slmoe.model.validation import validate_moe_config
from megatron_slmoe.moe.config import SLMoEConfig

MODEL, HEAD = "language_model.model", "language_model.lm_head"
VISION_LINEARS = tuple(f"vision_tower.encoder.blocks.{{layer}}.{name}"
                       for name in ("wqkv", "wo", "mlp.fc0", "mlp.fc1")
                       ) + ("mm_projector.proj.0", "mm_projector.proj.2")
"""The linears of K3's tower and projector, by the release's names."""
A_LOG_PADDING = 128


def stored_a_log_size(heads: int) -> int:
    """The length the release stores ``A_log`` in: the heads rounded up to a multiple of 128."""
    return A_LOG_PADDING * math.ceil(heads / A_LOG_PADDING)


class PaddedRows(Direct):
    """The Megatron tensor ``[n, ...]`` is the first ``n`` rows of an HF tensor of ``stored``
    rows (the rest zero): KDA's ``A_log``."""

    def __init__(self, hf: str, stored: int) -> None:
        super().__init__(hf)
        self.stored = stored

    def pieces(self, shape, names):
        (piece,) = super().pieces(shape, names)
        return [type(piece)(piece.hf_key, piece.meg_box, piece.hf_start, piece.hf_dims,
                            (self.stored, *shape[1:]))]


@dataclass(frozen=True)
class KimiK3Config:
    """What the image-text model reads of a K3 ``config.json`` (no transformers class)."""

    image_token_id: int
    text_hidden_size: int
    vision: Optional[MoonViT3DConfig]
    video_token_id: Optional[int] = None
    """None: video chunks are media items of the image stream (one placeholder for both)."""


class KimiK3Family(MultimodalFamily):
    name = "kimi_k3"
    architectures = ("KimiK3ForConditionalGeneration",)
    layouts = Layouts()
    image_token = "<|media_pad|>"
    # One image as the prompt writes it, where its size is not known (the start-up probe of the
    # tokenizer); the processor writes each image with its own size (``image_text(w, h)``).
    image_text = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    # Video chunks take the image placeholder, their settings in preprocessor_config.json.
    video_token = image_token
    video_settings = "preprocessor_config.json"

    def has_vision(self, config: dict) -> bool:
        return isinstance(config.get("vision_config"), dict)

    def hf_config(self, path: str) -> KimiK3Config:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        top = ConfigReader(config, path)
        text = top.get("text_config") or {}
        vision = top.get("vision_config")
        return KimiK3Config(
            image_token_id=top.int("media_placeholder_token_id", 163605, minimum=0),
            text_hidden_size=int(text.get("hidden_size", 0)),
            vision=None if not isinstance(vision, dict) else MoonViT3DConfig.from_vision_config(
                {"text_hidden_size": text.get("hidden_size"), **vision},
                lambda message: top.fail(message)))

    def vision_module(self, hf_config: KimiK3Config, device: str = "cpu"):
        if hf_config.vision is None:
            return None
        with torch.device(device):
            return KimiK3Vision(hf_config.vision)

    def image_patches(self, processor_path: str):
        return KimiK3ImagePatches(self._media(processor_path))

    def video_patches(self, processor_path: str):
        """None where the settings name no ``sample_fps`` (a checkpoint without videos)."""
        media = self._media(processor_path)
        return KimiK3VideoPatches(media) if media.sample_fps is not None else None

    def _media(self, processor_path: str) -> KimiK3Media:
        """The processor's settings, once its patch and merge sizes are the tower's."""
        media = KimiK3Media.from_preprocessor_config(processor_path)
        tower = self.hf_config(os.path.join(os.path.dirname(processor_path), "config.json"))
        if tower.vision is not None:
            check_fits_tower(processor_path,
                             patch_size=(media.patch_size, tower.vision.patch_size),
                             merge_kernel_size=(media.merge_size, tower.vision.merge))
            if media.side_limit > tower.vision.rope_max_side:
                raise DataError(f"{processor_path}: patch_limit_on_one_side {media.side_limit} "
                                f"exceeds the tower's {tower.vision.rope_max_side}")
        return media

    def model_config(self, config: dict, path: str) -> ModelConfig:
        """The language model's (``text_config``; the output layer tied by the top level)."""
        top = ConfigReader(config, path)
        text = top.get("text_config")
        top.require(isinstance(text, dict), "text_config is missing (a Kimi K3 config holds its "
                                            "language model's settings there)")
        c = ConfigReader(text, f"{path} text_config")
        transformer, gpt = self.transformer_fields(c)
        gpt["share_embeddings_and_output_weights"] = top.bool("tie_word_embeddings", False)
        try:
            validate_moe_config(transformer)
        except ConfigError as err:
            raise c.fail(f"gives an invalid MoE model: {err}") from None
        name = os.path.basename(os.path.dirname(os.path.abspath(path))) or self.name
        return ModelConfig(name=name, source=path, transformer=types.MappingProxyType(transformer),
                           slmoe=SLMoEConfig(latent_norm=c.bool("latent_moe_use_norm", True)),
                           blocks=self.blocks(c), **gpt)

    def transformer_fields(self, c: ConfigReader):
        layers, hidden = c.int("num_hidden_layers"), c.int("hidden_size")
        heads, experts = c.int("num_attention_heads"), c.int("num_experts")
        topk, expert_ffn = c.int("num_experts_per_token"), c.int("moe_intermediate_size")
        c.require(c.get("hidden_act", "situ") == "situ",
                  f"hidden_act {c.get('hidden_act')!r} is not supported (K3's is situ)")
        c.require(c.get("moe_router_activation_func", "sigmoid") == "sigmoid",
                  "moe_router_activation_func must be sigmoid")
        c.require(c.bool("moe_renormalize", True) or topk == 1,
                  "moe_renormalize false is not supported (Megatron normalises the top-k "
                  "sigmoid scores)")
        c.require(c.int("num_expert_group", 1) == 1 and c.int("topk_group", 1) == 1,
                  "expert groups are not supported (K3 has num_expert_group 1)")
        heads_kv = c.int("num_key_value_heads", heads)
        c.require(heads_kv == heads, f"num_key_value_heads {heads_kv} must equal "
                                     f"num_attention_heads {heads} (multi-latent attention)")
        dense = c.int("first_k_dense_replace", 1, minimum=0)
        every = c.int("moe_layer_freq", 1)
        transformer = dict(
            num_layers=layers, hidden_size=hidden, ffn_hidden_size=c.int("intermediate_size"),
            num_attention_heads=heads, num_query_groups=heads, multi_latent_attention=True,
            q_lora_rank=c.int("q_lora_rank"), kv_lora_rank=c.int("kv_lora_rank"),
            qk_head_dim=c.int("qk_nope_head_dim"), qk_pos_emb_head_dim=c.int("qk_rope_head_dim"),
            v_head_dim=c.int("v_head_dim"), qk_layernorm=True, rope_type="rope",
            normalization="RMSNorm", layernorm_epsilon=c.number("rms_norm_eps", 1e-5),
            gated_linear_unit=True, activation_func="situ_glu", add_bias_linear=False,
            hidden_dropout=0.0, attention_dropout=0.0,
            init_method_std=c.number("initializer_range", 0.02),
            num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=expert_ffn,
            moe_layer_freq=layer_freq([i >= dense and i % every == 0 for i in range(layers)]),
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=1e-3, moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0, moe_router_dtype="fp32",
        )
        latent = c.get("routed_expert_hidden_size")
        if latent is not None:
            transformer["moe_latent_size"] = c.int("routed_expert_hidden_size")
        shared = c.int("num_shared_experts", 0, minimum=0)
        if shared:
            transformer["moe_shared_expert_intermediate_size"] = shared * expert_ffn
        scaling = c.number("routed_scaling_factor", 1.0)
        if scaling != 1.0:
            transformer["moe_router_topk_scaling_factor"] = scaling
        gpt = dict(vocab_size=c.int("vocab_size"),
                   max_sequence_length=c.int("max_position_embeddings", 262144),
                   position_embedding_type="none")
        return transformer, gpt

    def blocks(self, c: ConfigReader) -> BlocksConfig:
        """The KDA layers (0-based), their shape, gated NoPE MLA, Attention Residuals, SiTU."""
        layers = c.int("num_hidden_layers")
        linear = c.get("linear_attn_config")
        c.require(isinstance(linear, dict), "linear_attn_config is missing")
        lc = ConfigReader(linear, f"{c.path}.linear_attn_config")
        full, kda = lc.get("full_attn_layers"), lc.get("kda_layers")
        for name, value in (("full_attn_layers", full), ("kda_layers", kda)):
            lc.require(isinstance(value, list) and all(
                isinstance(i, int) and not isinstance(i, bool) for i in value),
                f"{name} must be a list of 1-based layer numbers, got {value!r}")
        lc.require(not set(full) & set(kda) and set(full) | set(kda) == set(range(1, layers + 1))
                   and len(full) + len(kda) == layers,
                   f"full_attn_layers and kda_layers must split the layers 1..{layers} "
                   f"(1-based) between them, each once; they cover "
                   f"{sorted(set(full) | set(kda))[:3]}... with "
                   f"{sorted(set(full) & set(kda))} in both")
        lc.require(lc.bool("use_full_rank_gate", True),
                   "use_full_rank_gate false (a low-rank KDA output gate) is not supported")
        c.require(c.bool("mla_use_nope", True) and c.bool("mla_use_output_gate", True),
                  "MLA with rotation or without its output gate is not supported (K3's is "
                  "gated NoPE)")
        kda_heads = lc.int("num_heads")
        return BlocksConfig(
            attention_residual_block=c.int("attn_res_block_size"),
            kda_layers=tuple(sorted(i - 1 for i in kda)), kda_num_heads=kda_heads,
            kda_head_dim=lc.int("head_dim"),
            kda_conv_kernel_size=lc.int("short_conv_kernel_size", 4),
            kda_gate_lower_bound=lc.number("gate_lower_bound", -5.0),
            gated_nope_mla=True,
            situ_beta=c.number("activation_situ_beta", 4.0),
            situ_linear_beta=c.number("activation_situ_linear_beta", 25.0))

    def table(self, model_config: ModelConfig, model: str = MODEL,
              head: str = HEAD) -> MappingTable:
        blocks = model_config.blocks
        hf, meg = model + ".layers.{layer}", "decoder.layers.{layer}"
        attn, sa = f"{hf}.self_attn", f"{meg}.self_attention"
        moe, mlp = f"{hf}.block_sparse_moe", f"{meg}.mlp"
        rules = [
            Rule("embedding.word_embeddings.weight", Direct(f"{model}.embed_tokens.weight")),
            Rule("output_layer.weight", Direct(f"{model}.embed_tokens.weight"
                                               if model_config.share_embeddings_and_output_weights
                                               else f"{head}.weight")),
            Rule("decoder.final_layernorm.norm.weight", Direct(f"{model}.norm.weight")),
            Rule("decoder.final_layernorm.attn_res.norm_weight",
                 Direct(f"{model}.output_attn_res_norm.weight")),
            Rule("decoder.final_layernorm.attn_res.proj_weight",
                 Direct(f"{model}.output_attn_res_proj.weight")),
        ]
        rules += layernorm_rules(f"{hf}.input_layernorm.weight",
                                 f"{hf}.post_attention_layernorm.weight")
        for ours, theirs in (("self_attention_res", "self_attention_res"), ("mlp_res", "mlp_res")):
            rules += [Rule(f"{meg}.{ours}.norm_weight", Direct(f"{hf}.{theirs}_norm.weight")),
                      Rule(f"{meg}.{ours}.proj_weight", Direct(f"{hf}.{theirs}_proj.weight"))]
        # Kimi Delta Attention: the release's names on both sides.
        for name in ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "f_b_proj", "b_proj",
                     "o_proj", "q_conv1d", "k_conv1d", "v_conv1d", "o_norm"):
            rules.append(Rule(f"{sa}.{name}.weight", Direct(f"{attn}.{name}.weight")))
        rules += [Rule(f"{sa}.dt_bias", Direct(f"{attn}.dt_bias")),
                  Rule(f"{sa}.A_log", PaddedRows(f"{attn}.A_log",
                                                 stored_a_log_size(blocks.kda_num_heads or 1)))]
        # Gated NoPE MLA.
        for ours, theirs in (("linear_q_down_proj", "q_a_proj"), ("q_layernorm", "q_a_layernorm"),
                             ("linear_q_up_proj", "q_b_proj"),
                             ("linear_kv_down_proj", "kv_a_proj_with_mqa"),
                             ("kv_layernorm", "kv_a_layernorm"), ("linear_kv_up_proj", "kv_b_proj"),
                             ("linear_gate", "g_proj"), ("linear_proj", "o_proj")):
            rules.append(Rule(f"{sa}.{ours}.weight", Direct(f"{attn}.{theirs}.weight")))
        # The dense first layer(s) and the latent MoE.
        rules += [
            Rule(f"{mlp}.linear_fc1.weight", Stack(f"{hf}.mlp.gate_proj.weight",
                                                   f"{hf}.mlp.up_proj.weight")),
            Rule(f"{mlp}.linear_fc2.weight", Direct(f"{hf}.mlp.down_proj.weight")),
            Rule(f"{mlp}.router.weight", Direct(f"{moe}.gate.weight")),
            Rule(f"{mlp}.router.expert_bias", Direct(f"{moe}.gate.e_score_correction_bias")),
            Rule(f"{mlp}.latent_down.weight", Direct(f"{moe}.routed_expert_down_proj.weight")),
            Rule(f"{mlp}.latent_up.weight", Direct(f"{moe}.routed_expert_up_proj.weight")),
            Rule(f"{mlp}.latent_norm.weight", Direct(f"{moe}.routed_expert_norm.weight")),
            Rule(f"{mlp}.shared_experts.linear_fc1.weight",
                 Stack(f"{moe}.shared_experts.gate_proj.weight",
                       f"{moe}.shared_experts.up_proj.weight")),
            Rule(f"{mlp}.shared_experts.linear_fc2.weight",
                 Direct(f"{moe}.shared_experts.down_proj.weight")),
            Rule(f"{mlp}.experts.fc1_weight",
                 PerExpert(Stack(f"{moe}.experts.{{expert}}.w1.weight",
                                 f"{moe}.experts.{{expert}}.w3.weight"))),
            Rule(f"{mlp}.experts.fc2_weight", PerExpert(Direct(f"{moe}.experts.{{expert}}.w2.weight"))),
        ]
        # The image-text model holds the language model as ``language_model``; its tower is read
        # by its own names (``vision``), these rules name the HF weight of a LoRA on it.
        language = MappingTable(rules)
        vision = [Rule(f"vision.{name}.weight", Direct(f"{name}.weight"))
                  for name in VISION_LINEARS]
        return MappingTable(rules + language.under("language_model.").rules + vision)

    def check_tensors(self, model_config: ModelConfig, tensors: Mapping,
                      read: Callable) -> bool:
        """The release's padding of ``A_log``: exactly zero past the used heads (a non-zero pad
        would be a checkpoint of another head count, silently cut). Shapes are checked by the
        table as the weights are read."""
        heads = model_config.blocks.kda_num_heads
        for layer in model_config.blocks.kda_layers:
            key = f"{MODEL}.layers.{layer}.self_attn.A_log"
            if key not in tensors:
                raise HFCheckpointError(f"tensor {key} (layer {layer} is a KDA layer) is in no "
                                        f"shard")
            stored = read(key)
            if stored.dim() != 1 or stored.shape[0] < heads:
                raise HFCheckpointError(f"tensor {key} has shape {list(stored.shape)}, which "
                                        f"cannot hold {heads} heads")
            if bool((stored[heads:] != 0).any()):
                raise HFCheckpointError(f"tensor {key}: its padding past the {heads} heads is "
                                        f"not zero (a checkpoint with more KDA heads than "
                                        f"config.json says?)")
        return True

    def hf_meta_model(self, config_path: str, tensors: Mapping):
        """The release's own layout (its modules as the checkpoint names them, experts under
        their logical shapes): the tensors ``check_tensors`` and the table have checked."""
        return stored_layout_model(tensors)

    def peft_model_type(self, config_path: str):
        return None

    def config_class(self):
        raise HFCheckpointError("Kimi K3 has no transformers class (its checkpoint ships remote "
                                "code)")
