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
import time
from functools import partial
from typing import Callable, Optional

import torch
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.strategies.async_utils import (
    AsyncCallsQueue,
    PersistentAsyncCaller,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.api import CheckpointException

from megatron_slmoe.training import checkpointing

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
        if self.async_save:
            self._queue = AsyncCallsQueue(persistent=self.persistent_worker)
            if self.persistent_worker:
                self._queue.persistent_caller = _start_persistent_worker()
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
        self._queue.close(abort=abort)
        self._queue = None

    def _finalize(self, blocking: bool) -> None:
        try:
            self._queue.maybe_finalize_async_calls(blocking=blocking)
        except (CheckpointingException, CheckpointException) as err:  # on every rank alike
            log.warning("a checkpoint could not be written (%s); the newest complete one stays "
                        "the newest", " ".join(str(err).split())[:300])


def _serve_write_results() -> None:
    """Start the queue that Megatron's shard writers send their results to, served by a forked
    manager process that ends with this trainer (no second import, no orphan)."""
    from multiprocessing.managers import SyncManager

    from megatron_slmoe.compat.megatron import (
        set_write_results_queue,
        write_results_queue,
    )
    from megatron_slmoe.training.lifeline import exit_with_parent

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
    """The persistent worker's process: Megatron's loop, ended with the trainer that spawned it."""
    from megatron_slmoe.training.lifeline import exit_with_parent

    exit_with_parent(f"checkpoint writer of rank {rank}")
    PersistentAsyncCaller.async_loop(rank, *args)
