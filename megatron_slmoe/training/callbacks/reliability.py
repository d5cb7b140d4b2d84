"""Staying up on a large job: each attempt's record (who ran where, and why it ended), hang
detection by heartbeat, and stragglers named by their compute time per step
(``training.attempts``, ``training.heartbeat``, ``training.stragglers``)."""

from __future__ import annotations

import os
import time
from typing import Optional

import torch

from megatron_slmoe.training.callbacks.base import FINAL, Callback, RunContext
from megatron_slmoe.training.config import HealthConfig


class AttemptRecord(Callback):
    """This attempt's record under ``<output>/attempts/``; at the start, what became of the
    previous attempt (a log line and a ``restart`` or ``resume`` record in metrics.jsonl). Keep
    it last: "finished" is written once everything else has finished."""

    name = "attempt"

    def __init__(self) -> None:
        self.attempt = None

    def setup(self, ctx: RunContext) -> None:
        from megatron_slmoe.training.attempts import begin_attempt
        from megatron_slmoe.training.heartbeat import node_name

        self.attempt = begin_attempt(ctx.output_dir)
        # torchrun counts restarts per node, and only the node whose worker failed counts one:
        # a node restarted because another node's agent re-formed the group stays at 0.
        count = torch.tensor([int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))],
                             device=ctx.device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        self.restart_count = int(count.item())
        self.attempt.started(node_name())

    def start(self, ctx: RunContext, record: dict) -> None:
        from megatron_slmoe.training.attempts import describe

        previous, resumed_from = self.attempt.previous, record.get("resumed_from")
        if previous is None and not resumed_from:
            return
        restart = self.restart_count
        event = "restart" if restart else "resume"
        where = (f"from {resumed_from} at iteration {ctx.iteration}" if resumed_from
                 else "from the start")
        said = describe(previous) if previous else "no record of an earlier attempt"
        budget = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
        ctx.info(f"[{event}] attempt {self.attempt.number}"
                 f"{f' (torchrun restart {restart} of {budget})' if restart else ''}: {said}; "
                 f"resuming {where}")
        ctx.records.write({"iteration": ctx.iteration, "event": event,
                           "attempt": self.attempt.number, "restart": restart,
                           "resumed_from": resumed_from, "time": time.time(),
                           "previous_attempt": previous})

    def stopped(self, ctx: Optional[RunContext], reason: str, iteration: int) -> None:
        if self.attempt is not None:
            self.attempt.ended(reason, iteration)

    def finish(self, ctx: RunContext, summary: dict) -> None:
        self.attempt.ended("finished", ctx.iteration)


class HangWatch(Callback):
    """The heartbeat (``--heartbeat-timeout``): from the start of the loop to the final
    evaluation, a rank that stops finishing steps stops the job with one line naming it."""

    name = "heartbeat"

    def __init__(self, health: HealthConfig) -> None:
        self.timeout_s = health.heartbeat_timeout
        self.heartbeat = None

    def start(self, ctx: RunContext, record: dict) -> None:
        from megatron_slmoe.training.heartbeat import start_heartbeat

        self.heartbeat = start_heartbeat(
            self.timeout_s,
            on_stop=lambda message: ctx.stop(message or "stopped by another rank's heartbeat"))

    def after_step(self, ctx: RunContext, record: dict) -> None:
        if self.heartbeat:
            self.heartbeat.progress(ctx.iteration)

    def evaluate(self, ctx: RunContext, record: dict, when: str) -> None:
        if when == FINAL:  # what follows (answers, adapter, exports) is not timed
            self.close()

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.close()
            self.heartbeat = None


class StragglerWatch(Callback):
    """Each rank's compute time per step (the step minus its wait at the gradient reduction),
    compared across ranks at each progress line: a rank slower than ``--straggler-threshold``
    times the others' median is named."""

    name = "stragglers"

    def __init__(self, health: HealthConfig, log_interval: int) -> None:
        self.threshold, self.log_interval = health.straggler_threshold, log_interval

    def setup(self, ctx: RunContext) -> None:
        from megatron_slmoe.training.stragglers import start_step_times

        self.step_times = start_step_times(self.threshold, ctx.device)
        config = ctx.transformer_config
        config.finalize_model_grads_func = self.step_times.timed_grad_sync(
            config.finalize_model_grads_func)

    def before_step(self, ctx: RunContext, microbatches: list) -> None:
        self.step_times.step_started()

    def after_step(self, ctx: RunContext, record: dict) -> None:
        from megatron_slmoe.training.stragglers import describe

        self.step_times.step_finished(record["step_s"])
        if not (ctx.iteration % self.log_interval == 0 or ctx.iteration == ctx.train_iters):
            return
        compared = self.step_times.compare()
        if compared is None:
            return
        record["step_time"] = compared
        for line in describe(compared):
            ctx.info(line)
