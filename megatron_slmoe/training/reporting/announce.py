"""A run's first words: the resolved run configuration as ``config.yaml`` in the output directory
(what a rerun in the same directory is compared against) and one log line of where and how it
runs (platform, layout, mode, trainable parameters)."""

from __future__ import annotations

import os

from megatron_slmoe.training.callbacks.base import Callback
from megatron_slmoe.training.cli import to_yaml
from megatron_slmoe.training.config import RunConfig
from megatron_slmoe.training.context import RunContext
from megatron_slmoe.utils.atomic import write_text_atomic


class RunAnnouncement(Callback):
    """``run``: the run configuration as set-up resolved it. Keep it first: the configuration is
    written before any other concern sets up."""

    name = "announce"

    def __init__(self, run: RunConfig) -> None:
        self.run = run

    def setup(self, ctx: RunContext) -> None:
        if ctx.rank != 0:
            return
        run, parallel = self.run, self.run.parallel
        write_text_atomic(os.path.join(ctx.output_dir, "config.yaml"), to_yaml(run))
        trainable = sum(p.numel() for p in ctx.model.parameters() if p.requires_grad)
        ctx.info(f"[finetune] platform={ctx.platform.name} backend={ctx.platform.backend} "
                 f"world={ctx.world_size} tp={parallel.tensor_model_parallel_size} "
                 f"pp={parallel.pipeline_model_parallel_size} "
                 f"ep={parallel.expert_model_parallel_size} dp={ctx.dp_size} "
                 f"mode={run.model.finetune_mode} trainable={trainable:,} "
                 f"output={ctx.output_dir}")
