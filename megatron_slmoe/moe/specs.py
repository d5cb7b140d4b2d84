"""ModuleSpec builders: the Stable Latent MoE layer inside Megatron-Core's TransformerLayer.

Megatron's own decoder-block spec decides which layers are MoE (``moe_layer_freq``) and provides
attention, norms and the shared-expert MLP; we swap the MoE submodule of each MoE layer for ours.
"""

from __future__ import annotations

import copy
import logging

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_slmoe.moe.config import SLMoEConfig
from megatron_slmoe.moe.layer import SLMoESubmodules, StableLatentMoELayer


class _KnownMoELayerFilter(logging.Filter):
    """TransformerLayer warns "Unknown MLP type" for any MLP module it does not list, ours
    included; the only consequence is that it passes no pg_collection, and our layer takes the
    default one. Drop that line instead of printing it once per layer."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Unknown MLP type")


logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_KnownMoELayerFilter())


class LatentDotProductAttention(DotProductAttention):
    """Megatron's local (non-TE) core attention for multi-latent attention.

    Megatron's MLA passes the query/key and value head widths (``k_channels``, ``v_channels``),
    which its local DotProductAttention does not accept in megatron-core 0.16; it sizes its output
    by ``kv_channels``. The math is width-agnostic, so only the output width changes: heads times
    the value head width.
    """

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


def _kv_down_as_duplicated(module, args, output):
    """``linear_kv_down_proj``'s output re-laid as a duplicated linear's: the latent and the
    shared rope key whole, this rank's slice of the sequence (see ``TensorParallelMLA``)."""
    kv_combined, bias = output
    kv_combined = gather_from_tensor_model_parallel_region(kv_combined)
    return scatter_to_sequence_parallel_region(kv_combined), bias


class TensorParallelMLA(MLASelfAttention):
    """Megatron-Core's MLA with correct gradients under tensor parallelism with the local
    (non-Transformer-Engine) linears.

    With a column-parallel ``linear_kv_down_proj`` (the local spec), Megatron gathers its output
    over the TP ranks and splits off the shared rope key ``k_pos_emb``, which every rank then
    uses for its own heads. Each rank's gradient of that key is therefore a partial sum, but the
    gather's backward only splits the gradient, so the other ranks' heads' share is lost: under
    TP=2 the input gradients of every MLA layer were off by a few percent (the logits were
    right). Re-laid here as Transformer Engine's duplicated linear would give it (sequence
    slice, whole width), Megatron takes its other branch, whose gather of ``k_pos_emb`` over the
    sequence sums those partial gradients in its backward."""

    def get_query_key_value_tensors(self, hidden_states, *args, **kwargs):
        # Without sequence parallelism (generation turns it off: no gradients) Megatron's own
        # path is right; training under TP always has it on (model.build).
        if (self.config.tensor_model_parallel_size == 1 or not self.config.sequence_parallel
                or not isinstance(self.linear_kv_down_proj, ColumnParallelLinear)):
            return super().get_query_key_value_tensors(hidden_states, *args, **kwargs)
        hook = self.linear_kv_down_proj.register_forward_hook(_kv_down_as_duplicated)
        try:
            return super().get_query_key_value_tensors(hidden_states, *args, **kwargs)
        finally:
            hook.remove()


def slmoe_mlp_spec(megatron_moe_spec: ModuleSpec, slmoe: SLMoEConfig) -> ModuleSpec:
    """Our MoE layer spec, keeping the shared-expert spec Megatron chose for this backend."""
    return ModuleSpec(
        module=StableLatentMoELayer,
        submodules=SLMoESubmodules(shared_experts=megatron_moe_spec.submodules.shared_experts),
        params={"slmoe": slmoe},
    )


def get_slmoe_decoder_block_spec(config: TransformerConfig, slmoe: SLMoEConfig | None = None,
                                 use_transformer_engine: bool = False,
                                 vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """The decoder block of a Stable Latent MoE GPT: Megatron's, with our MoE layers."""
    slmoe = slmoe or SLMoEConfig()
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_transformer_engine,
                                       normalization=config.normalization, vp_stage=vp_stage)
    block = copy.deepcopy(block)
    for layer_spec in block.layer_specs:
        attention = layer_spec.submodules.self_attention
        if (config.multi_latent_attention and isinstance(attention, ModuleSpec)
                and attention.submodules.core_attention is DotProductAttention):
            attention.submodules.core_attention = LatentDotProductAttention
            if attention.module is MLASelfAttention:
                attention.module = TensorParallelMLA
        mlp = layer_spec.submodules.mlp
        if isinstance(mlp, ModuleSpec) and mlp.module is MoELayer:
            layer_spec.submodules.mlp = slmoe_mlp_spec(mlp, slmoe)
    return block
