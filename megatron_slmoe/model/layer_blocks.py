"""A model file's ``blocks`` section applied to the decoder block spec: per-layer attention kinds
(Kimi Delta Attention on the listed layers, gated NoPE MLA on the others), and the Attention
Residuals stream around every layer. Megatron-Core's own spec builders choose everything else
(norms, MLA's submodules, dense MLP or MoE per ``moe_layer_freq``); this module only swaps
submodules of the specs they give."""

from __future__ import annotations

import copy

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.model.attention_residuals import with_attention_residuals
from megatron_slmoe.model.gated_nope_mla import gated_nope_mla_spec
from megatron_slmoe.model.kda_attention import KDAConfig, kda_attention_spec
from megatron_slmoe.model.model_file import BlocksConfig


def check_blocks(blocks: BlocksConfig, config: TransformerConfig) -> None:
    """What the blocks need of the TransformerConfig; one ConfigError line otherwise."""
    outside = [i for i in blocks.kda_layers if i >= config.num_layers]
    if outside:
        raise ConfigError(f"blocks.kda_layers {outside} are past the model's {config.num_layers} "
                          f"layers")
    if blocks.gated_nope_mla and not config.multi_latent_attention:
        raise ConfigError("blocks.gated_nope_mla needs multi_latent_attention: true")
    heads = blocks.kda_num_heads or 0
    if blocks.kda_layers and heads % config.tensor_model_parallel_size:
        raise ConfigError(f"--tensor-model-parallel-size {config.tensor_model_parallel_size} "
                          f"does not divide the {heads} KDA heads (blocks.kda_num_heads)")


def apply_blocks(block_spec: TransformerBlockSubmodules, blocks: BlocksConfig,
                 config: TransformerConfig, vp_stage: int | None = None
                 ) -> TransformerBlockSubmodules:
    """``block_spec`` (this stage's layers, as Megatron's decoder-block spec builders give them)
    with the blocks of ``blocks``."""
    if blocks == BlocksConfig():
        return block_spec
    check_blocks(blocks, config)
    # Megatron's builders share one spec object between layers of a kind: copy each layer's.
    block_spec = TransformerBlockSubmodules(
        layer_specs=[copy.deepcopy(spec) for spec in block_spec.layer_specs],
        layer_norm=block_spec.layer_norm)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    kda = KDAConfig(num_heads=blocks.kda_num_heads, head_dim=blocks.kda_head_dim,
                    conv_kernel_size=blocks.kda_conv_kernel_size,
                    gate_lower_bound=blocks.kda_gate_lower_bound) if blocks.kda_layers else None
    for local, layer_spec in enumerate(block_spec.layer_specs):
        submodules = layer_spec.submodules
        if offset + local in blocks.kda_layers:
            submodules.self_attention = kda_attention_spec(kda)
        elif blocks.gated_nope_mla and isinstance(submodules.self_attention, ModuleSpec):
            submodules.self_attention = gated_nope_mla_spec(submodules.self_attention,
                                                            blocks.mla_lora_norm_eps)
    if blocks.attention_residual_block:
        block_spec = with_attention_residuals(block_spec, blocks.attention_residual_block)
    return block_spec
