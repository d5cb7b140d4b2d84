"""DeepSeek-V3 and Kimi-K2 (``DeepseekV3ForCausalLM``; Kimi-K2 ships the same architecture under
``model_type: kimi_k2``).

Multi-latent attention is Megatron-Core's MLA (its local spec): q down/up projections with an
RMSNorm between (``q_lora_rank``; a single ``q_proj`` without it), the joint kv down projection
whose last ``qk_rope_head_dim`` rows are the shared rotary key, kv RMSNorm, kv up projection per
head ``[k_nope; v]``. Megatron's MLA applies RoPE to de-interleaved rotary dims, which is HF's
``rope_interleave: true`` (the published checkpoints); yarn scaling maps to Megatron's yarn fields.

Routing: sigmoid scores, ``e_score_correction_bias`` added for the choice only (our router's expert
bias), group-limited top-k (HF scores a group by its top two experts, Megatron by its top
``topk / topk_group``: they agree when that is 2, as in the published models), normalised top-k,
``routed_scaling_factor``. Shared experts (``n_shared_experts`` x ``moe_intermediate_size``); the
first ``first_k_dense_replace`` layers are dense. Block-scaled FP8 weights are dequantised on read
(``checkpoint.SliceReader``). The multi-token-prediction layers (``num_nextn_predict_layers``) are
not part of the model (transformers ignores them too).
"""

from __future__ import annotations

from megatron_slmoe.families.base import (
    ConfigReader,
    Family,
    embedding_rules,
    expert_rules,
    layer_freq,
    layernorm_rules,
    mlp_rules,
)
from megatron_slmoe.families.kinds import Direct, MappingTable, Rule
from megatron_slmoe.families.qwen3_moe.family import GATED_EXPERTS

_YARN = {"factor": "rotary_scaling_factor",
         "original_max_position_embeddings": "original_max_position_embeddings",
         "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale",
         "mscale_all_dim": "mscale_all_dim"}


def routing_fields(c: ConfigReader, experts: int, topk: int) -> dict:
    """Sigmoid routing with a score-correction bias, group limits and scaling (DeepSeek-V3's, also
    NemotronH's), as Megatron TransformerConfig fields."""
    scoring = c.get("scoring_func", "sigmoid")
    c.require(scoring == "sigmoid", f"scoring_func {scoring!r} is not supported (sigmoid only)")
    c.require(c.bool("norm_topk_prob", True) or topk == 1,
              "norm_topk_prob false is not supported with sigmoid routing (Megatron normalises "
              "the top-k sigmoid scores)")
    fields = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_bias_update_rate=1e-3, moe_router_load_balancing_type="none",
                  moe_aux_loss_coeff=0.0, moe_router_dtype="fp32")
    groups, group_topk = c.int("n_group", 1), c.int("topk_group", 1)
    if groups > 1:
        c.require(topk % group_topk == 0 and topk // group_topk == 2,
                  f"num_experts_per_tok {topk} with topk_group {group_topk}: HF scores a group by "
                  f"its top 2 experts, Megatron by its top num_experts_per_tok / topk_group "
                  f"= {topk / group_topk:g}")
        fields.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    scaling = c.number("routed_scaling_factor", 1.0)
    if scaling != 1.0:
        fields["moe_router_topk_scaling_factor"] = scaling
    return fields


