"""Qwen3-MoE (``Qwen3MoeForCausalLM``): GQA attention with per-head q/k RMSNorm (Megatron's
``qk_layernorm``), softmax top-k routing (``norm_topk_prob``: softmax over the chosen experts'
logits, which is Megatron's routing without ``moe_router_pre_softmax``), SwiGLU experts, no shared
expert, dense layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say so."""

from __future__ import annotations

from megatron_slmoe.families.base import (
    ConfigReader,
    Family,
    embedding_rules,
    expert_rules,
    gqa_attention_rules,
    layer_freq,
    layernorm_rules,
    mlp_rules,
)
from megatron_slmoe.families.kinds import Direct, MappingTable, Rule
from megatron_slmoe.families.layouts import FusedExperts, Layouts

GATED_EXPERTS = Layouts(fused=(
    FusedExperts("{p}.experts.gate_up_proj",
                 ("{p}.experts.{e}.gate_proj.weight", "{p}.experts.{e}.up_proj.weight")),
    FusedExperts("{p}.experts.down_proj", ("{p}.experts.{e}.down_proj.weight",)),
))


class Qwen3MoeFamily(Family):
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    layouts = GATED_EXPERTS

    def transformer_fields(self, c: ConfigReader):
        layers, hidden = c.int("num_hidden_layers"), c.int("hidden_size")
        heads = c.int("num_attention_heads")
        experts, step = c.int("num_experts"), c.int("decoder_sparse_step", 1)
        mlp_only = c.get("mlp_only_layers", [])
        c.require(isinstance(mlp_only, list), f"mlp_only_layers must be a list, got {mlp_only!r}")
        c.require(not c.get("attention_bias", False),
                  "attention_bias true is not supported (Megatron would also add biases to the "
                  "MLP projections)")
        c.require(not c.get("use_sliding_window", False), "use_sliding_window is not supported")
        rope = c.rope()
        c.require(rope["rope_type"] == "default",
                  f"rope_type {rope['rope_type']!r} is not supported (only default RoPE)")
        norm_topk = c.bool("norm_topk_prob", False)
        transformer = dict(
            num_layers=layers, hidden_size=hidden, ffn_hidden_size=c.int("intermediate_size"),
            num_attention_heads=heads,
            num_query_groups=c.int("num_key_value_heads", heads),
            kv_channels=c.int("head_dim", hidden // heads), qk_layernorm=True,
            normalization="RMSNorm", layernorm_epsilon=c.number("rms_norm_eps", 1e-6),
            gated_linear_unit=True, activation_func=c.activation("hidden_act", "silu"),
            add_bias_linear=False, hidden_dropout=0.0,
            attention_dropout=c.number("attention_dropout", 0.0),
            init_method_std=c.number("initializer_range", 0.02),
            num_moe_experts=experts, moe_router_topk=c.int("num_experts_per_tok"),
            moe_ffn_hidden_size=c.int("moe_intermediate_size"),
            moe_layer_freq=layer_freq([i not in mlp_only and (i + 1) % step == 0
                                       for i in range(layers)]),
            moe_router_score_function="softmax", moe_router_pre_softmax=not norm_topk,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=c.number("router_aux_loss_coef", 0.001), moe_router_dtype="fp32",
        )
        gpt = c.gpt_fields(rotary_base=rope["rope_theta"])
        return transformer, gpt

    def table(self, model_config, model: str = "model", head: str = "lm_head"):
        """``model`` / ``head``: where the decoder and the output layer are in the checkpoint
        (a multimodal model holds this language model under another prefix)."""
        t = model_config.transformer
        hf = model + ".layers.{layer}"
        rules = embedding_rules(f"{model}.embed_tokens.weight", f"{head}.weight",
                                f"{model}.norm.weight",
                                model_config.share_embeddings_and_output_weights)
        rules += layernorm_rules(f"{hf}.input_layernorm.weight",
                                 f"{hf}.post_attention_layernorm.weight")
        rules.append(Rule("decoder.layers.{layer}.mlp.router.weight",
                          Direct(f"{hf}.mlp.gate.weight")))
        rules += gqa_attention_rules(f"{hf}.self_attn", t["num_attention_heads"],
                                     t["num_query_groups"], t["kv_channels"],
                                     ("q_norm", "k_norm"))
        rules += mlp_rules("decoder.layers.{layer}.mlp", f"{hf}.mlp", gated=True)
        rules += expert_rules("decoder.layers.{layer}.mlp", f"{hf}.mlp.experts", gated=True)
        return MappingTable(rules)

    def config_class(self):
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig
