"""The Stable Latent MoE's own Hugging Face format (``StableLatentMoeForCausalLM``, defined in
``megatron_slmoe.families.slmoe.modeling``): field for field the Megatron model, so the mapping is
one-to-one. Experts are stored fused (``experts.gate_up_proj`` or, non-gated, ``experts.up_proj``;
``experts.down_proj``); per-expert keys are read too."""

from __future__ import annotations

from megatron_slmoe.families.base import (
    ConfigReader,
    Family,
    embedding_rules,
    expert_rules,
    gqa_attention_rules,
    layernorm_rules,
    mlp_rules,
)
from megatron_slmoe.families.kinds import Direct, MappingTable, Rule
from megatron_slmoe.families.layouts import FusedExperts, Layouts


class StableLatentMoeFamily(Family):
    name = "stable_latent_moe"
    architectures = ("StableLatentMoeForCausalLM",)
    layouts = Layouts(fused=(
        FusedExperts("{p}.experts.gate_up_proj",
                     ("{p}.experts.{e}.gate_proj.weight", "{p}.experts.{e}.up_proj.weight")),
        FusedExperts("{p}.experts.up_proj", ("{p}.experts.{e}.up_proj.weight",)),
        FusedExperts("{p}.experts.down_proj", ("{p}.experts.{e}.down_proj.weight",)),
    ))

    def transformer_fields(self, c: ConfigReader):
        layers, hidden = c.int("num_hidden_layers"), c.int("hidden_size")
        heads, experts = c.int("num_attention_heads"), c.int("num_experts")
        moe_layers = c.get("moe_layers", [1] * layers)
        c.require(isinstance(moe_layers, list) and len(moe_layers) == layers
                  and all(v in (0, 1) for v in moe_layers),
                  f"moe_layers must list 0 or 1 for each of the {layers} layers")
        gated = c.bool("mlp_gated", True)
        transformer = dict(
            num_layers=layers, hidden_size=hidden, ffn_hidden_size=c.int("intermediate_size"),
            num_attention_heads=heads, num_query_groups=c.int("num_key_value_heads", heads),
            kv_channels=c.int("head_dim", hidden // heads),
            qk_layernorm=c.bool("qk_layernorm", False), normalization="RMSNorm",
            layernorm_epsilon=c.number("rms_norm_eps", 1e-6), gated_linear_unit=gated,
            activation_func=c.activation("hidden_act", "silu"), add_bias_linear=False,
            hidden_dropout=0.0, attention_dropout=c.number("attention_dropout", 0.0),
            init_method_std=c.number("initializer_range", 0.02),
            num_moe_experts=experts, moe_router_topk=c.int("num_experts_per_tok"),
            moe_ffn_hidden_size=c.int("moe_intermediate_size"), moe_layer_freq=list(moe_layers),
            moe_router_score_function=c.get("router_score_function", "softmax"),
            moe_router_pre_softmax=c.bool("router_pre_softmax", False),
            moe_router_enable_expert_bias=c.bool("router_expert_bias", False),
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_router_dtype="fp32",
        )
        for hf_name, field in (("moe_latent_size", "moe_latent_size"),
                               ("shared_expert_intermediate_size",
                                "moe_shared_expert_intermediate_size"),
                               ("router_num_groups", "moe_router_num_groups"),
                               ("router_group_topk", "moe_router_group_topk")):
            if c.get(hf_name) is not None:
                transformer[field] = c.int(hf_name)
        if c.get("router_topk_scaling_factor") is not None:
            transformer["moe_router_topk_scaling_factor"] = c.number("router_topk_scaling_factor")
        gpt = c.gpt_fields(rotary_base=c.number("rope_theta", 1e4))
        return transformer, gpt

    def table(self, model_config):
        t = model_config.transformer
        hf, meg = "model.layers.{layer}", "decoder.layers.{layer}"
        gated = t["gated_linear_unit"]
        rules = embedding_rules("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                                model_config.share_embeddings_and_output_weights)
        rules += layernorm_rules(f"{hf}.input_layernorm.weight",
                                 f"{hf}.post_attention_layernorm.weight")
        rules += gqa_attention_rules(f"{hf}.self_attn", t["num_attention_heads"],
                                     t["num_query_groups"], t["kv_channels"],
                                     ("q_norm", "k_norm") if t["qk_layernorm"] else None)
        rules += [
            Rule(f"{meg}.mlp.router.weight", Direct(f"{hf}.mlp.router.weight")),
            Rule(f"{meg}.mlp.router.expert_bias", Direct(f"{hf}.mlp.router.expert_bias")),
            Rule(f"{meg}.mlp.latent_down.weight", Direct(f"{hf}.mlp.fc1_latent_proj.weight")),
            Rule(f"{meg}.mlp.latent_up.weight", Direct(f"{hf}.mlp.fc2_latent_proj.weight")),
        ]
        rules += mlp_rules(f"{meg}.mlp", f"{hf}.mlp", gated)
        rules += mlp_rules(f"{meg}.mlp.shared_experts", f"{hf}.mlp.shared_experts", gated)
        rules += expert_rules(f"{meg}.mlp", f"{hf}.mlp.experts", gated)
        return MappingTable(rules)

    def config_class(self):
        from megatron_slmoe.families.slmoe.modeling import StableLatentMoeConfig

        return StableLatentMoeConfig
