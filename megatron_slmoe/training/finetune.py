"""LoRA fine-tuning of a Stable Latent MoE model on Megatron-Core (the main training entry point).

    torchrun --nproc-per-node 2 -m megatron_slmoe.training.finetune --expert-model-parallel-size 2 ...

Megatron-Core does the work: parallel_state, GPTModel with our MoE layers, DDP and the
(distributed) optimizer over the trainable parameters only, the pipeline schedules, dist
checkpointing. This module wires them together: arguments, base weights, LoRA, data, the loop,
evaluation, logging, checkpoints with automatic resume, the adapter and a summary. Inputs may be
read from object storage (``s3://``, ``msc://``) and outputs mirrored to it (``--output-url``;
megatron_slmoe.storage).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from functools import partial
from typing import Optional

import torch

from megatron_slmoe.utils.atomic import write_json_atomic, write_text_atomic
from megatron_slmoe.utils.redact import redact_mapping

log = logging.getLogger("megatron_slmoe.training")


def parse(argv: Optional[list[str]] = None):
    """The entry point's command line (flags and ``--config`` YAML) -> ``CommandLine``; raises
    ConfigError. The layout rules are checked against $WORLD_SIZE unless only printing."""
    from megatron_slmoe.training.cli import parse_command_line
    from megatron_slmoe.training.config import validate_run

    command = parse_command_line(argv, prog="megatron_slmoe.training.finetune",
                                 description=__doc__.strip().split("\n")[0], world_size=0)
    if not command.print_config:
        validate_run(command.run, int(os.environ.get("WORLD_SIZE", "1")))
    return command


EXIT_NOTHING_TO_DO = 3
"""``--validate-only``'s exit code when the run in --output-dir has already finished (the launcher
then starts nothing)."""


def main(argv: Optional[list[str]] = None) -> int:
    from megatron_slmoe.training.cli import to_yaml
    from megatron_slmoe.config.errors import ConfigError
    from megatron_slmoe.training.inputs import RunFinished, check_inputs

    os.umask(os.umask(0) | 0o002)  # nothing a run writes is world-writable, whatever the umask
    try:
        command = parse(argv)
        if command.print_config:
            print(to_yaml(command.run), end="")
            return 0
        from megatron_slmoe.platform import PlatformError, apply_adaptor

        try:
            platform = apply_adaptor()
        except PlatformError as err:  # no such device here: the user's setting
            raise ConfigError(str(err)) from None
        check_inputs(command.run, int(os.environ.get("WORLD_SIZE", "1")), platform)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RunFinished as done:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[finetune] {done}")
        return EXIT_NOTHING_TO_DO if command.validate_only else 0
    if command.validate_only:
        return 0
    trainer = Trainer(command.run, platform)
    from megatron_slmoe.training.lifeline import exit_with_parent, on_sigterm, under_torchrun

    if under_torchrun():  # torchrun's workers run in sessions of their own: end with the agent
        exit_with_parent(f"rank {os.environ.get('RANK', '?')}")
        on_sigterm(trainer.terminated)
    # Our progress lines and data summaries from rank 0; everyone's warnings; not Megatron's
    # INFO chatter (it prints whole configs). No credential reaches a log line.
    from megatron_slmoe.utils.redact import install_log_redaction

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    install_log_redaction()
    if int(os.environ.get("RANK", "0")) == 0:
        logging.getLogger("megatron_slmoe").setLevel(logging.INFO)
    from megatron_slmoe.storage import StorageError

    try:
        return trainer.run()
    except StorageError as err:  # a store that stayed unusable past its retries: one line
        log.error("error: %s", err)
        return 1


class Trainer:
    """The fine-tuning loop. It is the one place that sees the whole run configuration; every
    component it builds receives its own section."""

    def __init__(self, run, platform) -> None:
        self.run_config, self.platform = run, platform

    # -- set-up ----------------------------------------------------------------------------------

    def setup(self) -> None:
        from megatron.core import parallel_state

        from megatron_slmoe.moe.monitor import RoutingMonitor
        from megatron_slmoe.storage import Storage
        from megatron_slmoe.training import model_setup
        from megatron_slmoe.training.data_sources import build_sources

        run = self.run_config
        # Tear down at the end only what this trainer sets up (a test's rank pool keeps its own).
        self._owns_process_group = not torch.distributed.is_initialized()
        self._owns_model_parallel = not parallel_state.model_parallel_is_initialized()
        model_setup.init_distributed(run.parallel, run.schedule.seed, self.platform)
        self.rank = torch.distributed.get_rank()
        run = self.run_config = self._resolve(run)
        self.storage = Storage(run.storage)
        # Rank 0 copies checkpoints, adapter and summary to --output-url (None without one).
        self.mirror = self.storage.output_mirror(run.output.output_url, run.output.keep_last) \
            if self.rank == 0 else None
        self.output_dir = run.output.output_dir
        model_config, hf = model_setup.open_model(run.model)  # checked before start-up
        self.model_config = model_setup.model_config_for_run(
            model_config, run.moe, run.model.finetune_mode,
            run.parallel.distributed_timeout_minutes)
        self.bf16 = run.model.precision == "bf16"
        self.task = None
        if run.data.task == "image-text":
            from megatron_slmoe.training.image_text import ImageTextTask

            self.task = ImageTextTask(run)
        loads_weights = bool(run.model.base_checkpoint or run.model.hf_checkpoint)
        model, self.config = model_setup.build_model(
            self.model_config, run.parallel, self.bf16, self.platform,
            initialize=not loads_weights,
            **({"build": self.task.build_model} if self.task else {}))
        # A stored --base-checkpoint is read from the node's copy (config.yaml keeps the URL).
        local_base = run.replace("model", base_checkpoint=self.storage.local_dir(
            run.model.base_checkpoint)).model if run.model.base_checkpoint else run.model
        model_setup.load_base_weights(model, local_base, hf)
        if self.task:
            self.task.load_vision_tower(model)
        self.lora_config = None
        if run.model.finetune_mode == "lora":
            self._inject_lora(model)
        self.model = model
        self.ddp, self.optimizer, self.scheduler = model_setup.wrap_and_optimize(
            model, self.config, run.optimizer, run.schedule, run.parallel.use_distributed_optimizer,
            self.bf16)
        self.monitor = RoutingMonitor([model], run.monitor)
        self._setup_reliability()

        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        if self.task:
            self.train, self.valid, self.tokenizer = self.task.datasets(self.model_config,
                                                                        self.output_dir)
        else:
            self.train, self.valid, self.tokenizer = build_sources(run.data, run.schedule,
                                                                   self.output_dir, self.storage)
        self._num_microbatches = run.schedule.global_batch_size // (
            run.schedule.micro_batch_size * self.dp_size)
        from megatron_slmoe.training.quality import RunQuality

        self.quality = RunQuality(run, model, self.tokenizer, self.valid, self.dp_rank,
                                  self.dp_size, self._forward_only,
                                  probe=self._microbatches(self.valid, 0))
        self.writer = None
        if self.rank == 0:
            from megatron_slmoe.training.cli import to_yaml

            write_text_atomic(os.path.join(self.output_dir, "config.yaml"), to_yaml(run))
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            parallel = run.parallel
            log.info("[finetune] platform=%s backend=%s world=%d tp=%d pp=%d ep=%d dp=%d "
                     "mode=%s trainable=%s output=%s", self.platform.name, self.platform.backend,
                     torch.distributed.get_world_size(), parallel.tensor_model_parallel_size,
                     parallel.pipeline_model_parallel_size, parallel.expert_model_parallel_size,
                     self.dp_size, run.model.finetune_mode, f"{trainable:,}", self.output_dir)

    def _setup_reliability(self) -> None:
        """The checkpoint writer (asynchronous by default), per-rank step times for straggler
        detection, and this attempt's record (see training.attempts)."""
        from megatron_slmoe.training.async_checkpoint import CheckpointWriter
        from megatron_slmoe.training.attempts import begin_attempt
        from megatron_slmoe.training.heartbeat import node_name
        from megatron_slmoe.training.stragglers import start_step_times

        output = self.run_config.output
        mirror = self.mirror  # rank 0 with --output-url: each promoted checkpoint is uploaded
        self.checkpoints = CheckpointWriter(
            output.async_save, output.use_persistent_ckpt_worker,
            before_promote=mirror.wait if mirror else None,
            after_promote=mirror.submit_checkpoint if mirror else None)
        self.step_times = start_step_times(self.run_config.health.straggler_threshold,
                                           self.platform.device())
        self.config.finalize_model_grads_func = self.step_times.timed_grad_sync(
            self.config.finalize_model_grads_func)
        self.attempt = begin_attempt(self.output_dir)
        # torchrun counts restarts per node, and only the node whose worker failed counts one:
        # a node restarted because another node's agent re-formed the group stays at 0.
        count = torch.tensor([int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))],
                             device=self.platform.device())
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        self.restart_count = int(count.item())
        self.attempt.started(node_name())
        self.heartbeat = None

    def _resolve(self, run):
        """The run as it will execute: the output directory (rank 0's choice, so every rank writes
        into the same one), the precision of this platform and, with --hf-checkpoint, its
        tokenizer unless --tokenizer names one. ``config.yaml`` records these, so feeding it back
        repeats the run."""
        output_dir = [run.output.output_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))]
        torch.distributed.broadcast_object_list(output_dir, src=0)
        from megatron_slmoe.training.model_setup import resolve_precision

        run = run.replace("output", output_dir=output_dir[0])
        if run.model.hf_checkpoint and not run.data.tokenizer:
            run = run.replace("data", tokenizer=run.model.hf_checkpoint)
        run = self._adapter_from_peft(run)
        return run.replace("model", precision=resolve_precision(run.model, self.platform))

    def _adapter_from_peft(self, run):
        """--adapter-init with a PEFT adapter of the --hf-checkpoint base: rank 0 converts it into
        ``<output dir>/adapter-init`` (megatron_slmoe.hf.peft_import) and the run takes that
        adapter and its LoRA settings (rank, alpha, targets; recorded in config.yaml)."""
        from megatron_slmoe.hf.peft_import import is_peft_adapter, peft_to_adapter
        from megatron_slmoe.lora.adapter import read_adapter_config

        source = run.model.adapter_init
        if not source or not is_peft_adapter(source):
            return run
        converted, error = os.path.join(run.output.output_dir, "adapter-init"), None
        if torch.distributed.get_rank() == 0:
            try:
                if os.path.isdir(converted):  # a rerun converts afresh
                    import shutil

                    shutil.rmtree(converted)
                peft_to_adapter(source, run.model.hf_checkpoint, converted,
                                dropout=run.lora.dropout)
            except (OSError, ValueError) as err:
                error = f"--adapter-init {source}: {err}"
        status = [error]
        torch.distributed.broadcast_object_list(status, src=0)
        if status[0]:
            raise RuntimeError(status[0])
        lora, _ = read_adapter_config(converted)
        run = run.replace("lora", rank=lora.rank, alpha=lora.alpha, targets=list(lora.targets))
        return run.replace("model", adapter_init=converted)

    def _inject_lora(self, model) -> None:
        from megatron_slmoe.lora.adapter import load_adapter
        from megatron_slmoe.lora.inject import inject_lora

        self.lora_config = self.run_config.lora
        inject_lora([model], self.lora_config)
        if self.run_config.model.adapter_init:
            load_adapter([model], self.storage.local_dir(self.run_config.model.adapter_init))

    # -- one step --------------------------------------------------------------------------------

    def _forward_step(self, data_iterator, model):
        from megatron_slmoe.data.instruction import packed_attention_mask

        if self.task:
            from megatron_slmoe.training.image_text import forward_step

            return forward_step(self.platform.device(), data_iterator, model)
        batch = {k: v.to(self.platform.device()) for k, v in next(data_iterator).items()}
        # Packed instruction rows keep their examples apart (data.instruction); pretraining
        # samples use Megatron's default causal mask.
        mask = packed_attention_mask(batch["segment_ids"]) if "segment_ids" in batch else None
        output = model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
        return output, partial(_masked_mean_loss, batch["loss_mask"])

    def _microbatches(self, dataset, start: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the global batch of samples ``[start, start + GB)``."""
        from megatron_slmoe.data.sampler import collate, micro_batches

        schedule = self.run_config.schedule
        window = range(start, start + schedule.global_batch_size)
        collate_fn = self.task.collate if self.task else collate
        return [collate_fn([dataset[i % len(dataset)] for i in part])
                for part in micro_batches(window, schedule.micro_batch_size, self.dp_rank,
                                          self.dp_size)]

    def _run_schedule(self, microbatches, forward_only: bool) -> float:
        """Mean loss over the global batch (every rank gets it)."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        losses = get_forward_backward_func()(
            forward_step_func=self._forward_step, data_iterator=iter(microbatches),
            model=self.ddp, num_microbatches=len(microbatches),
            seq_length=self.run_config.data.seq_length,
            micro_batch_size=self.run_config.schedule.micro_batch_size, forward_only=forward_only)
        loss = torch.zeros(1, dtype=torch.float64, device=self.platform.device())
        if parallel_state.is_pipeline_last_stage():
            loss += torch.stack([entry["loss"].double() for entry in losses]).mean()
        # The last stage holds the loss: sum over the pipeline, average over data parallelism.
        torch.distributed.all_reduce(loss, group=parallel_state.get_pipeline_model_parallel_group())
        torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        return loss.item() / self.dp_size

    def _forward_only(self, microbatches) -> None:
        self._run_schedule(microbatches, forward_only=True)

    def evaluate(self) -> float:
        self.ddp.eval()
        schedule = self.run_config.schedule
        with torch.no_grad():
            losses = [self._run_schedule(
                self._microbatches(self.valid, i * schedule.global_batch_size), forward_only=True)
                      for i in range(schedule.eval_iters)]
        self.ddp.train()
        return sum(losses) / len(losses)

    def train_step(self, consumed: int) -> tuple[float, Optional[float]]:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        microbatches = self._microbatches(self.train, consumed)
        self.quality.before_step(microbatches)
        loss = self._run_schedule(microbatches, forward_only=False)
        update_ok, grad_norm, _ = self.optimizer.step()
        if update_ok:
            self.scheduler.step(increment=1)
        return loss, grad_norm

    # -- the run ---------------------------------------------------------------------------------

    def run(self) -> int:
        """The whole run. An out-of-memory error is reported with the memory planner's breakdown
        and the next step of the OOM checklist; checkpoints already written stay intact. Every
        way out is recorded for the next attempt (training.attempts)."""
        self.iteration = 0
        try:
            return self._run()
        except BaseException as err:
            if getattr(self, "attempt", None) is not None:
                first_line = (str(err).splitlines() or [""])[0]
                self.attempt.ended(f"{type(err).__name__}: {first_line}", self.iteration)
            if getattr(self, "checkpoints", None) is not None:
                self.checkpoints.close(abort=True)
            if not _is_out_of_memory(err):
                raise
            log.error("[finetune] rank %d: %s", torch.distributed.get_rank(), self._oom_report(err))
            return 1
        finally:
            if getattr(self, "heartbeat", None) is not None:
                self.heartbeat.close()

    def terminated(self) -> None:
        """SIGTERM's last word (training.lifeline): this rank was stopped, it did not fail."""
        if getattr(self, "attempt", None) is not None:
            self.attempt.ended("SIGTERM: stopped (torchrun stops every rank once one fails)",
                               getattr(self, "iteration", 0))

    def _oom_report(self, err: BaseException) -> str:
        from megatron_slmoe.plan.check import format_oom_report
        from megatron_slmoe.training.inputs import memory_check

        check = memory_check(self.run_config, torch.distributed.get_world_size(), self.platform,
                             self.model_config)
        if check is None:
            return f"out of memory: {str(err).splitlines()[0]} (no device memory to plan against)"
        return format_oom_report(check, err)

    def _run(self) -> int:
        from megatron_slmoe.training import checkpointing
        from megatron_slmoe.training.heartbeat import start_heartbeat

        self.setup()
        schedule, output = self.run_config.schedule, self.run_config.output
        ckpt_root = os.path.join(self.output_dir, "checkpoints")
        iteration, consumed, eval_before, accuracy_before = 0, 0, None, None
        resume_from = self._resume_point(ckpt_root) if output.resume else None
        if resume_from:
            state = checkpointing.load_checkpoint(resume_from, [self.model], self.optimizer)
            self._load_schedule(state["scheduler"])
            iteration, consumed = state["iteration"], state["consumed_samples"]
            eval_before = state.get("eval_loss_before")
            accuracy_before = state.get("accuracy_before")
            self._info(f"[finetune] resumed from {resume_from} at iteration {iteration}")
        self.iteration = iteration
        self._open_metrics(iteration, resume_from)
        if eval_before is None:
            eval_before = self.evaluate()
            accuracy_before = self._accuracy("before training")
            self._info(f"[finetune] held-out loss before training: {eval_before:.4f}"
                       + _accuracy_text(accuracy_before))

        tokens_per_step = schedule.global_batch_size * self.run_config.data.seq_length
        self.collapse_warnings = 0
        window_start, window_steps = time.time(), 0
        eval_loss, accuracy = None, None
        self.heartbeat = start_heartbeat(
            self.run_config.health.heartbeat_timeout,
            on_stop=lambda message: self.attempt.ended(
                message or "stopped by another rank's heartbeat", self.iteration))
        while iteration < schedule.train_iters:
            self.step_times.step_started()
            loss, grad_norm = self.train_step(consumed)
            self.step_times.step_finished()
            iteration += 1
            self.iteration = iteration
            if self.heartbeat:
                self.heartbeat.progress(iteration)
            self.checkpoints.poll()
            consumed += schedule.global_batch_size
            window_steps += 1
            routing = self.monitor.step(iteration)
            record = {"iteration": iteration, "loss": loss, "lr": self.scheduler.get_lr(
                self.optimizer.param_groups[0]), "grad_norm": grad_norm,
                "consumed_samples": consumed, "aux_losses": self._aux_losses()}
            last = iteration == schedule.train_iters
            measured_since = time.time()  # evaluation and probes are not training throughput
            for layer, drift in self.quality.drift(iteration, last).items():
                routing["layers"][layer].update(drift)
            if iteration % schedule.eval_interval == 0 or last:
                eval_loss = self.evaluate()
                record["eval_loss"] = eval_loss
                accuracy = self.quality.accuracy()
                if accuracy is not None:
                    record["eval_accuracy"] = accuracy
            window_start += time.time() - measured_since
            if iteration % schedule.log_interval == 0 or last:
                if self.task:
                    record["bad_samples"] = self.task.bad_samples()
                elapsed = time.time() - window_start
                record["tokens_per_s"] = tokens_per_step * window_steps / max(elapsed, 1e-9)
                record["memory_bytes"] = _peak_memory(self.platform)
                eta = elapsed / window_steps * (schedule.train_iters - iteration)
                self._info("[finetune] " + _progress(record, schedule.train_iters, eta))
                self._compare_step_times(record)
                window_start, window_steps = time.time(), 0
            self.collapse_warnings += len(routing["warnings"])
            record["moe"] = self.last_routing = _routing_record(self._gather_routing(routing))
            if self.writer:
                self.writer.write(record)
            if iteration % schedule.save_interval == 0 or last:
                self.checkpoints.save(
                    ckpt_root, iteration, [self.model], self.optimizer,
                    {"consumed_samples": consumed, "scheduler": self.scheduler.state_dict(),
                     "eval_loss_before": eval_before, "accuracy_before": accuracy_before},
                    output.keep_last)
        if self.heartbeat:
            self.heartbeat.close()
        self.checkpoints.close()
        if eval_loss is None:  # resumed at the end: no step ran in this attempt
            eval_loss, accuracy = self.evaluate(), self.quality.accuracy()
        if self.task:  # image-text: answers generated once, at the end
            accuracy = self._accuracy("after training")
        return self._finish(eval_before, eval_loss, iteration, accuracy_before, accuracy)

    def _accuracy(self, when: str) -> Optional[float]:
        """Held-out exact-match accuracy (collective): the image-text task's answers, else the
        instruction conversations' (RunQuality); None without either."""
        return self._answer_accuracy(when) if self.task else self.quality.accuracy()

    def _load_schedule(self, saved: dict) -> None:
        """The learning-rate schedule of a checkpoint, continued under this run's --train-iters
        (a larger one extends the decay)."""
        self.scheduler.load_state_dict(saved)
        before = saved.get("lr_decay_steps")
        if before is not None and before != self.scheduler.lr_decay_steps:
            self._info(f"[finetune] --train-iters {self.scheduler.lr_decay_steps}: the learning "
                       f"rate now decays over {self.scheduler.lr_decay_steps} steps instead of "
                       f"{before} (lr at step {self.scheduler.num_steps}: "
                       f"{self.scheduler.get_lr(self.optimizer.param_groups[0]):.3e})")

    def _open_metrics(self, iteration: int, resume_from: Optional[str]) -> None:
        """metrics.jsonl from ``iteration`` on (a later iteration's records of an earlier attempt
        are dropped), with a record of the restart or resume, and the log line that says what
        became of the previous attempt."""
        self.writer = None
        if self.rank != 0:
            return
        from megatron_slmoe.training.attempts import describe
        from megatron_slmoe.training.metrics import MetricsWriter

        self.writer = MetricsWriter(self.output_dir, tensorboard=self.run_config.output.tensorboard,
                                    start_iteration=iteration)
        previous = self.attempt.previous
        restart = self.restart_count
        if previous is None and not resume_from:
            return
        event = "restart" if restart else "resume"
        where = f"from {resume_from} at iteration {iteration}" if resume_from else "from the start"
        said = describe(previous) if previous else "no record of an earlier attempt"
        budget = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
        self._info(f"[{event}] attempt {self.attempt.number}"
                   f"{f' (torchrun restart {restart} of {budget})' if restart else ''}: {said}; "
                   f"resuming {where}")
        self.writer.write({"iteration": iteration, "event": event, "attempt": self.attempt.number,
                           "restart": restart, "resumed_from": resume_from, "time": time.time(),
                           "previous_attempt": previous})

    def _compare_step_times(self, record: dict) -> None:
        """Every rank's compute time per step over the log interval; stragglers named."""
        from megatron_slmoe.training.stragglers import describe

        compared = self.step_times.compare()
        if compared is None:
            return
        record["step_time"] = compared
        for line in describe(compared):
            self._info(line)

    def _resume_point(self, ckpt_root: str) -> Optional[str]:
        """The newest intact local checkpoint, or with --output-url the newest complete stored one
        when it is newer (rank 0 fetches it into the output directory; every rank gets the
        answer)."""
        from megatron_slmoe.training import checkpointing

        local = checkpointing.find_resumable(ckpt_root)
        if not self.run_config.output.output_url:
            return local
        restored = [None]
        if self.mirror is not None:
            restored[0] = self.mirror.restore_checkpoint(
                ckpt_root, os.path.basename(local) if local else None)
        torch.distributed.broadcast_object_list(restored, src=0)
        return restored[0] or local

    def _answer_accuracy(self, when: str) -> Optional[float]:
        """Held-out exact-match answer accuracy of an image-text run (None otherwise);
        collective."""
        if not self.task:
            return None
        accuracy, answers = self.task.answer_accuracy(
            self.ddp, self.run_config.schedule.micro_batch_size, self.platform.device())
        if accuracy is not None:
            self._info(f"[finetune] held-out answer accuracy {when}: {accuracy:.3f}")
            for prompt, answer, reference in answers[:3]:
                self._info(f"[finetune]   {prompt!r} -> {answer!r} (reference {reference!r})")
            if self.rank == 0:  # every answer, for a closer look (answers_before_training.jsonl)
                write_text_atomic(
                    os.path.join(self.output_dir, f"answers_{when.replace(' ', '_')}.jsonl"),
                    "".join(json.dumps({"prompt": p, "answer": a, "reference": r}) + "\n"
                            for p, a, r in answers))
        return accuracy

    def _export_hf(self, adapter_dir: str) -> None:
        """--export-hf: rank 0 writes the saved adapter as a PEFT adapter of the HF base (no
        collective inside: the adapter file is layout independent); every rank raises its error."""
        from megatron_slmoe.hf.peft_export import export_peft_adapter

        output, error = self.run_config.output, None
        if self.rank == 0:
            try:
                export_peft_adapter(adapter_dir, self.run_config.model.hf_checkpoint,
                                    output.export_hf, layout=output.export_hf_layout)
                self._info(f"[finetune] PEFT adapter: {output.export_hf}")
            except (OSError, ValueError) as err:
                error = f"--export-hf {output.export_hf}: {err}"
        status = [error]
        torch.distributed.broadcast_object_list(status, src=0)
        if status[0]:
            raise RuntimeError(status[0])

    def _finish(self, eval_before: float, eval_after: float, iteration: int,
                accuracy_before: Optional[float], accuracy_after: Optional[float]) -> int:
        bad_samples = self.task.bad_samples() if self.task else None
        adapter_dir = None
        if self.lora_config is not None:
            from megatron_slmoe.lora.adapter import save_adapter

            adapter_dir = os.path.join(self.output_dir, "adapter")
            save_adapter([self.model], adapter_dir, self.lora_config,
                         {"model_config": self.model_config.name,
                          "base_checkpoint": self.run_config.model.base_checkpoint,
                          "hf_checkpoint": self.run_config.model.hf_checkpoint,
                          "tokenizer_sha256": self.tokenizer.fingerprint,
                          "tokenizer_vocab_size": self.tokenizer.vocab_size})
        if self.run_config.output.export_hf:
            self._export_hf(adapter_dir)
        if self.run_config.output.save_base:
            from megatron_slmoe.training.checkpointing import save_base_checkpoint

            model_file = self.run_config.model.config
            save_base_checkpoint(self.model, self.run_config.output.save_base,
                                 self.model_config.name, self.tokenizer,
                                 model_file if model_file and os.path.isfile(model_file) else None)
        if self.rank == 0:
            last_routing = getattr(self, "last_routing", None)
            load = {layer: {k: m[k] for k in ("imbalance", "load_entropy", "dead_experts_window")}
                    for layer, m in (last_routing or {"layers": {}})["layers"].items()}
            dead = sum(m["dead_experts_window"] for m in load.values())
            summary = {"eval_loss_before": eval_before, "eval_loss_after": eval_after,
                       "accuracy_before": accuracy_before, "accuracy_after": accuracy_after,
                       "steps": iteration, "adapter_dir": adapter_dir,
                       "output_dir": self.output_dir,
                       "output_url": self.run_config.output.output_url,
                       "finetune_mode": self.run_config.model.finetune_mode,
                       "expert_load_last_step": load, "collapse_warnings": self.collapse_warnings,
                       "dead_experts_end": dead, "plots": [],
                       "node_cache": self.storage.cache.stats.as_dict()
                       if self.storage.cache_in_use else None,
                       "checkpoint": {"async": self.checkpoints.async_save,
                                      "persistent_worker": self.checkpoints.persistent_worker,
                                      "blocked_s_by_save": self.checkpoints.blocked_s_by_save}}
            if self.task:
                summary.update(task="image-text", bad_samples=bad_samples)
            self.writer.close()  # complete: the pictures read metrics.jsonl and summary.json
            write_json_atomic(os.path.join(self.output_dir, "summary.json"),
                              redact_mapping(summary))
            if self.run_config.output.plots:
                from megatron_slmoe.training.plots import plot_run

                summary["plots"] = plot_run(self.output_dir)
                write_json_atomic(os.path.join(self.output_dir, "summary.json"),
                                  redact_mapping(summary))
            if self.mirror is not None:
                self._upload_outputs(adapter_dir, summary["plots"])
            worst = max((m["imbalance"] for m in load.values()), default=float("nan"))
            self._info(f"[finetune] expert load: worst imbalance (max/mean) {worst:.2f} over "
                       f"{len(load)} MoE layers, {dead} experts without tokens in the last window, "
                       f"{self.collapse_warnings} collapse warnings")
            if adapter_dir:
                self._info(f"[finetune] adapter: {adapter_dir}")
            if self.task:
                self._info(f"[finetune] bad samples skipped: {sum(bad_samples.values())} "
                           f"{bad_samples}")
            self._info(f"[finetune] held-out loss {eval_before:.4f} -> {eval_after:.4f}"
                       + (f"; exact-match accuracy {accuracy_before:.1%} -> {accuracy_after:.1%}"
                          if accuracy_after is not None and accuracy_before is not None else "")
                       + f"; summary in {os.path.join(self.output_dir, 'summary.json')}")
            if summary["plots"]:
                self._info(f"[finetune] pictures: {os.path.dirname(summary['plots'][0])} "
                           f"({', '.join(os.path.basename(p) for p in summary['plots'])})")
        self.attempt.ended("finished", iteration)
        from megatron.core import parallel_state

        if self._owns_model_parallel:
            parallel_state.destroy_model_parallel()
        if self._owns_process_group:
            torch.distributed.destroy_process_group()
        return 0

    def _upload_outputs(self, adapter_dir: Optional[str], plots: list[str]) -> None:
        """The run's outputs to --output-url once its last checkpoint is there (the adapter, its
        --export-hf PEFT form, the pictures); the summary last: its presence on the store means
        the run is complete there."""
        self.mirror.wait()
        if adapter_dir:
            self.mirror.upload_directory(adapter_dir, "adapter")
        if self.run_config.output.export_hf:
            self.mirror.upload_directory(self.run_config.output.export_hf, "export-hf")
        if plots:
            self.mirror.upload_directory(os.path.dirname(plots[0]), "plots")
        for name in ("config.yaml", "metrics.jsonl", "summary.json"):
            self.mirror.upload_file(os.path.join(self.output_dir, name), name)
        self._info(f"[finetune] outputs on the store: {self.run_config.output.output_url}")

    def _aux_losses(self) -> dict[str, float]:
        """The step's load-balancing / z losses from Megatron's aux-loss tracker (summed over
        layers, averaged over micro-batches and data-parallel ranks), then cleared."""
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        if getattr(self, "_aux_names", None) is None:
            # Every rank must reduce the same names in the same order; the set is fixed by the
            # model after its first training step, so agree on it once, not every step.
            names = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(names, sorted(tracker))
            self._aux_names = sorted(set().union(*names))
        result = {}
        for name in self._aux_names:
            if name in tracker:
                values = tracker[name]["values"].detach().clone().double()
            else:  # this stage logged no such loss
                values = torch.zeros(self.config.num_layers, dtype=torch.float64)
            values = values.to(self.platform.device())
            # Stages hold different layers: sum over the pipeline. gloo has no AVG: sum and divide.
            torch.distributed.all_reduce(values, group=parallel_state.get_pipeline_model_parallel_group())
            torch.distributed.all_reduce(values, group=parallel_state.get_data_parallel_group())
            result[name] = values.sum().item() / (self.dp_size * self._num_microbatches)
            if name in tracker:
                tracker[name]["values"].zero_()
        return result

    def _gather_routing(self, routing: dict) -> list[dict]:
        """Every pipeline stage's layers, so rank 0's record covers the whole model."""
        from megatron.core import parallel_state

        group = parallel_state.get_pipeline_model_parallel_group()
        gathered = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(gathered, routing, group=group)
        return gathered

    def _info(self, message: str) -> None:
        if self.rank == 0:
            log.info(message)


