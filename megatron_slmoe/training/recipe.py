"""The fine-tuning recipe: what a run is made of, composed here and handed to the engine.

The engine (``training.engine``) is the loop and knows only the protocols (task, callback, run
context), checkpoints and the record sink. This module is the composition root: how a run is
prepared and built on Megatron-Core (``prepare``, ``build``: its inputs opened once, its task
``training.tasks.build_task``, model, optimizer and datasets), its default callbacks and their
order (``CALLBACKS``: the order is data, one named factory per concern), what a failure that
would repeat does to the job (``reliability.failures``) and the out-of-memory report (the memory planner's breakdown).
``build_engine(run, platform, callbacks=[...])`` is a fine-tuning run; ``callbacks`` are a
caller's own concerns, called where ``EXTRA`` stands.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence, Union

import torch

from megatron_slmoe.plan.check import format_oom_report
from megatron_slmoe.runtime import model as runtime
from megatron_slmoe.storage import Storage
from megatron_slmoe.training import model_setup
from megatron_slmoe.training.callbacks.base import Callback
from megatron_slmoe.training.callbacks.mirror import OutputMirror
from megatron_slmoe.training.callbacks.outputs import AdapterExport, BaseExport
from megatron_slmoe.training.callbacks.routing import RoutingQuality
from megatron_slmoe.training.config import RunConfig
from megatron_slmoe.training.engine import BuiltRun, Engine, Recipe
from megatron_slmoe.training.inputs import PreparedRun, memory_check, open_run
from megatron_slmoe.training.reliability.attempts import AttemptRecord
from megatron_slmoe.training.reliability.failures import end_job_if_it_repeats
from megatron_slmoe.training.reliability.heartbeat import HangWatch
from megatron_slmoe.training.reliability.stragglers import StragglerWatch
from megatron_slmoe.training.reporting.announce import RunAnnouncement
from megatron_slmoe.training.reporting.progress import ProgressLog
from megatron_slmoe.training.reporting.summary import RunSummary
from megatron_slmoe.training.resolve import resolve_run
from megatron_slmoe.training.tasks import build_task
from megatron_slmoe.training.tasks.accuracy import HeldOutAnswers
from megatron_slmoe.training.tasks.base import Task

def prepare(run: Union[PreparedRun, RunConfig], platform) -> PreparedRun:
    """The process groups started, the run's inputs opened once per rank (a prepared run's
    already are), the run resolved against them (an adapter's shape, ...) and its model
    configuration made the run's (its MoE settings, its process-group timeout)."""
    config = run.run if isinstance(run, PreparedRun) else run
    runtime.init_distributed(config.parallel, config.schedule.seed, platform)
    prepared = run if isinstance(run, PreparedRun) else open_run(config)
    config = resolve_run(config, platform, prepared.hf)
    model_config = model_setup.model_config_for_run(
        prepared.model_config, config.moe, config.model.finetune_mode,
        config.parallel.distributed_timeout_minutes)
    return dataclasses.replace(prepared, run=config, model_config=model_config)


def build(prepared: PreparedRun, platform) -> BuiltRun:
    """The run's task, its model on Megatron-Core with the base weights and the LoRA adapters,
    DDP and the optimizer over the trainable parameters, and the task's datasets."""
    run, hf = prepared.run, prepared.hf
    storage = Storage(run.storage)
    task = build_task(run, hf)
    model, transformer_config = runtime.build_model(
        prepared.model_config, run.parallel, run.model.precision == "bf16", platform,
        initialize=not (run.model.base_checkpoint or run.model.hf_checkpoint),
        build=runtime.model_builder(task.build_model, hf))
    runtime.load_base_weights(model, run.model, hf, storage)
    task.after_base_weights(model)
    if run.model.finetune_mode == "lora":
        runtime.add_lora(model, run.lora, run.model.adapter_init, storage)
    ddp, optimizer, scheduler = model_setup.wrap_and_optimize(
        model, transformer_config, run.optimizer, run.schedule,
        run.parallel.use_distributed_optimizer, run.model.precision == "bf16")
    train, valid = task.datasets(storage, prepared.tokenizer, run.output.output_dir)
    return BuiltRun(task=task, model=model, transformer_config=transformer_config, ddp=ddp,
                    optimizer=optimizer, scheduler=scheduler, storage=storage, train=train,
                    valid=valid)


Factory = Callable[[RunConfig, Task], Sequence[Callback]]


def _lora(run: RunConfig) -> bool:
    return run.model.finetune_mode == "lora"


EXTRA = "extra"
"""Where a caller's own callbacks go among ``CALLBACKS``: after every callback that fills in a
step's record or the summary, before the summary is written."""

CALLBACKS: tuple[tuple[str, Factory], ...] = (
    # first: the configuration is written before any other concern sets up
    ("announce", lambda run, task: [RunAnnouncement(run)]),
    ("progress", lambda run, task: [ProgressLog(run.schedule.log_interval,
                                                run.lora if _lora(run) else None)]),
    ("stragglers", lambda run, task: [StragglerWatch(run.health, run.schedule.log_interval)]),
    # before the answers: the final ones are not timed
    ("heartbeat", lambda run, task: [HangWatch(run.health)]),
    ("routing", lambda run, task: [RoutingQuality(run.moe, run.monitor, _lora(run))]),
    ("task", lambda run, task: task.callbacks()),
    ("accuracy", lambda run, task: [HeldOutAnswers(task)]),
    ("adapter", lambda run, task: [AdapterExport(run.lora, run.model, run.output.export_hf,
                                                 run.output.export_hf_layout)]
     if _lora(run) else []),
    ("base", lambda run, task: [BaseExport(run.output.save_base, run.model.config)]
     if run.output.save_base else []),
    (EXTRA, lambda run, task: []),
    ("summary", lambda run, task: [RunSummary(run.output.plots)]),
    ("mirror", lambda run, task: [OutputMirror(run.output.output_url, run.output.keep_last,
                                               run.output.export_hf)]
     if run.output.output_url else []),
    # last: "finished" is written once everything else has finished
    ("attempt", lambda run, task: [AttemptRecord()]),
)
"""A run's callbacks in the order they are called, each a (name, factory of the run's callbacks
of that concern) pair."""


def build_callbacks(run: RunConfig, task: Task, extra: Sequence[Callback] = ()) -> list[Callback]:
    """The run's callbacks in the order of ``CALLBACKS``, ``extra`` where ``EXTRA`` stands."""
    callbacks: list[Callback] = []
    for name, factory in CALLBACKS:
        callbacks += list(extra) if name == EXTRA else factory(run, task)
    return callbacks


def oom_report(run: RunConfig, platform, model_config, hf, err: BaseException) -> str:
    """An out-of-memory error's report: the memory planner's breakdown of this run and the next
    step of the OOM checklist (``model_config``: the run's, None before it was opened)."""
    check = None
    if model_config is not None:
        check = memory_check(run, torch.distributed.get_world_size(), platform, model_config, hf)
    if check is None:
        return f"out of memory: {str(err).splitlines()[0]} (no device memory to plan against)"
    return format_oom_report(check, err)


FINE_TUNING = Recipe(prepare=prepare, build=build, callbacks=build_callbacks,
                     failed=end_job_if_it_repeats, oom_report=oom_report)


def build_engine(run: RunConfig, platform, callbacks: Sequence[Callback] = ()) -> Engine:
    """A fine-tuning run (``Engine.run()`` runs it); ``callbacks``: the caller's own concerns."""
    return Engine(run, platform, FINE_TUNING, callbacks)
