"""Process groups, the model on this rank, and its optimizer: all from Megatron-Core."""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_slmoe.moe.model_config import ModelConfig, build_gpt_model


def init_distributed(args, platform) -> None:
    platform.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(platform.backend, timeout=timeout)
    if parallel_state.model_parallel_is_initialized():  # e.g. by a test harness
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=1,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )
    # megatron-core 0.16 builds this one group without the timeout (torch's 30-minute default).
    parallel_state.update_pg_timeout(timeout, parallel_state.get_expert_data_parallel_group_gloo())
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)


def use_bf16(args, platform) -> bool:
    if args.fp32:
        return False
    return bool(args.bf16) if args.bf16 is not None else platform.name != "cpu"


def model_config_for_run(model_config: ModelConfig, args) -> ModelConfig:
    """The run's SLMoE settings: dispatcher flags, and a frozen router for LoRA."""
    slmoe = model_config.slmoe
    changes = {"distributed_timeout_minutes": args.distributed_timeout_minutes}
    if args.moe_token_dispatcher_type:
        changes["dispatcher"] = args.moe_token_dispatcher_type
    if args.moe_hierarchical_alltoall:
        changes["hierarchical_alltoall"] = True
    if args.moe_node_size:
        changes["node_size"] = args.moe_node_size
    if args.finetune_mode == "lora":
        changes["freeze_router"] = True  # and with it the aux-loss-free expert bias
    return dataclasses.replace(model_config, slmoe=dataclasses.replace(slmoe, **changes))


def build_model(model_config: ModelConfig, args, platform, build=None):
    """This rank's model and its TransformerConfig; ``build(model_config, config, pre_process,
    post_process)`` makes the model (default: the Stable Latent MoE GPTModel)."""
    bf16 = use_bf16(args, platform)
    overrides = dict(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        sequence_parallel=args.tensor_model_parallel_size > 1,
        bf16=bf16, use_cpu_initialization=True,
    )
    if args.pipeline_model_parallel_size > 1:
        overrides["pipeline_dtype"] = torch.bfloat16 if bf16 else torch.float32
    if args.recompute_granularity:
        overrides["recompute_granularity"] = args.recompute_granularity
        if args.recompute_granularity == "full":
            overrides.update(recompute_method="uniform", recompute_num_layers=1)
        if args.recompute_modules:
            overrides["recompute_modules"] = list(args.recompute_modules)
    config = model_config.transformer_config(**overrides)
    model = (build or build_gpt_model)(model_config, config,
                                       pre_process=parallel_state.is_pipeline_first_stage(),
                                       post_process=parallel_state.is_pipeline_last_stage())
    model.to(platform.device())
    return model, config


def load_base_weights(model, directory: str) -> None:
    """Base weights from a Megatron dist checkpoint, in whatever layout it was saved."""
    state = dist_checkpointing.load(model.sharded_state_dict(), directory)
    model.load_state_dict(state, strict=True)


def wrap_and_optimize(model, config, args, bf16: bool):
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                      use_distributed_optimizer=args.use_distributed_optimizer),
        model)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr,
                        weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                        adam_beta2=args.adam_beta2, clip_grad=args.clip_grad, bf16=bf16,
                        params_dtype=torch.bfloat16 if bf16 else torch.float32,
                        use_distributed_optimizer=args.use_distributed_optimizer),
        [ddp])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=args.train_iters,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters, wd_incr_style="constant")
    return ddp, optimizer, scheduler
