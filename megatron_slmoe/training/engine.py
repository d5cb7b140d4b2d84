"""The fine-tuning engine: set up on Megatron-Core, step, evaluate, save, finish.

Megatron-Core does the work: parallel_state, the model (GPTModel with our MoE layers, or the
task's multimodal model), DDP and the (distributed) optimizer over the trainable parameters only,
the pipeline schedules, dist checkpointing. A task (``training.tasks``) brings the data, the
forward step and the held-out answers; every other concern of a run (routing quality, hangs and
stragglers, the attempt record, the progress line, accuracy, exports, the summary, mirroring to
object storage) is a callback (``training.callbacks``). A new concern is a new callback: pass it
as ``Engine(run, platform, callbacks=[...])``.

The engine is the one place that sees the whole run configuration: it gives every component its
own section. What a run writes goes under its output directory; ``metrics.jsonl`` is the engine's
record sink (rank 0), one record per step filled in by the callbacks.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import time
from typing import Optional, Sequence

import torch

from megatron_slmoe.training.callbacks.base import (
    BEFORE,
    DURING,
    FINAL,
    Callback,
    Callbacks,
    RunContext,
)
from megatron_slmoe.training.config import RunConfig
from megatron_slmoe.training.tasks.base import Task

log = logging.getLogger("megatron_slmoe.training")

NON_FINITE_CAUSES = ("NaN or Inf in the base weights, a data batch, or a learning rate too "
                     "high for it (lower --lr, or raise --lr-warmup-iters)")


class NonFiniteError(RuntimeError):
    """The loss or a gradient became NaN or infinite: the run stops at that step (a restart would
    replay it)."""


def build_task(run: RunConfig, hf=None) -> Task:
    """The run's task; ``hf``: the opened HF checkpoint the run starts from, if any."""
    if run.data.task == "image-text":
        from megatron_slmoe.training.tasks.image_text import ImageTextTask

        return ImageTextTask(run.data, run.vision, run.image_text, run.schedule,
                             run.model.finetune_mode, hf)
    from megatron_slmoe.training.tasks.text import TextTask

    return TextTask(run.data, run.schedule)


def build_callbacks(run: RunConfig, task: Task, extra: Sequence[Callback] = ()) -> list[Callback]:
    """The run's callbacks in the order they are called: those that fill in a step's record or
    the summary first (``extra`` after the built-in ones), then the summary, the mirror, and the
    attempt record last."""
    from megatron_slmoe.training.callbacks.accuracy import HeldOutAnswers
    from megatron_slmoe.training.callbacks.mirror import OutputMirror
    from megatron_slmoe.training.callbacks.outputs import AdapterExport, BaseExport
    from megatron_slmoe.training.callbacks.progress import ProgressLog
    from megatron_slmoe.training.callbacks.reliability import (
        AttemptRecord,
        HangWatch,
        StragglerWatch,
    )
    from megatron_slmoe.training.callbacks.routing import RoutingQuality
    from megatron_slmoe.training.callbacks.summary import RunSummary

    lora = run.model.finetune_mode == "lora"
    callbacks: list[Callback] = [
        ProgressLog(run.schedule.log_interval, run.lora if lora else None),
        StragglerWatch(run.health, run.schedule.log_interval),
        HangWatch(run.health),  # before the answers: the final ones are not timed
        RoutingQuality(run.moe, run.monitor, lora),
        *task.callbacks(),
        HeldOutAnswers(task),
    ]
    if lora:
        callbacks.append(AdapterExport(run.lora, run.model, run.output.export_hf,
                                       run.output.export_hf_layout))
    if run.output.save_base:
        callbacks.append(BaseExport(run.output.save_base, run.model.config))
    callbacks += [*extra, RunSummary(run.output.plots)]
    if run.output.output_url:
        callbacks.append(OutputMirror(run.output.output_url, run.output.keep_last,
                                      run.output.export_hf))
    callbacks.append(AttemptRecord())
    return callbacks


