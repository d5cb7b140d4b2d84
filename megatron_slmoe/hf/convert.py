"""Build the Megatron model a Hugging Face checkpoint describes, on this rank, and fill it.

``build_model_in_layout(model_config)`` builds this rank's pipeline stage of the GPTModel with Stable
Latent MoE layers (for an HF checkpoint: ``open_hf_checkpoint(dir).model_config``) under the
parallel layout of Megatron's parallel_state, without random initialisation (every tensor is about
to be read); ``import_to_dist_checkpoint`` loads it with
:func:`~megatron_slmoe.hf.loader.load_hf_weights` and writes a Megatron dist checkpoint (what
``--base-checkpoint`` reads) plus the model file ``model_config.yaml`` to build it with.
"""

from __future__ import annotations

import contextlib
import os
import shutil

import torch

from megatron_slmoe.hf.loader import HFModel, load_hf_weights
from megatron_slmoe.model.build import (
    build_gpt_model,
    mark_tensor_parallel_weights,
    run_transformer_config,
)
from megatron_slmoe.model.model_file import dump_model_config
from megatron_slmoe.parallel.config import ParallelConfig
from megatron_slmoe.utils.atomic import atomic_directory, write_text_atomic

MODEL_FILE = "model_config.yaml"


def build_model_in_layout(model_config, params_dtype: torch.dtype = torch.float32, build=None,
                          **overrides):
    """(model, TransformerConfig): this rank's stage of the model of ``model_config`` (a
    ModelConfig) under the layout of Megatron's parallel_state, built as the fine-tuning entry
    point builds it, without random initialisation (every tensor is about to be read).
    ``build(model_config, config, pre_process, post_process)``: default the GPTModel."""
    from megatron.core import parallel_state

    parallel = ParallelConfig(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size())
    config = run_transformer_config(
        model_config, parallel, bf16=params_dtype == torch.bfloat16,
        **{"perform_initialization": False, "params_dtype": params_dtype, **overrides})
    model = (build or build_gpt_model)(model_config, config,
                                       pre_process=parallel_state.is_pipeline_first_stage(),
                                       post_process=parallel_state.is_pipeline_last_stage())
    mark_tensor_parallel_weights(model)
    return model, config


# Files of the HF checkpoint that describe the tokenizer; copied next to the converted weights so
# the converted directory is all a run needs (``--tokenizer DIR``).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def import_to_dist_checkpoint(hf: HFModel, output: str,
                              params_dtype: torch.dtype = torch.float32) -> str:
    """Collective: every rank builds its stage/shard of the model, fills it rank-locally from
    the HF checkpoint and saves it into one Megatron dist checkpoint ``output`` (loadable in any
    parallel layout), with ``model_config.yaml`` (build it with ``--model-config``) and the
    tokenizer files. Rank 0 stages the directory (``utils.atomic.atomic_directory``: ``output``
    must be absent or empty) and renames it into place once every rank has written its part, so a
    failure leaves nothing at ``output``."""
    from megatron.core import dist_checkpointing

    output = os.path.abspath(output)
    rank = torch.distributed.get_rank()
    with atomic_directory(output) if rank == 0 else contextlib.nullcontext() as staging:
        where = [staging]
        torch.distributed.broadcast_object_list(where, src=0)
        staging = where[0]
        model, _ = build_model_in_layout(hf.model_config, params_dtype=params_dtype)
        load_hf_weights([model], hf.checkpoint.directory, hf)
        dist_checkpointing.save(model.sharded_state_dict(), staging)
        if rank == 0:
            write_text_atomic(os.path.join(staging, MODEL_FILE), dump_model_config(hf.model_config))
            write_text_atomic(os.path.join(staging, "model_config.txt"), hf.model_config.name)
            for name in TOKENIZER_FILES:
                source = os.path.join(hf.checkpoint.directory, name)
                if os.path.isfile(source):
                    shutil.copyfile(source, os.path.join(staging, name))
        torch.distributed.barrier()  # every rank's shards are in before rank 0 renames
    torch.distributed.barrier()  # the output is in place before anyone returns
    return output
