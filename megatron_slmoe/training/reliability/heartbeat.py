"""Hang detection that no training rank holds: every rank publishes a heartbeat as a small file
in the run's output directory and watches one neighbour's.

A rank whose process stops (SIGSTOP, a frozen node, a dead link) stops publishing; a rank stuck
inside a step keeps publishing but stops finishing steps, and the ranks waiting for it in a
collective stop finishing steps too. Either way, ``--heartbeat-timeout`` seconds after the last
sign the first rank that notices stops the job with one message naming the stuck rank, its node
and the last step it finished: far sooner than the collective timeout, and with a name.
torchrun's restart budget then restarts the job from its newest checkpoint.

Where the state lives: ``<output dir>/attempts/heartbeat/rank_<r>.json``, one file per rank,
replaced whole (written under a temporary name, then renamed) at every finished step and every
``interval`` (a tenth of the timeout, at most 5 s). Not in the job's key-value store: that store
is served by a thread of rank 0 (the launcher turns torchrun's own store off, pytorch#135712), so
a stopped rank 0 took every rank's heartbeat with it and the other ranks' reads blocked in the
store's client, with nothing said. A file is served by the kernel or the file server, whichever
rank stops; the output directory is already shared by every rank of a job (each writes its
checkpoint shards and attempt record there), and ``start_heartbeat`` checks that each rank sees
its neighbour's file. Records carry this attempt's token, so a file left by an earlier attempt
is not read as a live rank. The step in a record is written when the step finishes (by the
training thread), so the step a message names is the last one that rank finished, not the one
its previous heartbeat carried.

Ending the job: each rank's watchdog thread, once it has named the culprits, ends the culprits
that run on its own node with SIGKILL, their whole process group when they lead one (torchrun
starts every worker in a session of its own, its checkpoint writer inside it): a stopped process
cannot act on SIGTERM, and torchrun would wait 30 s before its own SIGKILL. Then it exits
(``HANG_EXIT_CODE``) and its own helpers follow it (``lifeline``). One message is printed per job:
the rank that creates ``reported-<token>`` first prints it.

Cost: per rank, one small file write per step and per interval, and one read of its neighbour's
file per interval; the whole job is read only when something is wrong. Staleness is judged on the
reader's own monotonic clock (when a neighbour's counter last changed), not by comparing clocks
across nodes. Watching starts when this rank has finished its first step (set-up and the first
step are not timed) and ends before the run's final evaluation and adapter save. A node whose
every rank stops (a frozen node) has no local rank left to end them: the other nodes' ranks still
stop the job with the name, and torchrun's or the scheduler's shutdown ends what the node runs.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_slmoe.training.callbacks.base import FINAL, Callback
from megatron_slmoe.training.config import HealthConfig
from megatron_slmoe.training.context import RunContext

HANG_EXIT_CODE = 75
"""Exit code of a rank that stopped the job because a rank made no progress (EX_TEMPFAIL: a
restart may help)."""


@dataclass(frozen=True)
class _Record:
    rank: int
    node: str
    pid: int
    seq: int
    step: int


class Board:
    """The heartbeat files of one attempt in ``directory`` (``token`` tells this attempt's records
    from an earlier one's)."""

    def __init__(self, directory: str, token: str) -> None:
        self.directory, self.token = directory, token
        os.makedirs(directory, exist_ok=True)

    def _path(self, rank: int) -> str:
        return os.path.join(self.directory, f"rank_{rank:05d}.json")

    def publish(self, rank: int, record: dict) -> None:
        """Replace ``rank``'s file whole. No fsync: readers are other processes, not a reboot,
        and an fsync can wait seconds behind a checkpoint's writes."""
        path = self._path(rank)
        tmp = os.path.join(self.directory, f".rank_{rank:05d}.{os.getpid()}.partial")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps({**record, "token": self.token}))
        os.replace(tmp, path)

    def read(self, ranks: list[int]) -> list[Optional[_Record]]:
        """Each rank's record of this attempt (None: none yet, or unreadable)."""
        return [self._read_one(rank) for rank in ranks]

    def _read_one(self, rank: int) -> Optional[_Record]:
        try:
            with open(self._path(rank), encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("token") != self.token:
            return None
        return _Record(rank, data["node"], data["pid"], data["seq"], data["step"])

    def claim_report(self) -> bool:
        """True for the first caller of this attempt (it prints the job's message)."""
        try:
            os.close(os.open(os.path.join(self.directory, f"reported-{self.token}"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return True
        except FileExistsError:
            return False
        except OSError:
            return True  # the directory is the problem: better two messages than none

    def forget_earlier_reports(self) -> None:
        for path in glob.glob(os.path.join(self.directory, "reported-*")):
            if not path.endswith(self.token):
                try:
                    os.remove(path)
                except OSError:
                    pass


class Heartbeat:
    """One rank's publisher and watchdog (see the module doc). ``on_stop(message)`` runs before
    this process exits because of a hang (``message`` is None on the ranks that did not report
    it)."""

    def __init__(self, timeout_s: float, board: Board, rank: int, world_size: int, node: str,
                 on_stop: Optional[Callable[[Optional[str]], None]] = None,
                 interval_s: Optional[float] = None) -> None:
        self.timeout_s = float(timeout_s)
        self.interval_s = interval_s or heartbeat_interval(self.timeout_s)
        self.board, self.rank, self.world_size, self.node = board, rank, world_size, node
        self.neighbour = (rank + 1) % world_size
        self.on_stop = on_stop
        self._step = 0
        self._progress_at: Optional[float] = None  # monotonic time of the last finished step
        self._seq = 0
        self._publishing = threading.Lock()  # the training thread and the heartbeat thread
        self._neighbour_seq, self._neighbour_changed_at = -1, time.monotonic()
        self._published_at = time.monotonic()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- the training thread's side --------------------------------------------------------------

    def start(self) -> None:
        self._publish()
        self._thread = threading.Thread(target=self._loop, name="slmoe-heartbeat", daemon=True)

    def watch(self) -> None:
        """Begin watching (call once every rank has published: ``start_heartbeat`` does)."""
        self._neighbour_changed_at = self._published_at = time.monotonic()
        self._thread.start()

    def progress(self, step: int) -> None:
        """This rank finished ``step`` (published now: a rank stopped right after it is named
        with this step)."""
        self._step = step
        self._progress_at = time.monotonic()
        try:
            self._publish()
        except OSError:
            pass  # the heartbeat thread publishes again within an interval

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=10 * self.interval_s + 5)

    # -- the heartbeat thread --------------------------------------------------------------------

    def _publish(self) -> None:
        with self._publishing:
            self._seq += 1
            self.board.publish(self.rank, {"node": self.node, "pid": os.getpid(),
                                           "seq": self._seq, "step": self._step})
            self._published_at = time.monotonic()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                self._publish()
            except OSError as err:
                if now - self._published_at > self.timeout_s and not self._stop.is_set():
                    self._stop_job(f"rank {self.rank} on node {self.node} could not write its "
                                   f"heartbeat in {self.board.directory} for "
                                   f"{now - self._published_at:.0f} s (--heartbeat-timeout "
                                   f"{self.timeout_s:g} s): {err.strerror or err}", culprits=[])
                continue
            (neighbour,) = self.board.read([self.neighbour])
            if neighbour is not None and neighbour.seq != self._neighbour_seq:
                self._neighbour_seq, self._neighbour_changed_at = neighbour.seq, now
            if self._progress_at is None or self._stop.is_set():
                continue  # not watching before this rank's first step, nor after close()
            if (now - self._neighbour_changed_at > self.timeout_s
                    or now - self._progress_at > self.timeout_s):
                self._stop_job(*self._diagnose(now))

    def _diagnose(self, now: float) -> tuple[str, list[_Record]]:
        """Read every rank twice, a few intervals apart: the ranks whose heartbeat did not move
        are stopped; otherwise the ranks behind the others are stuck; otherwise all are."""
        ranks = list(range(self.world_size))
        first = self.board.read(ranks)
        # This thread is also this rank's publisher: it keeps publishing while it waits, or this
        # rank (and every other rank diagnosing at the same moment) would look stopped.
        deadline = time.monotonic() + 3 * self.interval_s
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(self.interval_s, left))
            try:
                self._publish()
            except OSError:
                pass
        second = self.board.read(ranks)
        stalled_for = now - (self._progress_at or now)
        limit = f"--heartbeat-timeout {self.timeout_s:g}"
        # One read that failed (a file server's hiccup) is no evidence of a stop: both must.
        silent = [(rank, b or a) for rank, a, b in zip(ranks, first, second)
                  if (a is None and b is None) or (a and b and a.seq == b.seq)]
        if silent:
            return ("; ".join(_silent_line(rank, record, limit) for rank, record in silent),
                    [record for _, record in silent if record is not None])
        second = [b or a for a, b in zip(first, second)]
        lowest = min(r.step for r in second)
        behind = [r for r in second if r.step == lowest]
        if len(behind) < len(second):
            ahead = max(r.step for r in second)
            return "; ".join(
                f"rank {r.rank} on node {r.node} (pid {r.pid}) has not finished a step for "
                f"{stalled_for:.0f} s ({limit} s): the last step it finished is {r.step}, the "
                f"other ranks' is {ahead}" for r in behind), behind
        nodes = sorted({r.node for r in second})
        return (f"no rank finished a step for {stalled_for:.0f} s ({limit} s): all "
                f"{self.world_size} ranks (nodes {', '.join(nodes)}) are stuck after step "
                f"{lowest}"), second

    def _stop_job(self, message: str, culprits: list[_Record]) -> None:
        reporter = self.board.claim_report()
        text = f"[heartbeat] {message}; stopping the job"
        if reporter:
            try:
                sys.stderr.write(text + "\n")
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
        if self.on_stop is not None:
            try:
                self.on_stop(text if reporter else None)
            except Exception:  # noqa: BLE001  (stopping matters more than the record)
                pass
        for record in culprits:
            if record.node == self.node and record.pid != os.getpid():
                end_process(record.pid)
        os._exit(HANG_EXIT_CODE)


def _silent_line(rank: int, record: Optional[_Record], limit: str) -> str:
    if record is None:
        return (f"rank {rank} published no heartbeat ({limit} s): it is stopped, frozen or cut "
                f"off")
    return (f"rank {record.rank} on node {record.node} (pid {record.pid}) stopped sending "
            f"heartbeats ({limit} s): it is stopped, frozen or cut off; the last step it "
            f"finished is {record.step}")


def end_process(pid: int) -> None:
    """SIGKILL ``pid``, with its process group when it leads one (a stopped process cannot act
    on SIGTERM; its children, e.g. a checkpoint writer, may be stopped with it)."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def heartbeat_interval(timeout_s: float) -> float:
    return min(max(timeout_s / 10, 0.05), 5.0)


def node_name() -> str:
    return socket.gethostname()


def start_heartbeat(timeout_s: float, output_dir: str, device, on_stop=None
                    ) -> Optional[Heartbeat]:
    """The heartbeat of this rank, publishing and watching (collective: every rank calls it);
    None when off (timeout 0) or alone (one rank). ``device``: where this rank's collectives
    run."""
    world_size = torch.distributed.get_world_size()
    if timeout_s <= 0 or world_size == 1:
        return None
    rank = torch.distributed.get_rank()
    token = [uuid.uuid4().hex if rank == 0 else None]
    torch.distributed.broadcast_object_list(token, src=0)  # this attempt's records
    board = Board(os.path.join(output_dir, "attempts", "heartbeat"), token[0])
    if rank == 0:
        board.forget_earlier_reports()
    heartbeat = Heartbeat(timeout_s, board, rank, world_size, node_name(), on_stop=on_stop)
    heartbeat.start()
    torch.distributed.barrier()  # every rank's record exists before anyone reads it
    (neighbour,) = board.read([heartbeat.neighbour])
    unseen = torch.tensor([0 if neighbour is not None else rank + 1], device=device)
    torch.distributed.all_reduce(unseen, op=torch.distributed.ReduceOp.MAX)
    if int(unseen.item()):
        blind = int(unseen.item()) - 1
        if rank == 0:
            sys.stderr.write(f"[heartbeat] off: rank {blind} does not see rank "
                             f"{(blind + 1) % world_size}'s file in {board.directory} (the "
                             f"output directory must be shared by every node)\n")
        return None
    heartbeat.watch()
    return heartbeat


class HangWatch(Callback):
    """The heartbeat (``--heartbeat-timeout``): from the start of the loop to the final
    evaluation, a rank that stops finishing steps stops the job with one line naming it."""

    name = "heartbeat"

    def __init__(self, health: HealthConfig) -> None:
        self.timeout_s = health.heartbeat_timeout
        self.heartbeat = None

    def start(self, ctx: RunContext, record: dict) -> None:
        self.heartbeat = start_heartbeat(
            self.timeout_s, ctx.output_dir, ctx.device,
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
