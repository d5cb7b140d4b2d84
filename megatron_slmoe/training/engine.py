"""The fine-tuning engine: set up on Megatron-Core, step, evaluate, save, finish.

Megatron-Core does the work: parallel_state, the model (GPTModel with our MoE layers, or the
task's multimodal model), DDP and the (distributed) optimizer over the trainable parameters only,
the pipeline schedules, dist checkpointing. A task (``training.tasks``) brings the data, the
forward step and the held-out answers; every other concern of a run (routing quality, hangs and
stragglers, the attempt record, the progress line, accuracy, exports, the summary, mirroring to
object storage) is a callback (``training.callbacks``, ``training.reliability``,
``training.reporting``).

The engine knows the protocols, not the concerns: what a run is made of (its task, its callbacks
and their order, what a failure that would repeat does to the job, the out-of-memory report) is
a ``Recipe`` the composition root gives it (``training.recipe``; a new concern is a new callback:
``recipe.build_engine(run, platform, callbacks=[...])``). What a run writes goes under its output
directory; ``metrics.jsonl`` is the engine's record sink (rank 0), one record per step filled in
by the callbacks.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch

from megatron_slmoe.data.sampler import micro_batches
from megatron_slmoe.model.attention_residuals import pipeline_seq_length
from megatron_slmoe.training import checkpointing
from megatron_slmoe.training.async_checkpoint import CheckpointWriter
from megatron_slmoe.training.callbacks.base import BEFORE, Callback, Callbacks, DURING, FINAL
from megatron_slmoe.training.config import RunConfig
from megatron_slmoe.training.context import RunContext
from megatron_slmoe.training.inputs import PreparedRun
from megatron_slmoe.training.reporting.metrics import MetricsWriter, NoRecords
from megatron_slmoe.training.tasks.base import Task

log = logging.getLogger("megatron_slmoe.training")

NON_FINITE_CAUSES = ("NaN or Inf in the base weights, a data batch, or a learning rate too "
                     "high for it (lower --lr, or raise --lr-warmup-iters)")


class NonFiniteError(RuntimeError):
    """The loss or a gradient became NaN or infinite: the run stops at that step (a restart would
    replay it)."""


@dataclass(frozen=True)
class BuiltRun:
    """What a recipe builds for a prepared run on Megatron-Core: the task, the model and its
    optimizer, the storage and the datasets."""

    task: Task
    model: list
    transformer_config: Any
    ddp: list
    optimizer: Any
    scheduler: Any
    storage: Any
    train: Any
    valid: Any


@dataclass(frozen=True)
class Recipe:
    """What a run is made of, given to the engine by the composition root (``training.recipe``).

    ``prepare(run, platform)``: the process groups started and the run's inputs opened once per
    rank (``run``: a prepared run, or a run configuration still to open), the run resolved
    against them; ``build(prepared, platform)``: its task, model, optimizer and datasets
    (``BuiltRun``); ``callbacks(run, task, extra)``: its callbacks in the order they are called,
    ``extra`` (the caller's) among them; ``failed(run, err)``: told of every failure before it
    propagates (one that would repeat ends the job); ``oom_report(run, platform, model_config,
    hf, err)``: the line an out-of-memory error is reported with."""

    prepare: Callable[[Union[PreparedRun, RunConfig], Any], PreparedRun]
    build: Callable[[PreparedRun, Any], BuiltRun]
    callbacks: Callable[[RunConfig, Task, Sequence[Callback]], list[Callback]]
    failed: Callable[[RunConfig, BaseException], None]
    oom_report: Callable[[RunConfig, Any, Any, Any, BaseException], str]


class Engine:
    """One run. ``setup()`` builds everything (collective); ``run()`` is the whole run and its
    exit code; ``train_step()`` and ``evaluate()`` are its steps, for tests and tools."""

    def __init__(self, run: Union[PreparedRun, RunConfig], platform, recipe: Recipe,
                 callbacks: Sequence[Callback] = ()) -> None:
        """``run``: a prepared run (``training.inputs.prepare_run``: checked, its inputs opened),
        or a run configuration whose inputs ``setup()`` opens (tests, tools)."""
        self.prepared = run if isinstance(run, PreparedRun) else None
        self.run_config = run.run if isinstance(run, PreparedRun) else run
        self.platform = platform
        self.recipe = recipe
        self.extra_callbacks = list(callbacks)
        self.ctx: Optional[RunContext] = None
        self.callbacks = Callbacks([])
        self.checkpoints = None
        self.model_config = self.hf = None
        self.eval_before: Optional[float] = None
        self.eval_after: Optional[float] = None

    # -- set-up ----------------------------------------------------------------------------------

    def setup(self) -> RunContext:
        from megatron.core import parallel_state

        # Tear down at the end only what this engine sets up (a test's rank pool keeps its own).
        self._owns_process_group = not torch.distributed.is_initialized()
        self._owns_model_parallel = not parallel_state.model_parallel_is_initialized()
        prepared = self.recipe.prepare(self.prepared or self.run_config, self.platform)
        self.prepared, run = prepared, prepared.run
        self.run_config, self.model_config, self.hf = run, prepared.model_config, prepared.hf
        built = self.recipe.build(prepared, self.platform)
        task = self.task = built.task
        model, transformer_config = built.model, built.transformer_config
        output_dir = run.output.output_dir
        schedule = run.schedule
        self.ctx = ctx = RunContext(
            platform=self.platform, rank=torch.distributed.get_rank(),
            world_size=torch.distributed.get_world_size(),
            dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=parallel_state.get_data_parallel_world_size(), output_dir=output_dir,
            train_iters=schedule.train_iters, global_batch_size=schedule.global_batch_size,
            micro_batch_size=schedule.micro_batch_size, seq_length=run.data.seq_length,
            model=model, ddp=built.ddp, transformer_config=transformer_config,
            model_config=prepared.model_config, optimizer=built.optimizer,
            scheduler=built.scheduler, tokenizer=prepared.tokenizer, hf=prepared.hf,
            train=built.train, valid=built.valid, storage=built.storage, records=NoRecords(),
            forward_only=self.forward_only, microbatches=self.microbatches, stop=self.stop)
        self.callbacks = Callbacks(self.recipe.callbacks(run, task, self.extra_callbacks))
        self.checkpoints = CheckpointWriter(
            run.output.async_save, run.output.use_persistent_ckpt_worker,
            before_promote=self.callbacks.checkpoint_promoting,
            after_promote=self.callbacks.checkpoint_promoted)
        self.callbacks.setup(ctx)
        return ctx

    # -- steps -----------------------------------------------------------------------------------

    def microbatches(self, dataset, start: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the global batch of samples ``[start, start + GB)``."""

        ctx = self.ctx
        window = range(start, start + ctx.global_batch_size)
        return [self.task.collate([dataset[i % len(dataset)] for i in part])
                for part in micro_batches(window, ctx.micro_batch_size, ctx.dp_rank, ctx.dp_size)]

    def _run_schedule(self, microbatches: list, forward_only: bool) -> float:
        """Mean loss over the global batch (every rank gets it)."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        ctx = self.ctx
        losses = get_forward_backward_func()(
            forward_step_func=self.task.step_function(ctx.device),
            data_iterator=iter(microbatches), model=ctx.ddp, num_microbatches=len(microbatches),
            seq_length=pipeline_seq_length(ctx.ddp, ctx.seq_length),
            micro_batch_size=ctx.micro_batch_size,
            forward_only=forward_only)
        loss = torch.zeros(1, dtype=torch.float64, device=ctx.device)
        if parallel_state.is_pipeline_last_stage():
            loss += torch.stack([entry["loss"].double() for entry in losses]).mean()
        # The last stage holds the loss: sum over the pipeline, average over data parallelism.
        torch.distributed.all_reduce(loss, group=parallel_state.get_pipeline_model_parallel_group())
        torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        return loss.item() / ctx.dp_size

    def forward_only(self, microbatches: list) -> float:
        return self._run_schedule(microbatches, forward_only=True)

    def train_step(self) -> dict:
        """One optimizer step on the next global batch; its record (loss, lr, grad norm,
        consumed samples, the step's wall time)."""
        ctx = self.ctx
        started = time.perf_counter()
        ctx.ddp.zero_grad_buffer()
        ctx.optimizer.zero_grad()
        microbatches = self.microbatches(ctx.train, ctx.consumed_samples)
        self.callbacks.before_step(ctx, microbatches)
        loss = self._run_schedule(microbatches, forward_only=False)
        step = ctx.iteration + 1
        if not math.isfinite(loss):  # before the optimizer makes the weights NaN too
            raise NonFiniteError(f"step {step}: the training loss is {loss}; the run stops "
                                 f"before its optimizer step (the newest checkpoint is intact): "
                                 f"{NON_FINITE_CAUSES}")
        update_ok, grad_norm, _ = ctx.optimizer.step()
        if grad_norm is not None and not math.isfinite(grad_norm):
            raise NonFiniteError(f"step {step}: the gradient norm is {grad_norm} (loss {loss:.4f})"
                                 f"; the run stops without saving this step (the newest "
                                 f"checkpoint is intact): {NON_FINITE_CAUSES}")
        if update_ok:
            ctx.scheduler.step(increment=1)
        ctx.iteration += 1
        ctx.consumed_samples += ctx.global_batch_size
        return {"iteration": ctx.iteration, "loss": loss,
                "lr": ctx.scheduler.get_lr(ctx.optimizer.param_groups[0]),
                "grad_norm": grad_norm, "consumed_samples": ctx.consumed_samples,
                "step_s": time.perf_counter() - started}

    def evaluate(self) -> float:
        """Mean held-out loss over ``--eval-iters`` global batches (collective)."""
        ctx = self.ctx
        ctx.ddp.eval()
        with torch.no_grad():
            losses = [self.forward_only(self.microbatches(ctx.valid, i * ctx.global_batch_size))
                      for i in range(self.run_config.schedule.eval_iters)]
        ctx.ddp.train()
        return sum(losses) / len(losses)

    def _evaluate(self, when: str, record: Optional[dict] = None) -> dict:
        record = {"iteration": self.ctx.iteration} if record is None else record
        record["eval_loss"] = self.evaluate()
        if when == BEFORE and not math.isfinite(record["eval_loss"]):
            raise NonFiniteError(f"the held-out loss before training is {record['eval_loss']}: "
                                 f"the model's weights hold NaN or Inf (its base checkpoint?)")
        self.callbacks.evaluate(self.ctx, record, when)
        if when == BEFORE:
            self.eval_before = record["eval_loss"]
            self.ctx.info(f"[finetune] held-out loss before training: {self.eval_before:.4f}")
        elif when == FINAL:
            self.eval_after = record["eval_loss"]
        return record

    # -- the run ---------------------------------------------------------------------------------

    def run(self) -> int:
        """The whole run. An out-of-memory error is reported with the memory planner's breakdown
        and the next step of the OOM checklist; checkpoints already written stay intact. Every
        way out is told to the callbacks (the attempt record keeps it for the next attempt)."""
        try:
            self.setup()
            self._train()
            return self._finish()
        except BaseException as err:
            first_line = (str(err).splitlines() or [""])[0]
            self.stop(f"{type(err).__name__}: {first_line}")
            if self.checkpoints is not None:
                # Every rank meets a non-finite loss at the same step (it is reduced): the
                # checkpoint in flight, of an earlier step, is finished; otherwise left unfinished.
                self.checkpoints.close(abort=not isinstance(err, NonFiniteError))
            self.recipe.failed(self.run_config, err)  # one that would repeat ends the job
            if not _is_out_of_memory(err):
                raise
            log.error("[finetune] rank %d: %s", torch.distributed.get_rank(),
                      self._oom_report(err))
            return 1
        finally:
            self.callbacks.close()

    def stop(self, reason: str) -> None:
        """The run ends abnormally for ``reason`` (any thread: a failure, SIGTERM, a hang)."""
        self.callbacks.stopped(self.ctx, reason, self.ctx.iteration if self.ctx else 0)

    def terminated(self) -> None:
        """SIGTERM's last word (training.reliability.lifeline): this rank was stopped, it did not fail."""
        self.stop("SIGTERM: stopped (torchrun stops every rank once one fails)")

    def _train(self) -> None:
        ctx, schedule, output = self.ctx, self.run_config.schedule, self.run_config.output
        root = os.path.join(ctx.output_dir, "checkpoints")
        resume_from = self._resume_point(root) if output.resume else None
        if resume_from:
            state = checkpointing.load_checkpoint(resume_from, [ctx.model], ctx.optimizer)
            self._load_schedule(state["scheduler"])
            ctx.iteration, ctx.consumed_samples = state["iteration"], state["consumed_samples"]
            self.eval_before = state.get("eval_loss_before")
            self.callbacks.load_state_dict(state.get("callbacks", {}))
            ctx.info(f"[finetune] resumed from {resume_from} at iteration {ctx.iteration}")
        if ctx.rank == 0:  # a later iteration's records of an earlier attempt are dropped
            ctx.records = MetricsWriter(ctx.output_dir, tensorboard=output.tensorboard,
                                        start_iteration=ctx.iteration)
        if self.eval_before is None:
            self._evaluate(BEFORE)
        self.callbacks.start(ctx, {"iteration": ctx.iteration, "resumed_from": resume_from})
        while ctx.iteration < schedule.train_iters:
            record = self.train_step()
            self.checkpoints.poll()
            self.callbacks.after_step(ctx, record)
            last = ctx.iteration == schedule.train_iters
            if ctx.iteration % schedule.eval_interval == 0 or last:
                self._evaluate(FINAL if last else DURING, record)
            ctx.records.write(record)
            if ctx.iteration % schedule.save_interval == 0 or last:
                self.checkpoints.save(
                    root, ctx.iteration, [ctx.model], ctx.optimizer,
                    {"consumed_samples": ctx.consumed_samples,
                     "scheduler": ctx.scheduler.state_dict(),
                     "eval_loss_before": self.eval_before,
                     "callbacks": self.callbacks.state_dict()},
                    output.keep_last)
        if self.eval_after is None:  # resumed at the end: no step ran in this attempt
            self._evaluate(FINAL)

    def _resume_point(self, root: str) -> Optional[str]:
        """The newest intact checkpoint of the run, or one newer that a callback brings (from
        --output-url's store)."""

        local = checkpointing.find_resumable(root)
        return self.callbacks.newer_checkpoint(self.ctx, local) or local

    def _load_schedule(self, saved: dict) -> None:
        """The learning-rate schedule of a checkpoint, continued under this run's --train-iters
        (a larger one extends the decay)."""
        scheduler = self.ctx.scheduler
        scheduler.load_state_dict(saved)
        before = saved.get("lr_decay_steps")
        if before is not None and before != scheduler.lr_decay_steps:
            lr = scheduler.get_lr(self.ctx.optimizer.param_groups[0])
            self.ctx.info(f"[finetune] --train-iters {scheduler.lr_decay_steps}: the learning "
                          f"rate now decays over {scheduler.lr_decay_steps} steps instead of "
                          f"{before} (lr at step {scheduler.num_steps}: {lr:.3e})")

    def _finish(self) -> int:
        from megatron.core import parallel_state

        ctx, run = self.ctx, self.run_config
        self.checkpoints.close()
        ctx.records.close()  # complete: the summary's pictures read metrics.jsonl
        storage = ctx.storage
        summary = {
            "eval_loss_before": self.eval_before, "eval_loss_after": self.eval_after,
            "accuracy_before": None, "accuracy_after": None, "steps": ctx.iteration,
            "adapter_dir": None, "output_dir": os.path.abspath(ctx.output_dir),
            "output_url": run.output.output_url, "finetune_mode": run.model.finetune_mode,
            "node_cache": storage.cache.stats.as_dict() if storage.cache_in_use else None,
            "checkpoint": {"async": self.checkpoints.async_save,
                           "persistent_worker": self.checkpoints.persistent_worker,
                           "blocked_s_by_save": self.checkpoints.blocked_s_by_save}}
        self.callbacks.finish(ctx, summary)
        if self._owns_model_parallel:
            parallel_state.destroy_model_parallel()
        if self._owns_process_group:
            torch.distributed.destroy_process_group()
        return 0

    def _oom_report(self, err: BaseException) -> str:
        return self.recipe.oom_report(self.run_config, self.platform, self.model_config, self.hf,
                                      err)


def _is_out_of_memory(err: BaseException) -> bool:
    # CUDA raises torch.OutOfMemoryError; torch_npu a RuntimeError saying so.
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "out of memory" in str(err).lower())
