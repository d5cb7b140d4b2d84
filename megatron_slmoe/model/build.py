"""Megatron-Core's GPTModel with Stable Latent MoE layers, built from a model config and the run's
parallel settings."""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_slmoe.config.run import ParallelConfig
from megatron_slmoe.model.config import ModelConfig


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


def build_gpt_model(model_config: ModelConfig, transformer_config: TransformerConfig,
                    pre_process: bool = True, post_process: bool = True,
                    vp_stage: int | None = None):
    """Megatron's GPTModel with Stable Latent MoE layers (this rank's pipeline stage)."""
    from megatron.core.models.gpt import GPTModel

    from megatron_slmoe.moe.specs import get_slmoe_decoder_block_spec

    spec = get_slmoe_decoder_block_spec(transformer_config, model_config.slmoe, vp_stage=vp_stage)
    return GPTModel(config=transformer_config, transformer_layer_spec=spec,
                    pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                    **model_config.gpt_kwargs())
