"""What every program that runs a model does, on Megatron-Core: the process groups, the model on
this rank (the Stable Latent MoE GPTModel or a task's model), its base weights (a Megatron dist
checkpoint or a Hugging Face checkpoint, each rank reading its own slices) and its LoRA adapter.
The fine-tuning engine, ``slmoe-generate`` and ``slmoe-convert-hf`` share it."""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from typing import Optional

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.hf import HFCheckpointError, load_hf_weights, open_hf_checkpoint
from megatron_slmoe.hf.loader import expert_weights_layout
from megatron_slmoe.hf.tower_model import hf_model_builder
from megatron_slmoe.lora.adapter import load_adapter
from megatron_slmoe.lora.config import LoRAConfig
from megatron_slmoe.lora.inject import check_targets, inject_lora
from megatron_slmoe.model.build import (
    build_gpt_model,
    mark_tensor_parallel_weights,
    run_transformer_config,
)
from megatron_slmoe.model.census import meta_device
from megatron_slmoe.model.config import ModelSection
from megatron_slmoe.model.model_file import ModelConfig, load_model_config
from megatron_slmoe.moe.config import EXPERT_TENSOR_PARALLEL_SIZE
from megatron_slmoe.parallel.config import ParallelConfig
from megatron_slmoe.platform import apply_adaptor
from megatron_slmoe.platform.single_rank import init_single_rank


def init_distributed(parallel: ParallelConfig, seed: int, platform) -> None:
    apply_adaptor()
    platform.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(minutes=parallel.distributed_timeout_minutes)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(platform.backend, timeout=timeout)
    if parallel_state.model_parallel_is_initialized():  # e.g. by a test harness
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=EXPERT_TENSOR_PARALLEL_SIZE,
        distributed_timeout_minutes=parallel.distributed_timeout_minutes,
    )
    # megatron-core 0.16 builds this one group without the timeout (torch's 30-minute default).
    parallel_state.update_pg_timeout(timeout, parallel_state.get_expert_data_parallel_group_gloo())
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def resolve_precision(model: ModelSection, platform) -> str:
    """'bf16' or 'fp32': auto is bf16 on GPUs/NPUs, fp32 on CPU."""
    if model.precision != "auto":
        return model.precision
    return "fp32" if platform.name == "cpu" else "bf16"


def open_model(model: ModelSection, check_shapes: bool = False):
    """(ModelConfig, HFModel or None): the run's model. With ``--hf-checkpoint`` it is the one the
    checkpoint's config.json describes, and the opened checkpoint comes with it (``check_shapes``:
    every tensor against config.json, see ``hf.open_hf_checkpoint``), its routed experts held as
    ``--expert-weights`` says (``hf.loader.expert_weights_layout``); else the model file. Needs no
    process group; a bad checkpoint is one ConfigError line naming the file and the tensor."""
    if not model.hf_checkpoint:
        return load_model_config(model.config), None
    try:
        hf = open_hf_checkpoint(model.hf_checkpoint, check_shapes=check_shapes)
        packed = expert_weights_layout(hf, model.expert_weights, model.finetune_mode)
    except HFCheckpointError as err:
        raise ConfigError(f"--hf-checkpoint: {err}") from None
    if packed is not None:
        hf.model_config = dataclasses.replace(
            hf.model_config, slmoe=dataclasses.replace(hf.model_config.slmoe,
                                                       expert_weights=packed))
    return hf.model_config, hf


def build_model(model_config: ModelConfig, parallel: ParallelConfig, bf16: bool, platform,
                initialize: bool = True, build=build_gpt_model):
    """This rank's pipeline stage of the model, on the platform's device (``initialize=False``:
    no random weights, for a model whose every weight is about to be loaded). ``build(model_config,
    transformer_config, pre_process, post_process)`` makes it (default: the Stable Latent MoE
    GPTModel; an image-text run passes the multimodal model's builder)."""
    config = run_transformer_config(model_config, parallel, bf16,
                                    perform_initialization=initialize)
    model = build(model_config, config, pre_process=parallel_state.is_pipeline_first_stage(),
                  post_process=parallel_state.is_pipeline_last_stage())
    if not initialize:
        mark_tensor_parallel_weights(model)
    model.to(platform.device())
    return model, config


def model_builder(default, hf=None):
    """The builder of the run's model: an HF checkpoint's image-text model where it has a vision
    side (Kimi-K2.5), else ``default`` (the task's, or the language model's)."""
    if hf is not None:
        build = hf_model_builder(hf)
        if build is not None:
            return build
    return default


def check_lora_targets(model_config: ModelConfig, lora: LoRAConfig, build=build_gpt_model) -> None:
    """Every target of ``lora`` adapts something in the model ``build`` makes of ``model_config``
    (see ``build_model``): the whole model, one stage, built on the meta device (no memory, no
    weights), before the run's process group forms (a one-rank group and parallel state for the
    build, gone after; where model parallelism is already set up, the injection checks the
    targets instead). Raises LoRATargetError."""
    made_group = not torch.distributed.is_initialized()
    made_state = not parallel_state.model_parallel_is_initialized()
    try:
        init_single_rank()
    except RuntimeError:  # model parallelism already set up
        return
    try:
        config = run_transformer_config(model_config, ParallelConfig(), bf16=False,
                                        perform_initialization=False)
        with meta_device():
            model = build(model_config, config, pre_process=True, post_process=True)
    finally:
        if made_state and parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if made_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    check_targets([model], lora)


def load_base_weights(model, model_section: ModelSection, hf=None, storage=None) -> None:
    """The base weights the run names: a Megatron dist checkpoint (``--base-checkpoint``, in
    whatever layout it was saved; a stored one is read from the node's copy through
    ``storage``), or a Hugging Face checkpoint (``--hf-checkpoint``; ``hf`` is its
    ``open_model``), each rank reading only its own slices. Nothing to do without either."""
    if model_section.hf_checkpoint:
        load_hf_weights([model], model_section.hf_checkpoint, hf,
                        unmap_after_bytes=model_section.hf_unmap_mib * 2**20)
    elif model_section.base_checkpoint:
        directory = model_section.base_checkpoint
        if storage is not None:
            directory = storage.local_dir(directory)
        state = dist_checkpointing.load(model.sharded_state_dict(), directory)
        model.load_state_dict(state, strict=True)


def add_lora(model, lora: LoRAConfig, adapter_init: Optional[str] = None, storage=None) -> None:
    """LoRA adapters on the run's targets, starting from ``adapter_init`` (an adapter directory;
    a stored one through ``storage``) or from zero."""
    inject_lora([model], lora)
    if adapter_init:
        load_adapter([model], storage.local_dir(adapter_init) if storage else adapter_init)
