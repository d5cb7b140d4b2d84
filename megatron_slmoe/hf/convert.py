"""Build the Megatron model a Hugging Face checkpoint describes, on this rank, and fill it.

``build_model_in_layout(model_config)`` builds this rank's pipeline stage of the GPTModel with Stable
Latent MoE layers (for an HF checkpoint: ``open_hf_checkpoint(dir).model_config``) under the
parallel layout of Megatron's parallel_state, without random initialisation (every tensor is about
to be read); ``import_to_dist_checkpoint`` loads it with
:func:`~megatron_slmoe.hf.loader.load_hf_weights` and writes a Megatron dist checkpoint (what
``--base-checkpoint`` reads) plus the model file ``model_config.yaml`` to build it with.
"""

from __future__ import annotations

import os
import shutil

import torch

from megatron_slmoe.hf.loader import HFModel, load_hf_weights

MODEL_FILE = "model_config.yaml"


def build_model_in_layout(model_config, params_dtype: torch.dtype = torch.float32, **overrides):
    """(model, TransformerConfig): this rank's stage of the model of ``model_config`` (a
    ModelConfig), parallel sizes from Megatron's parallel_state."""
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
    config = model_config.transformer_config(**{**settings, **overrides})
    model = build_gpt_model(model_config, config,
                            pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage())
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
    tokenizer files. Written into a staging directory next to ``output`` and renamed into place
    once complete, so a failure leaves nothing at ``output``."""
    from megatron.core import dist_checkpointing

    from megatron_slmoe.moe.model_config import dump_model_config
    from megatron_slmoe.training.checkpointing import _write_text_atomic

    output = os.path.abspath(output)
    rank = torch.distributed.get_rank()
    staging = os.path.join(os.path.dirname(output), f".{os.path.basename(output)}.partial")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # a leftover of an interrupted run
        os.makedirs(staging)
    torch.distributed.barrier()
    try:
        model, _ = build_model_in_layout(hf.model_config, params_dtype=params_dtype)
        load_hf_weights([model], hf.checkpoint.directory, hf)
        dist_checkpointing.save(model.sharded_state_dict(), staging)
        if rank == 0:
            _write_text_atomic(os.path.join(staging, MODEL_FILE), dump_model_config(hf.model_config))
            _write_text_atomic(os.path.join(staging, "model_config.txt"), hf.model_config.name)
            for name in TOKENIZER_FILES:
                source = os.path.join(hf.checkpoint.directory, name)
                if os.path.isfile(source):
                    shutil.copyfile(source, os.path.join(staging, name))
        torch.distributed.barrier()
        if rank == 0:
            if os.path.isdir(output):
                os.rmdir(output)  # checked empty by the caller; os.replace needs it gone
            os.replace(staging, output)
        torch.distributed.barrier()
    except BaseException:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return output
