"""Megatron-Core's GPTModel with Stable Latent MoE layers, built from a model config and the run's
parallel settings."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_slmoe.model.layer_blocks import apply_blocks
from megatron_slmoe.model.model_file import ModelConfig
from megatron_slmoe.moe.specs import get_slmoe_decoder_block_spec
from megatron_slmoe.parallel.config import ParallelConfig
from megatron_slmoe.platform import apply_adaptor


def run_transformer_config(model_config: ModelConfig, parallel: ParallelConfig, bf16: bool,
                           **extra: Any) -> TransformerConfig:
    """The model's TransformerConfig under the run's layout, precision and recomputation.

    Sequence parallelism is on whenever TP > 1: Megatron's MoE requires it, and it costs nothing
    but a different collective pattern."""
    overrides: dict[str, Any] = dict(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        sequence_parallel=parallel.tensor_model_parallel_size > 1,
        bf16=bf16, use_cpu_initialization=True,
    )
    if parallel.recompute_granularity:
        overrides["recompute_granularity"] = parallel.recompute_granularity
        if parallel.recompute_granularity == "full":
            overrides.update(recompute_method="uniform", recompute_num_layers=1)
        if parallel.recompute_modules:
            overrides["recompute_modules"] = list(parallel.recompute_modules)
    return model_config.transformer_config(**{**overrides, **extra})


_PARTITION_DIMS = ((ColumnParallelLinear, 0), (VocabParallelEmbedding, 0), (RowParallelLinear, 1))


def mark_tensor_parallel_weights(model: torch.nn.Module) -> None:
    """Give the tensor-parallel weights of a model built with ``perform_initialization=False``
    (its weights about to be loaded) the marks Megatron sets only while initialising them
    (``tensor_model_parallel``, partition dim). Unmarked, Megatron's optimizer counts a shard
    only on TP rank 0 in the grad norm, so clipping is wrong under TP (full fine-tuning)."""
    for module in model.modules():
        for cls, dim in _PARTITION_DIMS:
            if isinstance(module, cls) and getattr(module, "weight", None) is not None:
                set_tensor_model_parallel_attributes(module.weight, True, dim, 1)


def build_gpt_model(model_config: ModelConfig, transformer_config: TransformerConfig,
                    pre_process: bool = True, post_process: bool = True,
                    vp_stage: int | None = None, **gpt_extra: Any):
    """Megatron's GPTModel with Stable Latent MoE layers (this rank's pipeline stage);
    ``gpt_extra``: further GPTModel arguments (a multimodal model's embedding settings)."""
    from megatron.core.models.gpt import GPTModel

    apply_adaptor()

    spec = get_slmoe_decoder_block_spec(transformer_config, model_config.slmoe, vp_stage=vp_stage)
    spec = apply_blocks(spec, model_config.blocks, transformer_config, vp_stage=vp_stage)
    return GPTModel(config=transformer_config, transformer_layer_spec=spec,
                    pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                    **model_config.gpt_kwargs(), **gpt_extra)
