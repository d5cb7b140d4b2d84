"""Checkpoints written while training goes on, with Megatron-Core's asynchronous dist-checkpoint
save (``AsyncCallsQueue``), as Megatron-LM's training loop uses it.

``CheckpointWriter.save`` does the collective part of a checkpoint while the loop waits (staging,
planning, the small files: ``checkpointing.stage_checkpoint``) and hands the shard writing to a
background process: a fork of the trainer per save (Megatron's ``TemporalAsyncCaller``; the fork's
copy-on-write memory is the snapshot), or with ``--use-persistent-ckpt-worker`` one long-lived
process per rank started at set-up (``PersistentAsyncCaller``). The loop calls ``poll`` every step;
once every rank's writer is done, the checkpoint's finalize step runs on all ranks and promotes
it (manifest, rename, ``latest``). At most one checkpoint is in flight: a new save first waits for
the previous one. ``blocked_s_by_save`` is the time the loop waited for each checkpoint (in
``save``, then in the ``poll``/``close`` that finalized it).

A writer process ends with its trainer (``lifeline``), so a killed rank leaves no writer behind;
so does the process that serves the queue Megatron's shard writers report to (Megatron would spawn
it on first use, and a spawned one outlives a killed trainer).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from functools import partial
from multiprocessing.connection import wait
from typing import Callable, Optional

import torch
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.strategies.async_utils import (
    AsyncCallsQueue,
    PersistentAsyncCaller,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.api import CheckpointException

from megatron_slmoe.compat.megatron import set_write_results_queue, write_results_queue
from megatron_slmoe.platform import apply_adaptor
from megatron_slmoe.platform.patching import PatchRegistry
from megatron_slmoe.training import checkpointing
from megatron_slmoe.training.reliability.lifeline import exit_with_parent

log = logging.getLogger(__name__)


class CheckpointWriter:
    """``before_promote()`` and ``after_promote(path)`` run on this rank around a checkpoint's
    promotion (--output-url: finish the previous upload before pruning may remove what it reads,
    then upload the new checkpoint); neither may start a collective."""

    def __init__(self, async_save: bool, persistent_worker: bool = False,
                 before_promote: Optional[Callable[[], None]] = None,
                 after_promote: Optional[Callable[[str], None]] = None) -> None:
        _serve_write_results()
        self.before_promote, self.after_promote = before_promote, after_promote
        self.async_save = async_save
        self.persistent_worker = persistent_worker and async_save
        self.blocked_s_by_save: list[float] = []
        self._queue = None
        self._writer_watch: Optional[WriterWatch] = None
        if self.async_save:
            self._queue = AsyncCallsQueue(persistent=self.persistent_worker)
            if self.persistent_worker:
                self._queue.persistent_caller = _start_persistent_worker()
                self._writer_watch = WriterWatch(self._queue.persistent_caller.process,
                                                 torch.distributed.get_rank())
            # One strategy for the whole run: Megatron caches the save plan between checkpoints
            # of the same structure.
            self._strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)

    def save(self, root: str, iteration: int, model_chunks, optimizer, trainer_state: dict,
             keep_last: int) -> None:
        """Checkpoint ``iteration`` (collective). Returns once the shards are being written."""
        start = time.perf_counter()
        if not self.async_save:
            if self.before_promote:
                self.before_promote()
            path = checkpointing.save_checkpoint(root, iteration, model_chunks, optimizer,
                                                 trainer_state, keep_last)
            if self.after_promote:
                self.after_promote(path)
        else:
            self._finalize(blocking=True)
            request = checkpointing.stage_checkpoint(
                root, iteration, model_chunks, optimizer, trainer_state, keep_last,
                strategy=self._strategy, snapshot_host_tensors=self.persistent_worker)
            if self.before_promote:  # the finalize steps run in order: this one before promotion
                request.finalize_fns.insert(0, self.before_promote)
            if self.after_promote:
                request.add_finalize_fn(partial(self.after_promote,
                                                checkpointing.checkpoint_path(root, iteration)))
            self._queue.schedule_async_request(request)
        self.blocked_s_by_save.append(time.perf_counter() - start)

    def poll(self) -> None:
        """Promote the checkpoint in flight if every rank has written it (collective, cheap;
        call it every step)."""
        if self._queue is not None and self._queue.get_num_unfinalized_calls():
            start = time.perf_counter()
            self._finalize(blocking=False)
            self.blocked_s_by_save[-1] += time.perf_counter() - start

    def close(self, abort: bool = False) -> None:
        """Wait for the checkpoint in flight and stop the writer (``abort``: stop at once, on the
        way out of a failed run; what was in flight stays a ``.tmp``)."""
        if self._queue is None:
            return
        if not abort:
            start = time.perf_counter()
            self._finalize(blocking=True)
            if self.blocked_s_by_save:
                self.blocked_s_by_save[-1] += time.perf_counter() - start
        if self._writer_watch is not None:
            self._writer_watch.closing()
        self._queue.close(abort=abort)
        self._queue = None

    def _finalize(self, blocking: bool) -> None:
        try:
            self._queue.maybe_finalize_async_calls(blocking=blocking)
        except (CheckpointingException, CheckpointException) as err:  # on every rank alike
            log.warning("a checkpoint could not be written (%s); the newest complete one stays "
                        "the newest", " ".join(str(err).split())[:300])


class WriterWatch:
    """Ends this rank when its persistent writer ends before ``closing()``: Megatron's trainer
    side waits for the writer without a timeout (``preload_q.join()``, the completion queue), so
    a writer that died (killed, out of memory, an error at its start) would hold the loop for
    ever. The rank exits (``WRITER_DIED_EXIT_CODE``) with one line; torchrun restarts the job from
    the newest complete checkpoint. ``on_death(line)`` replaces the exit (tests)."""

    def __init__(self, process, rank: int,
                 on_death: Optional[Callable[[str], None]] = None) -> None:
        self._closing = threading.Event()
        self._on_death = on_death or _exit_for_writer
        self._process, self._rank = process, rank
        threading.Thread(target=self._watch, name="slmoe-writer-watch", daemon=True).start()

    def closing(self) -> None:
        """The writer is being stopped on purpose from now on."""
        self._closing.set()

    def _watch(self) -> None:
        wait([self._process.sentinel])
        if self._closing.is_set():
            return
        self._process.join(timeout=1)
        code = self._process.exitcode
        how = (f"killed by signal {-code}" if code is not None and code < 0
               else f"exit code {code}")
        self._on_death(f"[checkpoint] rank {self._rank}: its checkpoint writer (pid "
                       f"{self._process.pid}) ended ({how}) while the run still needed it; the "
                       f"rank stops (the newest complete checkpoint is intact)")


WRITER_DIED_EXIT_CODE = 1


def _exit_for_writer(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(WRITER_DIED_EXIT_CODE)


def _serve_write_results() -> None:
    """Start the queue that Megatron's shard writers send their results to, served by a forked
    manager process that ends with this trainer (no second import, no orphan)."""
    from multiprocessing.managers import SyncManager

    if write_results_queue() is not None:
        return  # already served
    manager = SyncManager(ctx=torch.multiprocessing.get_context("fork"))
    manager.start(initializer=exit_with_parent,
                  initargs=(f"checkpoint results queue of rank {torch.distributed.get_rank()}",))
    set_write_results_queue(manager.Queue())
    _MANAGERS.append(manager)  # kept alive with the process


_MANAGERS: list = []


def _start_persistent_worker() -> PersistentAsyncCaller:
    """Megatron's persistent checkpoint worker, started now (its imports overlap set-up) and
    running ``checkpoint_worker_loop`` so that it ends with its trainer."""
    caller = PersistentAsyncCaller()
    context = torch.multiprocessing.get_context("spawn")
    caller.process = context.Process(
        target=checkpoint_worker_loop,
        args=(torch.distributed.get_rank(), caller.queue, caller.preload_q, caller.comp_q,
              logging.getLogger(PersistentAsyncCaller.__module__).getEffectiveLevel()))
    caller.process.start()
    return caller


def checkpoint_worker_loop(rank: int, *args) -> None:
    """The persistent worker's process: Megatron's loop, ended with the trainer that spawned it.

    A spawned process starts bare: it adapts Megatron-Core to the platform as the trainer did.
    Megatron's loop first pins itself to device ``rank % torch.cuda.device_count()``, a division
    by zero where no CUDA device is visible (the CPU): the writer died there before its first
    request and the trainer waited for it forever. Here the writer counts one device (the
    adaptor's ``set_device`` does nothing on the CPU)."""

    exit_with_parent(f"checkpoint writer of rank {rank}")
    apply_adaptor()
    if torch.cuda.device_count() == 0:
        registry = PatchRegistry()
        registry.register("torch.cuda.device_count", lambda: 1,
                          "the persistent writer pins itself to rank % device_count()")
        registry.apply()
    PersistentAsyncCaller.async_loop(rank, *args)
