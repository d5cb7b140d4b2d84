"""Hang detection: every rank publishes a heartbeat to the job's key-value store and watches one
neighbour's.

A rank whose process stops (SIGSTOP, a frozen node, a dead link) stops publishing; a rank stuck
inside a step keeps publishing but stops finishing steps, and the ranks waiting for it in a
collective stop finishing steps too. Either way, ``--heartbeat-timeout`` seconds after the last
sign the first rank that notices stops the job with one message naming the stuck rank, its node
and the last step it finished: far sooner than the collective timeout, and with a name.
torchrun's restart budget then restarts the job from its newest checkpoint.

Cost: a background thread per rank writes one small record every ``interval`` (a tenth of the
timeout, at most 5 s) and reads one neighbour's (rank r watches r+1), so the store's load grows
linearly with the ranks; the whole job is read only when something is wrong. Staleness is judged
on the reader's own monotonic clock (when a neighbour's counter last changed), not by comparing
clocks across nodes. Watching starts when this rank has finished its first step (set-up and the
first step are not timed) and ends before the run's final evaluation and adapter save.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch

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

    @classmethod
    def parse(cls, rank: int, raw: bytes) -> "_Record":
        data = json.loads(raw)
        return cls(rank, data["node"], data["pid"], data["seq"], data["step"])


class Heartbeat:
    """One rank's publisher and watchdog (see the module doc). ``on_stop(message)`` runs before
    this process exits because of a hang (``message`` is None on the ranks that did not report
    it)."""

    def __init__(self, timeout_s: float, store, rank: int, world_size: int, node: str,
                 on_stop: Optional[Callable[[Optional[str]], None]] = None,
                 interval_s: Optional[float] = None) -> None:
        self.timeout_s = float(timeout_s)
        self.interval_s = interval_s or min(max(self.timeout_s / 10, 0.05), 5.0)
        self.store, self.rank, self.world_size, self.node = store, rank, world_size, node
        self.neighbour = (rank + 1) % world_size
        self.on_stop = on_stop
        self._step = 0
        self._progress_at: Optional[float] = None  # monotonic time of the last finished step
        self._seq = 0
        self._neighbour_seq, self._neighbour_changed_at = -1, time.monotonic()
        self._store_ok_at = time.monotonic()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- the training thread's side --------------------------------------------------------------

    def start(self) -> None:
        self._publish()
        self._thread = threading.Thread(target=self._loop, name="slmoe-heartbeat", daemon=True)

    def watch(self) -> None:
        """Begin watching (call once every rank has published: ``start_heartbeat`` does)."""
        self._neighbour_changed_at = self._store_ok_at = time.monotonic()
        self._thread.start()

    def progress(self, step: int) -> None:
        """This rank finished ``step``."""
        self._step = step
        self._progress_at = time.monotonic()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=10 * self.interval_s + 5)

    # -- the heartbeat thread --------------------------------------------------------------------

    def _publish(self) -> None:
        self._seq += 1
        self.store.set(f"rank/{self.rank}", json.dumps(
            {"node": self.node, "pid": os.getpid(), "seq": self._seq, "step": self._step}))

    def _read(self, ranks: list[int]) -> list[_Record]:
        raw = self.store.multi_get([f"rank/{r}" for r in ranks])
        return [_Record.parse(r, value) for r, value in zip(ranks, raw)]

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                self._publish()
                (neighbour,) = self._read([self.neighbour])
            except Exception:  # noqa: BLE001  (the store's host does not answer)
                if now - self._store_ok_at > self.timeout_s and not self._stop.is_set():
                    self._stop_job(self._store_silent_message(now), culprits=[])
                continue
            self._store_ok_at = now
            if neighbour.seq != self._neighbour_seq:
                self._neighbour_seq, self._neighbour_changed_at = neighbour.seq, now
            if self._progress_at is None or self._stop.is_set():
                continue  # not watching before this rank's first step, nor after close()
            if (now - self._neighbour_changed_at > self.timeout_s
                    or now - self._progress_at > self.timeout_s):
                try:
                    message, culprits = self._diagnose(now)
                except Exception:  # noqa: BLE001  (the store stopped answering meanwhile)
                    message, culprits = self._store_silent_message(time.monotonic()), []
                self._stop_job(message, culprits)

    def _diagnose(self, now: float) -> tuple[str, list[_Record]]:
        """Read every rank twice, a few intervals apart: the ranks whose heartbeat did not move
        are stopped; otherwise the ranks behind the others are stuck; otherwise all are."""
        ranks = list(range(self.world_size))
        first = self._read(ranks)
        # This thread is also this rank's publisher: it keeps publishing while it waits, or this
        # rank (and every other rank diagnosing at the same moment) would look stopped.
        deadline = time.monotonic() + 3 * self.interval_s
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(self.interval_s, left))
            self._publish()
        second = self._read(ranks)
        stalled_for = now - self._progress_at
        limit = f"--heartbeat-timeout {self.timeout_s:g}"
        silent = [b for a, b in zip(first, second) if a.seq == b.seq]
        if silent:
            return "; ".join(
                f"rank {r.rank} on node {r.node} (pid {r.pid}) stopped sending heartbeats "
                f"({limit} s): it is stopped, frozen or cut off; the last step it finished is "
                f"{r.step}" for r in silent), silent
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

    def _store_silent_message(self, now: float) -> str:
        host = "rank 0, which holds the job's key-value store"
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            host = (f"the job's key-value store at {os.environ.get('MASTER_ADDR')}:"
                    f"{os.environ.get('MASTER_PORT')}")
        return (f"{host} has not answered for {now - self._store_ok_at:.0f} s "
                f"(--heartbeat-timeout {self.timeout_s:g} s): it is stopped, frozen or cut off")

    def _stop_job(self, message: str, culprits: list[_Record]) -> None:
        try:
            reporter = int(self.store.add("reported", 1)) == 1
        except Exception:  # noqa: BLE001
            reporter = True
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
        # A stopped process ignores SIGTERM, so torchrun would wait for it: end the stuck ranks
        # of this node now (other nodes' watchers do the same for theirs).
        for record in culprits:
            if record.node == self.node and record.pid != os.getpid():
                try:
                    os.kill(record.pid, signal.SIGKILL)
                except OSError:
                    pass
        os._exit(HANG_EXIT_CODE)


def node_name() -> str:
    return socket.gethostname()


def _job_store(op_timeout_s: float):
    """A client of the job's key-value store of its own (the training thread's client is never
    blocked by a heartbeat read)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        return torch.distributed.TCPStore(addr, int(port), is_master=False,
                                          timeout=timedelta(seconds=op_timeout_s),
                                          wait_for_workers=False)
    from megatron_slmoe.compat.torch import default_store

    return default_store()


def start_heartbeat(timeout_s: float, on_stop=None) -> Optional[Heartbeat]:
    """The heartbeat of this rank, publishing and watching (collective: every rank calls it);
    None when off (timeout 0) or alone (one rank)."""
    world_size = torch.distributed.get_world_size()
    if timeout_s <= 0 or world_size == 1:
        return None
    token = [uuid.uuid4().hex if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(token, src=0)  # this run's keys, apart from others'
    interval = min(max(timeout_s / 10, 0.05), 5.0)
    store = torch.distributed.PrefixStore(f"slmoe/heartbeat/{token[0]}/",
                                          _job_store(max(2 * interval, 1.0)))
    heartbeat = Heartbeat(timeout_s, store, torch.distributed.get_rank(), world_size, node_name(),
                          on_stop=on_stop, interval_s=interval)
    heartbeat.start()
    torch.distributed.barrier()  # every rank's record exists before anyone reads it
    heartbeat.watch()
    return heartbeat
