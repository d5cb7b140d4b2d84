"""NemotronH (``NemotronHForCausalLM``) with its LatentMoE blocks.

NemotronH is a hybrid: a list of blocks (``layers_block_type``), each one norm and one mixer
(Mamba-2, attention, MLP or MoE) with a residual. Megatron-Core builds Mamba mixers only with
``mamba_ssm`` (CUDA kernels), so this mapping covers what Megatron's GPTModel builds anywhere:
models whose blocks pair up as (attention, MoE or MLP), each pair one Megatron TransformerLayer
(the attention block's norm is its input layernorm, the MLP block's its pre-MLP layernorm).
Configs with Mamba blocks, or blocks that do not pair that way, are refused in one line.

The MoE block is the Stable Latent MoE layer as it is: the router (sigmoid, score-correction
bias, groups, scaling) on the full width, ``fc1_latent_proj`` / ``fc2_latent_proj`` as our latent
projections, non-gated squared-ReLU experts in the latent width, a full-width non-gated shared
expert. NemotronH attention has no position embedding. Checkpoints are stored under
``backbone.`` (transformers 5 names the module ``model.``; both are read).
"""

from __future__ import annotations

from megatron_slmoe.families.deepseek_v3.family import routing_fields
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
from megatron_slmoe.families.layouts import FusedExperts, Layouts, Renamed

_PATTERN_TYPES = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_BLOCK_TYPES = {"mamba": "mamba", "linear_attention": "mamba", "full_attention": "attention",
                "attention": "attention", "mlp": "mlp", "moe": "moe"}


def block_types(c: ConfigReader) -> list[str]:
    """The block kinds in order, from ``layers_block_type`` or the older
    ``hybrid_override_pattern`` string."""
    blocks = c.get("layers_block_type")
    if blocks is None and isinstance(c.get("hybrid_override_pattern"), str):
        blocks = [_PATTERN_TYPES.get(ch, ch) for ch in c.get("hybrid_override_pattern")]
    if not isinstance(blocks, list) or not blocks:
        raise c.fail("layers_block_type is missing")
    kinds = []
    for i, block in enumerate(blocks):
        if block not in _BLOCK_TYPES:
            raise c.fail(f"layers_block_type[{i}] {block!r} is unknown")
        kinds.append(_BLOCK_TYPES[block])
    for i, kind in enumerate(kinds):
        if kind == "mamba":
            raise c.fail(f"layers_block_type[{i}] is a Mamba block: Megatron-Core builds Mamba "
                         f"mixers only with mamba_ssm (CUDA); this import maps NemotronH models "
                         f"of attention and MLP/MoE blocks")
        want = "attention" if i % 2 == 0 else ("mlp", "moe")
        if kind not in want:
            raise c.fail(f"layers_block_type[{i}] is {kind!r}: blocks must pair up as "
                         f"(attention, MLP or MoE), one Megatron layer per pair")
    if len(kinds) % 2:
        raise c.fail("layers_block_type ends with an attention block without its MLP/MoE block")
    return kinds


def _blocks_of_layer(names: dict) -> dict:
    if "layer" not in names:
        return names
    return {**names, "attn": 2 * names["layer"], "mlp": 2 * names["layer"] + 1}


class NemotronHFamily(Family):
    name = "nemotron_h"
    architectures = ("NemotronHForCausalLM",)
    layouts = Layouts(
        renames=(Renamed("backbone.", "model."),),
        fused=(FusedExperts("{p}.experts.up_proj", ("{p}.experts.{e}.up_proj.weight",)),
               FusedExperts("{p}.experts.down_proj", ("{p}.experts.{e}.down_proj.weight",))),
    )

    def transformer_fields(self, c: ConfigReader):
        kinds = block_types(c)
        hidden, heads = c.int("hidden_size"), c.int("num_attention_heads")
        experts, topk = c.int("n_routed_experts"), c.int("num_experts_per_tok")
        for flag in ("attention_bias", "mlp_bias", "use_bias"):
            c.require(not c.get(flag, False), f"{flag} true is not supported")
        moe = [kinds[i + 1] == "moe" for i in range(0, len(kinds), 2)]
        c.require(any(moe), "no MoE block: not a mixture-of-experts model")
        transformer = dict(
            num_layers=len(moe), hidden_size=hidden, ffn_hidden_size=c.int("intermediate_size"),
            num_attention_heads=heads, num_query_groups=c.int("num_key_value_heads", heads),
            kv_channels=c.int("head_dim", hidden // heads), normalization="RMSNorm",
            layernorm_epsilon=c.number("layer_norm_epsilon", 1e-5), gated_linear_unit=False,
            activation_func=c.activation("mlp_hidden_act", "relu2"), add_bias_linear=False,
            hidden_dropout=0.0, attention_dropout=c.number("attention_dropout", 0.0),
            init_method_std=c.number("initializer_range", 0.02),
            num_moe_experts=experts, moe_router_topk=topk,
            moe_ffn_hidden_size=c.int("moe_intermediate_size"),
            moe_layer_freq=[1 if m else 0 for m in moe],
            **routing_fields(c, experts, topk),
        )
        if c.get("moe_latent_size") is not None:
            transformer["moe_latent_size"] = c.int("moe_latent_size")
        # transformers builds every MoE block's shared expert, whatever n_shared_experts says
        # (0, or no key): its width alone decides, its class default when config.json has none.
        default = self.config_class()().moe_shared_expert_intermediate_size
        shared = c.int("moe_shared_expert_intermediate_size", default, minimum=0)
        if shared:
            transformer["moe_shared_expert_intermediate_size"] = shared
        gpt = c.gpt_fields(rotary_base=None)  # NemotronH has no position embedding
        return transformer, gpt

    def table(self, model_config):
        t = model_config.transformer
        meg = "decoder.layers.{layer}"
        attn, mlp = "backbone.layers.{attn}", "backbone.layers.{mlp}"
        rules = embedding_rules("backbone.embeddings.weight", "lm_head.weight",
                                "backbone.norm_f.weight",
                                model_config.share_embeddings_and_output_weights)
        rules += layernorm_rules(f"{attn}.norm.weight", f"{mlp}.norm.weight")
        rules += [
            Rule(f"{meg}.mlp.router.weight", Direct(f"{mlp}.mixer.gate.weight")),
            Rule(f"{meg}.mlp.router.expert_bias",
                 Direct(f"{mlp}.mixer.gate.e_score_correction_bias")),
            Rule(f"{meg}.mlp.latent_down.weight", Direct(f"{mlp}.mixer.fc1_latent_proj.weight")),
            Rule(f"{meg}.mlp.latent_up.weight", Direct(f"{mlp}.mixer.fc2_latent_proj.weight")),
        ]
        rules += gqa_attention_rules(f"{attn}.mixer", t["num_attention_heads"],
                                     t["num_query_groups"], t["kv_channels"], qk_norm=None)
        rules += mlp_rules(f"{meg}.mlp", f"{mlp}.mixer", gated=False)
        rules += mlp_rules(f"{meg}.mlp.shared_experts", f"{mlp}.mixer.shared_experts", gated=False)
        rules += expert_rules(f"{meg}.mlp", f"{mlp}.mixer.experts", gated=False)
        # Megatron layer i is the HF blocks 2i (attention) and 2i + 1 (MLP or MoE).
        return MappingTable(rules, derive=_blocks_of_layer)

    def config_class(self):
        from transformers import NemotronHConfig

        return NemotronHConfig
