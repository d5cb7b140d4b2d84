"""Spawn a few ranks on this machine, each a real process in a gloo (or nccl/hccl) group.

``run_ranks(fn, world_size, ...)`` starts ``world_size`` processes, each of which imports
megatron_slmoe (applying the platform adaptor), joins the process group, initialises Megatron's
parallel_state with the given layout, calls ``fn(**kwargs)`` and saves its return value. The parent
returns the per-rank results, or fails with the first rank's traceback.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, layout: dict, fn: Callable, kwargs: dict,
            out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        import megatron_slmoe
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        platform = megatron_slmoe.PLATFORM
        platform.set_device(rank)
        torch.distributed.init_process_group(
            platform.backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
        )
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.get("tp", 1),
            pipeline_model_parallel_size=layout.get("pp", 1),
            expert_model_parallel_size=layout.get("ep", 1),
            expert_tensor_parallel_size=layout.get("etp"),  # None: Megatron's default (= TP)
            distributed_timeout_minutes=layout.get("timeout_minutes", 30),
        )
        model_parallel_cuda_manual_seed(layout.get("seed", 1234))
        result = fn(**kwargs)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:  # report everything, including assertion errors, to the parent
        torch.save({"ok": False, "error": traceback.format_exc()},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        if torch.distributed.is_initialized():
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *, tp: int = 1, pp: int = 1, ep: int = 1,
              etp: int | None = None, timeout_minutes: int = 30, timeout: float = 180.0,
              **kwargs: Any) -> list[Any]:
    layout = {"tp": tp, "pp": pp, "ep": ep, "etp": etp, "timeout_minutes": timeout_minutes}
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, layout, fn, kwargs, out_dir))
            for r in range(world_size)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        results = []
        for rank, proc in enumerate(procs):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} produced no result (exit code {proc.exitcode})")
            record = torch.load(path, weights_only=False)
            if not record["ok"]:
                raise RuntimeError(f"rank {rank} failed:\n{record['error']}")
            results.append(record["result"])
        return results
