"""Straggler detection on two real gloo ranks: rank 1 computes four times as long per step as
rank 0, and rank 0 spends that difference waiting inside the gradient reduction (a real
all-reduce), as it would in a data-parallel step. Only rank 1 is named; the wait is not counted
as compute. (The trainer's use of it is checked in tests/distributed/test_finetune.py.)"""

from __future__ import annotations

import time

import pytest

from tests.helpers.ranks import run_ranks

FAST_S, SLOW_S, STEPS = 0.01, 0.04, 6


def _steps(threshold: float) -> dict:
    import torch

    from megatron_slmoe.training.reliability.stragglers import start_step_times

    times = start_step_times(threshold, torch.device("cpu"))
    grad_sync = times.timed_grad_sync(lambda: torch.distributed.all_reduce(torch.ones(1)))
    rank = torch.distributed.get_rank()
    for _ in range(STEPS):
        started = time.perf_counter()
        times.step_started()
        time.sleep(SLOW_S if rank == 1 else FAST_S)  # "compute"
        grad_sync()  # rank 0 waits here for rank 1
        times.step_finished(time.perf_counter() - started)
    return times.compare()


def test_the_slower_rank_is_named_and_waiting_is_not_compute():
    record, other = run_ranks(_steps, 2, threshold=1.5)
    assert record == other  # every rank reaches the same verdict
    assert record["steps"] == STEPS and record["slowest_rank"] == 1
    fast, slow = record["compute_s_by_rank"]
    assert fast == pytest.approx(FAST_S, abs=0.008)  # its wait for rank 1 left out
    assert slow >= SLOW_S
    (straggler,) = record["stragglers"]
    assert straggler["rank"] == 1 and straggler["slow_steps"] > STEPS // 2
    assert straggler["ratio"] > 1.5


def test_no_straggler_below_the_threshold():
    record, _ = run_ranks(_steps, 2, threshold=10.0)
    assert record["slowest_rank"] == 1 and record["stragglers"] == []
