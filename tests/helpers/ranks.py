"""Run a function on a few ranks of this machine, each a real process in a gloo (or nccl/hccl) group.

``run_ranks(fn, world_size, tp=..., pp=..., ep=..., **kwargs)`` calls ``fn(**kwargs)`` on every
rank after Megatron's parallel_state is initialised with that layout, and returns the per-rank
results, or fails with the first failing rank's traceback.

The rank processes are kept between calls (one pool per world size): each imports torch,
Megatron-Core and megatron_slmoe and joins the process group once, then runs case after case. A
case starts from a clean slate: parallel_state is rebuilt for its layout, Megatron's aux-loss
tracker is emptied and the RNGs are seeded. A failing or hanging case (a rank raised while the
others wait in a collective) tears the pool down; the next case starts a fresh one.

Set ``SLMOE_TEST_FRESH_RANKS=1`` to spawn new processes for every case instead.
"""

from __future__ import annotations

import atexit
import gc
import os
import queue
import shutil
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_case(layout: dict) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout["tp"],
        pipeline_model_parallel_size=layout["pp"],
        expert_model_parallel_size=layout["ep"],
        expert_tensor_parallel_size=layout["etp"],  # None: Megatron's default (= TP)
        distributed_timeout_minutes=layout["timeout_minutes"],
    )
    torch.manual_seed(layout["seed"])
    model_parallel_cuda_manual_seed(layout["seed"])


def _end_case() -> None:
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler,
        get_moe_layer_wise_logging_tracker,
    )

    parallel_state.destroy_model_parallel()
    get_moe_layer_wise_logging_tracker().clear()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None  # see tests/unit/conftest.py
    _destroy_subgroups()


def _destroy_subgroups() -> None:
    """Free every process group but the pool's own. Megatron's destroy_model_parallel only drops
    its references: torch keeps the groups registered, and each gloo group keeps its network
    threads, so a long-lived rank would gather thousands of them (and their CPU time)."""
    from torch.distributed import distributed_c10d as c10d

    default = c10d._get_default_group()
    for group in list(c10d._world.pg_map):
        if group is not default:
            torch.distributed.destroy_process_group(group)
    gc.collect()


def _serve(rank: int, world_size: int, port: int, tasks, done) -> None:
    """A rank process: join the group once, then run cases until told to stop (None)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    import megatron_slmoe

    platform = megatron_slmoe.PLATFORM
    platform.set_device(rank)
    torch.distributed.init_process_group(platform.backend, rank=rank, world_size=world_size,
                                         timeout=timedelta(seconds=120))
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent:  # the test process died without closing the pool
                break
            continue
        if task is None:
            break
        fn, layout, kwargs, out_dir = task
        try:
            _start_case(layout)
            record = {"ok": True, "result": fn(**kwargs)}
        except BaseException:  # report everything, assertion errors included, to the parent
            record = {"ok": False, "error": traceback.format_exc()}
        try:
            _end_case()
        except BaseException:
            record = record if not record["ok"] else {"ok": False, "error": traceback.format_exc()}
        torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))
        done.put((rank, record["ok"]))
    torch.distributed.destroy_process_group()


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.done = ctx.Queue()
        port = free_port()
        # Not daemons: a case may start processes of its own (Megatron's checkpoint writers).
        # The pool is closed at exit, and a rank process whose parent died stops by itself.
        self.procs = [ctx.Process(target=_serve, args=(r, world_size, port, self.tasks[r],
                                                       self.done))
                      for r in range(world_size)]
        for proc in self.procs:
            proc.start()

    def run(self, fn: Callable, layout: dict, kwargs: dict, timeout: float) -> list[Any]:
        out_dir = tempfile.mkdtemp(prefix="slmoe-ranks-")
        try:
            for task_queue in self.tasks:
                task_queue.put((fn, layout, kwargs, out_dir))
            self._wait(timeout)
            records = []
            for rank in range(self.world_size):
                path = os.path.join(out_dir, f"rank{rank}.pt")
                records.append(torch.load(path, weights_only=False) if os.path.exists(path)
                               else {"ok": False, "error": "no result (stuck in a collective?)"})
            for rank, record in enumerate(records):
                if not record["ok"] and "no result" not in record["error"]:
                    raise RuntimeError(f"rank {rank} failed:\n{record['error']}")
            for rank, record in enumerate(records):
                if not record["ok"]:
                    raise RuntimeError(f"rank {rank}: {record['error']}")
            return [record["result"] for record in records]
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        finished: dict[int, bool] = {}
        while len(finished) < self.world_size:
            try:
                rank, ok = self.done.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} exited (code "
                                       f"{self.procs[dead[0]].exitcode}) without a result")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ranks {sorted(set(range(self.world_size)) - set(finished))}"
                                       f" gave no result within {timeout:g} s")
                continue
            finished[rank] = ok
            if not ok:
                # The others may be waiting in a collective: give them a moment, then stop.
                late = time.monotonic() + 5.0
                while len(finished) < self.world_size and time.monotonic() < late:
                    try:
                        other, other_ok = self.done.get(timeout=0.5)
                        finished[other] = other_ok
                    except queue.Empty:
                        pass
                return

    def healthy(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, graceful: bool = True) -> None:
        if graceful and self.healthy():
            for task_queue in self.tasks:
                task_queue.put(None)
            for proc in self.procs:
                proc.join(10)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)


_POOLS: dict[int, _Pool] = {}


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def run_ranks(fn: Callable, world_size: int, *, tp: int = 1, pp: int = 1, ep: int = 1,
              etp: int | None = None, timeout_minutes: int = 30, timeout: float = 180.0,
              seed: int = 1234, **kwargs: Any) -> list[Any]:
    layout = {"tp": tp, "pp": pp, "ep": ep, "etp": etp, "timeout_minutes": timeout_minutes,
              "seed": seed}
    fresh = os.environ.get("SLMOE_TEST_FRESH_RANKS") == "1"
    pool = _POOLS.pop(world_size, None)
    if pool is None or not pool.healthy() or fresh:
        if pool is not None:
            pool.close(graceful=False)
        pool = _Pool(world_size)
    try:
        results = pool.run(fn, layout, kwargs, timeout)
    except BaseException:
        pool.close(graceful=False)  # a rank may be stuck in a collective: start afresh next time
        raise
    if fresh:
        pool.close()
    else:
        _POOLS[world_size] = pool
    return results
