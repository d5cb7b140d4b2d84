"""The training run's own set-up on Megatron-Core: the model's MoE settings for the run, and DDP,
the (distributed) optimizer and the learning-rate schedule over the trainable parameters (the
rest of the set-up is ``megatron_slmoe.runtime.model``, shared with the other commands)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_slmoe.model.model_file import ModelConfig
from megatron_slmoe.moe.config import MoERunConfig
from megatron_slmoe.training.config import OptimizerConfig, ScheduleConfig


def model_config_for_run(model_config: ModelConfig, moe: MoERunConfig, finetune_mode: str,
                         distributed_timeout_minutes: Optional[int]) -> ModelConfig:
    """The model's SLMoE settings with the run's MoE flags over them (``MoERunConfig.over``), the
    run's process-group timeout, and a frozen router for LoRA."""
    changes = {"distributed_timeout_minutes": distributed_timeout_minutes}
    if finetune_mode == "lora":
        changes["freeze_router"] = True  # and with it the aux-loss-free expert bias
    return dataclasses.replace(model_config,
                               slmoe=dataclasses.replace(moe.over(model_config.slmoe), **changes))


def wrap_and_optimize(model, config, optimizer: OptimizerConfig, schedule: ScheduleConfig,
                      use_distributed_optimizer: bool, bf16: bool):
    """Megatron's DDP over the trainable parameters, its (distributed) Adam and LR scheduler."""
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                      use_distributed_optimizer=use_distributed_optimizer),
        model)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    megatron_optimizer = get_megatron_optimizer(
        MegatronOptimizerConfig(
            optimizer="adam", lr=optimizer.lr, min_lr=optimizer.min_lr,
            weight_decay=optimizer.weight_decay, adam_beta1=optimizer.adam_beta1,
            adam_beta2=optimizer.adam_beta2, clip_grad=optimizer.clip_grad, bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=use_distributed_optimizer),
        [ddp])
    scheduler = OptimizerParamScheduler(
        megatron_optimizer, init_lr=0.0, max_lr=optimizer.lr, min_lr=optimizer.min_lr,
        lr_warmup_steps=optimizer.lr_warmup_iters, lr_decay_steps=schedule.train_iters,
        lr_decay_style=optimizer.lr_decay_style, start_wd=optimizer.weight_decay,
        end_wd=optimizer.weight_decay, wd_incr_steps=schedule.train_iters,
        wd_incr_style="constant",
        # On resume the schedule is this run's (a larger --train-iters extends it), never the
        # checkpoint's; the check before the run refuses changes of the other optimizer settings.
        override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False)
    return ddp, megatron_optimizer, scheduler