class DeepseekV3Family(Family):
    name = "deepseek_v3"
    architectures = ("DeepseekV3ForCausalLM",)
    layouts = GATED_EXPERTS

    def transformer_fields(self, c: ConfigReader):
        layers, hidden = c.int("num_hidden_layers"), c.int("hidden_size")
        heads, experts = c.int("num_attention_heads"), c.int("n_routed_experts")
        topk, expert_ffn = c.int("num_experts_per_tok"), c.int("moe_intermediate_size")
        c.require(not c.get("attention_bias", False), "attention_bias true is not supported")
        c.require(c.bool("rope_interleave", True),
                  "rope_interleave false is not supported (Megatron's MLA rotates interleaved "
                  "rotary dims)")
        q_lora_rank = c.get("q_lora_rank")
        if q_lora_rank is not None:
            q_lora_rank = c.int("q_lora_rank")
        rope = c.rope()
        transformer = dict(
            num_layers=layers, hidden_size=hidden, ffn_hidden_size=c.int("intermediate_size"),
            num_attention_heads=heads, num_query_groups=heads,
            multi_latent_attention=True, q_lora_rank=q_lora_rank,
            kv_lora_rank=c.int("kv_lora_rank"), qk_head_dim=c.int("qk_nope_head_dim"),
            qk_pos_emb_head_dim=c.int("qk_rope_head_dim"), v_head_dim=c.int("v_head_dim"),
            qk_layernorm=True, normalization="RMSNorm",
            layernorm_epsilon=c.number("rms_norm_eps", 1e-6), gated_linear_unit=True,
            activation_func=c.activation("hidden_act", "silu"), add_bias_linear=False,
            hidden_dropout=0.0, attention_dropout=c.number("attention_dropout", 0.0),
            init_method_std=c.number("initializer_range", 0.02),
            num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=expert_ffn,
            moe_layer_freq=layer_freq([i >= c.int("first_k_dense_replace", 0, minimum=0)
                                       for i in range(layers)]),
            **routing_fields(c, experts, topk),
        )
        shared = c.int("n_shared_experts", 0, minimum=0)
        if shared:
            transformer["moe_shared_expert_intermediate_size"] = shared * expert_ffn
        if rope["rope_type"] == "default":
            transformer["rope_type"] = "rope"
        elif rope["rope_type"] == "yarn":
            transformer["rope_type"] = "yarn"
            for hf_name, field in _YARN.items():
                if rope.get(hf_name) is not None:
                    transformer[field] = rope[hf_name]
        else:
            raise c.fail(f"rope_type {rope['rope_type']!r} is not supported (default or yarn)")
        gpt = c.gpt_fields(rotary_base=rope["rope_theta"])
        return transformer, gpt

    def table(self, model_config, model: str = "model", head: str = "lm_head"):
        """``model`` / ``head``: where the decoder and the output layer are in the checkpoint
        (a multimodal model holds this language model under another prefix)."""
        t = model_config.transformer
        hf, meg = model + ".layers.{layer}", "decoder.layers.{layer}"
        attn, mla = f"{hf}.self_attn", f"{meg}.self_attention"
        rules = embedding_rules(f"{model}.embed_tokens.weight", f"{head}.weight",
                                f"{model}.norm.weight",
                                model_config.share_embeddings_and_output_weights)
        rules += layernorm_rules(f"{hf}.input_layernorm.weight",
                                 f"{hf}.post_attention_layernorm.weight")
        rules += [
            Rule(f"{mla}.linear_kv_down_proj.weight", Direct(f"{attn}.kv_a_proj_with_mqa.weight")),
            Rule(f"{mla}.kv_layernorm.weight", Direct(f"{attn}.kv_a_layernorm.weight")),
            Rule(f"{mla}.linear_kv_up_proj.weight", Direct(f"{attn}.kv_b_proj.weight")),
            Rule(f"{mla}.linear_proj.weight", Direct(f"{attn}.o_proj.weight")),
            Rule(f"{meg}.mlp.router.weight", Direct(f"{hf}.mlp.gate.weight")),
            Rule(f"{meg}.mlp.router.expert_bias", Direct(f"{hf}.mlp.gate.e_score_correction_bias")),
        ]
        if t.get("q_lora_rank") is None:
            rules.append(Rule(f"{mla}.linear_q_proj.weight", Direct(f"{attn}.q_proj.weight")))
        else:
            rules += [Rule(f"{mla}.linear_q_down_proj.weight", Direct(f"{attn}.q_a_proj.weight")),
                      Rule(f"{mla}.q_layernorm.weight", Direct(f"{attn}.q_a_layernorm.weight")),
                      Rule(f"{mla}.linear_q_up_proj.weight", Direct(f"{attn}.q_b_proj.weight"))]
        rules += mlp_rules(f"{meg}.mlp", f"{hf}.mlp", gated=True)
        rules += mlp_rules(f"{meg}.mlp.shared_experts", f"{hf}.mlp.shared_experts", gated=True)
        rules += expert_rules(f"{meg}.mlp", f"{hf}.mlp.experts", gated=True)
        return MappingTable(rules)

    def config_class(self):
        from transformers import DeepseekV3Config

        return DeepseekV3Config
