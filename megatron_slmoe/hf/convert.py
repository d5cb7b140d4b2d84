"""Build the Megatron model a Hugging Face checkpoint describes, on this rank, and fill it.

``build_model_from_hf(hf)`` builds this rank's pipeline stage of the GPTModel with Stable Latent MoE
layers for ``hf.model_config`` under the parallel layout of Megatron's parallel_state (no random
initialisation: every tensor is about to be read); ``import_to_dist_checkpoint`` then loads it with
:func:`~megatron_slmoe.hf.loader.load_hf_weights` and writes a Megatron dist checkpoint (what
``--base-checkpoint`` reads) plus the model file ``model_config.yaml`` to build it with.
"""

from __future__ import annotations

import os
import shutil

import torch

from megatron_slmoe.hf.loader import HFModel, load_hf_weights

MODEL_FILE = "model_config.yaml"


def build_model_from_hf(hf: HFModel, params_dtype: torch.dtype = torch.float32, **overrides):
    """This rank's stage of the Megatron model of ``hf`` (parallel sizes from parallel_state)."""
    from megatron.core import parallel_state

    from megatron_slmoe.moe.model_config import build_gpt_model

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    settings = dict(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        sequence_parallel=tp > 1, use_cpu_initialization=True, perform_initialization=False,
        params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16)
    if pp > 1:
        settings["pipeline_dtype"] = params_dtype
    config = hf.model_config.transformer_config(**{**settings, **overrides})
    model = build_gpt_model(hf.model_config, config,
                            pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage())
    return model, config