def _is_out_of_memory(err: BaseException) -> bool:
    # CUDA raises torch.OutOfMemoryError; torch_npu a RuntimeError saying so.
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "out of memory" in str(err).lower())


def _peak_memory(platform) -> int:
    """Peak accelerator memory; on the CPU, the process's peak resident memory."""
    peak = platform.max_memory_allocated()
    if peak == 0:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return peak


def _masked_mean_loss(loss_mask: torch.Tensor, output: torch.Tensor):
    mask = loss_mask.reshape(-1).float()
    loss = (output.reshape(-1).float() * mask).sum() / mask.sum().clamp_min(1.0)
    # clone: the schedule divides the returned loss in place by the number of micro-batches
    return loss, {"loss": loss.detach().clone()}


def _progress(record: dict, total: int, eta: float) -> str:
    from megatron_slmoe.training.metrics import format_progress

    return format_progress(record["iteration"], total, record["loss"], record["lr"],
                           record["grad_norm"], record["tokens_per_s"], record["memory_bytes"], eta)


def _accuracy_text(accuracy: Optional[float]) -> str:
    return "" if accuracy is None else f", exact-match accuracy {accuracy:.1%}"


def _routing_record(per_stage: list[dict]) -> dict:
    from megatron_slmoe.moe.stability import DRIFT_FIELDS

    layers, warnings = {}, []
    for stage in per_stage:
        warnings += stage["warnings"]
        for number, metrics in stage["layers"].items():
            layers[str(number)] = {k: metrics[k] for k in (
                "tokens_per_expert", "imbalance", "load_entropy", "router_entropy",
                "dead_experts_window", "logit_rms", *DRIFT_FIELDS) if k in metrics}
    return {"layers": layers, "warnings": warnings}


if __name__ == "__main__":
    sys.exit(main())
