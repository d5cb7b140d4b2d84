"""Stragglers: ranks that are consistently slower than the others.

In a synchronous step every rank's wall time is the same: the fast ranks wait for the slow one
inside the collectives. What differs is how much of the step a rank spends computing rather than
waiting, so each rank times its step and, inside it, its wait at the gradient reduction (Megatron's
``finalize_model_grads``, the first point where data-parallel ranks meet): compute time = step
time - that wait. A rank whose compute time per step is more than ``--straggler-threshold`` times
the other ranks' median, in more than half of the steps of a log interval, is named in the log
and in metrics.jsonl.

With tensor or expert parallelism the ranks also meet inside each layer, so part of the waiting
happens there and the measure understates a straggler (it never names a rank that is not slow).
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from typing import Any, Optional

import torch

from megatron_slmoe.training.callbacks.base import Callback
from megatron_slmoe.training.config import HealthConfig
from megatron_slmoe.training.context import RunContext
from megatron_slmoe.training.reliability.heartbeat import node_name

log = logging.getLogger(__name__)

PER_RANK_LIMIT = 64
"""Jobs up to this many ranks record every rank's compute time in metrics.jsonl."""


class StepTimes:
    """Per-step compute times of this rank, compared across ranks at each log interval."""

    def __init__(self, threshold: float, device: torch.device, nodes: list[str]) -> None:
        self.threshold = threshold
        self.device = device
        self.nodes = nodes  # node name by global rank
        self._busy: list[float] = []
        self._wait = 0.0

    def timed_grad_sync(self, finalize_model_grads):
        """``finalize_model_grads`` that adds its duration to this step's wait."""

        @functools.wraps(finalize_model_grads)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return finalize_model_grads(*args, **kwargs)
            finally:
                self._wait += time.perf_counter() - start

        return timed

    def step_started(self) -> None:
        self._wait = 0.0

    def step_finished(self, step_s: float) -> None:
        """The step took ``step_s`` seconds of wall time, its wait at the reduction included."""
        self._busy.append(max(step_s - self._wait, 0.0))

    def compare(self) -> Optional[dict[str, Any]]:
        """Gather the interval's compute times of every rank (collective), name the stragglers,
        and start a new interval. The record for metrics.jsonl, or None with nothing to compare."""
        world = torch.distributed.get_world_size()
        steps = len(self._busy)
        if world == 1 or steps == 0:
            self._busy = []
            return None
        mine = torch.tensor(self._busy, dtype=torch.float64, device=self.device)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        torch.distributed.all_gather(gathered, mine)
        self._busy = []
        busy = [t.tolist() for t in gathered]  # [rank][step]
        means = [sum(b) / steps for b in busy]
        ratios = []
        for rank in range(world):
            per_step = [busy[rank][i] / max(statistics.median(
                busy[other][i] for other in range(world) if other != rank), 1e-9)
                for i in range(steps)]
            ratios.append(per_step)
        record: dict[str, Any] = {
            "steps": steps,
            "compute_s_min": min(means), "compute_s_median": statistics.median(means),
            "compute_s_max": max(means), "slowest_rank": max(range(world), key=means.__getitem__),
            "stragglers": [],
        }
        if world <= PER_RANK_LIMIT:
            record["compute_s_by_rank"] = means
        if self.threshold:
            for rank, per_step in enumerate(ratios):
                slow_steps = sum(r > self.threshold for r in per_step)
                if slow_steps * 2 > steps:
                    record["stragglers"].append({
                        "rank": rank, "node": self.nodes[rank], "compute_s": means[rank],
                        "ratio": statistics.median(per_step), "slow_steps": slow_steps})
        return record


def start_step_times(threshold: float, device: torch.device) -> StepTimes:
    """Collective: learns every rank's node once."""
    nodes = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(nodes, node_name())
    return StepTimes(threshold, device, nodes)


def describe(record: dict[str, Any]) -> list[str]:
    """Log lines for the stragglers of a ``compare`` record."""
    return [f"[straggler] rank {s['rank']} on node {s['node']}: {s['compute_s']:.3f} s of compute "
            f"per step, {s['ratio']:.2f}x the other ranks' median, slow in {s['slow_steps']} of "
            f"the last {record['steps']} steps" for s in record["stragglers"]]


class StragglerWatch(Callback):
    """Each rank's compute time per step (the step minus its wait at the gradient reduction),
    compared across ranks at each progress line: a rank slower than ``--straggler-threshold``
    times the others' median is named."""

    name = "stragglers"

    def __init__(self, health: HealthConfig, log_interval: int) -> None:
        self.threshold, self.log_interval = health.straggler_threshold, log_interval

    def setup(self, ctx: RunContext) -> None:
        self.step_times = start_step_times(self.threshold, ctx.device)
        config = ctx.transformer_config
        config.finalize_model_grads_func = self.step_times.timed_grad_sync(
            config.finalize_model_grads_func)

    def before_step(self, ctx: RunContext, microbatches: list) -> None:
        self.step_times.step_started()

    def after_step(self, ctx: RunContext, record: dict) -> None:
        self.step_times.step_finished(record["step_s"])
        if not (ctx.iteration % self.log_interval == 0 or ctx.iteration == ctx.train_iters):
            return
        compared = self.step_times.compare()
        if compared is None:
            return
        record["step_time"] = compared
        for line in describe(compared):
            ctx.info(line)