class Engine:
    """One run. ``setup()`` builds everything (collective); ``run()`` is the whole run and its
    exit code; ``train_step()`` and ``evaluate()`` are its steps, for tests and tools."""

    def __init__(self, run: RunConfig, platform, callbacks: Sequence[Callback] = ()) -> None:
        self.run_config, self.platform = run, platform
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

        from megatron_slmoe.storage import Storage
        from megatron_slmoe.runtime import model as runtime
        from megatron_slmoe.training import model_setup
        from megatron_slmoe.training.async_checkpoint import CheckpointWriter
        from megatron_slmoe.training.metrics import NoRecords
        from megatron_slmoe.training.resolve import resolve_run

        run = self.run_config
        # Tear down at the end only what this engine sets up (a test's rank pool keeps its own).
        self._owns_process_group = not torch.distributed.is_initialized()
        self._owns_model_parallel = not parallel_state.model_parallel_is_initialized()
        runtime.init_distributed(run.parallel, run.schedule.seed, self.platform)
        run = self.run_config = resolve_run(run, self.platform)
        storage = Storage(run.storage)
        model_config, hf = runtime.open_model(run.model)  # checked before start-up
        model_config = model_setup.model_config_for_run(
            model_config, run.moe, run.model.finetune_mode,
            run.parallel.distributed_timeout_minutes)
        self.model_config, self.hf = model_config, hf
        task = self.task = build_task(run, hf)
        model, transformer_config = runtime.build_model(
            model_config, run.parallel, run.model.precision == "bf16", self.platform,
            initialize=not (run.model.base_checkpoint or run.model.hf_checkpoint),
            build=runtime.model_builder(task.build_model, hf))
        runtime.load_base_weights(model, run.model, hf, storage)
        task.after_base_weights(model)
        if run.model.finetune_mode == "lora":
            runtime.add_lora(model, run.lora, run.model.adapter_init, storage)
        ddp, optimizer, scheduler = model_setup.wrap_and_optimize(
            model, transformer_config, run.optimizer, run.schedule,
            run.parallel.use_distributed_optimizer, run.model.precision == "bf16")
        output_dir = run.output.output_dir
        train, valid, tokenizer = task.datasets(storage, model_config, output_dir)
        schedule = run.schedule
        self.ctx = ctx = RunContext(
            platform=self.platform, rank=torch.distributed.get_rank(),
            world_size=torch.distributed.get_world_size(),
            dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=parallel_state.get_data_parallel_world_size(), output_dir=output_dir,
            train_iters=schedule.train_iters, global_batch_size=schedule.global_batch_size,
            micro_batch_size=schedule.micro_batch_size, seq_length=run.data.seq_length,
            model=model, ddp=ddp, transformer_config=transformer_config,
            model_config=model_config, optimizer=optimizer, scheduler=scheduler,
            tokenizer=tokenizer, train=train, valid=valid, storage=storage, records=NoRecords(),
            forward_only=self.forward_only, microbatches=self.microbatches, stop=self.stop)
        self.callbacks = Callbacks(build_callbacks(run, task, self.extra_callbacks))
        self.checkpoints = CheckpointWriter(
            run.output.async_save, run.output.use_persistent_ckpt_worker,
            before_promote=self.callbacks.checkpoint_promoting,
            after_promote=self.callbacks.checkpoint_promoted)
        if ctx.rank == 0:
            self._announce()
        self.callbacks.setup(ctx)
        return ctx

    def _announce(self) -> None:
        from megatron_slmoe.training.cli import to_yaml
        from megatron_slmoe.utils.atomic import write_text_atomic

        run, ctx = self.run_config, self.ctx
        write_text_atomic(os.path.join(ctx.output_dir, "config.yaml"), to_yaml(run))
        trainable = sum(p.numel() for p in ctx.model.parameters() if p.requires_grad)
        parallel = run.parallel
        log.info("[finetune] platform=%s backend=%s world=%d tp=%d pp=%d ep=%d dp=%d mode=%s "
                 "trainable=%s output=%s", self.platform.name, self.platform.backend,
                 ctx.world_size, parallel.tensor_model_parallel_size,
                 parallel.pipeline_model_parallel_size, parallel.expert_model_parallel_size,
                 ctx.dp_size, run.model.finetune_mode, f"{trainable:,}", ctx.output_dir)

    # -- steps -----------------------------------------------------------------------------------

    def microbatches(self, dataset, start: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the global batch of samples ``[start, start + GB)``."""
        from megatron_slmoe.data.sampler import micro_batches

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
            seq_length=ctx.seq_length, micro_batch_size=ctx.micro_batch_size,
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
            disk_full = isinstance(err, OSError) and err.errno == errno.ENOSPC
            if (isinstance(err, input_errors()) or disk_full) and self.run_config.output.output_dir:
                from megatron_slmoe.training.lifeline import end_job_for_input_error

                message = str(err)
                if disk_full:
                    where = err.filename or "a file the run writes"
                    message = (f"no space left on the device of {where} (the newest complete "
                               f"checkpoint is intact): free space or lower --keep-last, then "
                               f"rerun to resume")
                end_job_for_input_error(self.run_config.output.output_dir, message)
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
        """SIGTERM's last word (training.lifeline): this rank was stopped, it did not fail."""
        self.stop("SIGTERM: stopped (torchrun stops every rank once one fails)")

    def _train(self) -> None:
        from megatron_slmoe.training import checkpointing
        from megatron_slmoe.training.metrics import MetricsWriter

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
        from megatron_slmoe.training import checkpointing

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
        from megatron_slmoe.plan.check import format_oom_report
        from megatron_slmoe.training.inputs import memory_check

        check = None
        if self.model_config is not None:
            check = memory_check(self.run_config, torch.distributed.get_world_size(),
                                 self.platform, self.model_config, self.hf)
        if check is None:
            return f"out of memory: {str(err).splitlines()[0]} (no device memory to plan against)"
        return format_oom_report(check, err)


def input_errors() -> tuple[type, ...]:
    """Errors a restart would meet again: bad input (a damaged data shard, an adapter that does
    not fit, a stored object that is not there, text carrying a model's image tokens) and a loss
    gone NaN (replayed from the newest checkpoint, it goes NaN again)."""
    from megatron_slmoe.config.errors import ConfigError
    from megatron_slmoe.data.errors import DataError
    from megatron_slmoe.hf.errors import HFCheckpointError
    from megatron_slmoe.lora.adapter import AdapterError
    from megatron_slmoe.model.tower_language import ImageTokenMismatch
    from megatron_slmoe.storage.errors import AccessDeniedError, BucketNotFoundError, \
        ObjectNotFoundError, StorageConfigError

    return (ConfigError, DataError, HFCheckpointError, AdapterError, AccessDeniedError,
            BucketNotFoundError, ObjectNotFoundError, StorageConfigError, ImageTokenMismatch,
            NonFiniteError)


def _is_out_of_memory(err: BaseException) -> bool:
    # CUDA raises torch.OutOfMemoryError; torch_npu a RuntimeError saying so.
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "out of memory" in str(err).lower())
