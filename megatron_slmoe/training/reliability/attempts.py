"""What became of the previous attempt of a run, for the next attempt to say.

Every attempt (a start, a torchrun restart, a rerun in the same output directory) records per rank,
in ``<output>/attempts/<n>/rank_<r>.json``: its node and pid when it starts, and why it ended when
it ends on its own terms (finished, an error, a hang its heartbeat noticed). A rank ended by a
signal (SIGKILL, the OOM killer, torchrun stopping it) writes nothing more: that silence is what
names it. When the next attempt starts, rank 0 reads the previous attempt's records and says
which rank died, when, and what the others saw; the record also goes to metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any, Optional

import torch

from megatron_slmoe.training.callbacks.base import Callback
from megatron_slmoe.training.context import RunContext
from megatron_slmoe.training.reliability.heartbeat import node_name
from megatron_slmoe.utils.atomic import write_json_atomic

KEEP = 3
"""Attempts whose records are kept (the newest)."""


class Attempts:
    """This rank's records of the current attempt, and rank 0's reading of the previous one."""

    def __init__(self, output_dir: str, number: int, previous: Optional[dict[str, Any]]) -> None:
        self.number = number
        self.previous = previous
        self.rank = torch.distributed.get_rank()
        self._path = os.path.join(output_dir, "attempts", str(number), f"rank_{self.rank:05d}.json")
        self._record: dict[str, Any] = {}
        self._ended = False

    def started(self, node: str) -> None:
        self._record = {"rank": self.rank, "node": node, "pid": os.getpid(),
                        "started": time.time()}
        write_json_atomic(self._path, self._record)

    def ended(self, reason: str, step: int) -> None:
        """Why this rank ends (once; later calls are ignored)."""
        if self._ended or not self._record:
            return
        self._ended = True
        write_json_atomic(self._path, {**self._record, "ended": time.time(), "step": step,
                                       "reason": " ".join(str(reason).split())[:300]})


def begin_attempt(output_dir: str) -> Attempts:
    """Number this attempt and read the previous one (collective: rank 0 reads, all learn)."""
    root = os.path.join(output_dir, "attempts")
    answer: list[Any] = [None, None]
    if torch.distributed.get_rank() == 0:
        numbers = sorted(int(n) for n in (os.listdir(root) if os.path.isdir(root) else [])
                         if n.isdigit())
        answer = [numbers[-1] + 1 if numbers else 0,
                  _read(os.path.join(root, str(numbers[-1]))) if numbers else None]
        for old in numbers[:-(KEEP - 1)]:  # with the new one, KEEP remain
            shutil.rmtree(os.path.join(root, str(old)), ignore_errors=True)
    torch.distributed.broadcast_object_list(answer, src=0)
    return Attempts(output_dir, answer[0], answer[1])


def _read(directory: str) -> dict[str, Any]:
    records = []
    for name in sorted(os.listdir(directory)):
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                records.append(json.load(f))
        except (OSError, ValueError):
            continue  # a rank killed while writing its record: as good as silent
    ended = sorted((r for r in records if "ended" in r), key=lambda r: r["ended"])
    return {"attempt": int(os.path.basename(directory)), "ranks": len(records),
            "finished": bool(records) and all(r.get("reason") == "finished" for r in records),
            "silent": [{k: r[k] for k in ("rank", "node", "pid")} for r in records
                       if "ended" not in r],
            "ended": [{k: r[k] for k in ("rank", "node", "pid", "ended", "step", "reason")}
                      for r in ended]}


def _clock(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


def describe(previous: dict[str, Any], most: int = 4) -> str:
    """One line: how the previous attempt ended."""
    failed = [r for r in previous["ended"] if r["reason"] != "finished"]
    parts = []
    first_end = previous["ended"][0]["ended"] if previous["ended"] else None
    for r in previous["silent"][:most]:
        when = f" before {_clock(first_end)}" if first_end else ""
        parts.append(f"rank {r['rank']} on node {r['node']} (pid {r['pid']}) ended without a "
                     f"word{when} (a signal: SIGKILL, the OOM killer, or torchrun stopping it)")
    for r in failed[:most]:
        parts.append(f"rank {r['rank']} on node {r['node']} stopped at {_clock(r['ended'])} "
                     f"after step {r['step']}: {r['reason']}")
    hidden = len(previous["silent"]) + len(failed) - len(parts)
    if hidden > 0:
        parts.append(f"{hidden} more ranks (see {previous['attempt']}/ under attempts/)")
    if not parts:
        return f"attempt {previous['attempt']} finished"
    return f"attempt {previous['attempt']} of this run failed: " + "; ".join(parts)


class AttemptRecord(Callback):
    """This attempt's record under ``<output>/attempts/``; at the start, what became of the
    previous attempt (a log line and a ``restart`` or ``resume`` record in metrics.jsonl). Keep
    it last: "finished" is written once everything else has finished."""

    name = "attempt"

    def __init__(self) -> None:
        self.attempt = None

    def setup(self, ctx: RunContext) -> None:
        self.attempt = begin_attempt(ctx.output_dir)
        # torchrun counts restarts per node, and only the node whose worker failed counts one:
        # a node restarted because another node's agent re-formed the group stays at 0.
        count = torch.tensor([int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))],
                             device=ctx.device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        self.restart_count = int(count.item())
        self.attempt.started(node_name())

    def start(self, ctx: RunContext, record: dict) -> None:
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
