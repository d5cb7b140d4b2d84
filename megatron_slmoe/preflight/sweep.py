"""Pure helpers of the preflight: the pairwise sweep's schedule, the bandwidth formulas and
summaries (where ranks sit is ``megatron_slmoe.parallel.topology``). No torch.distributed here, so
the unit tests exercise these directly."""

from __future__ import annotations

import statistics
from typing import Sequence

MIB = 1 << 20


def pair_rounds(world_size: int) -> list[list[tuple[int, int]]]:
    """Every pair of ranks exactly once, in rounds of disjoint pairs (the circle method), so that
    a round runs all its pairs at the same time."""
    m = world_size + world_size % 2
    others = list(range(1, m))
    rounds = []
    for r in range(m - 1):
        ring = [0] + others[r:] + others[:r]
        pairs = []
        for i in range(m // 2):
            a, b = ring[i], ring[m - 1 - i]
            if a < world_size and b < world_size:
                pairs.append((min(a, b), max(a, b)))
        rounds.append(sorted(pairs))
    return rounds


def bus_bandwidth(op: str, nbytes: int, n: int, seconds: float) -> tuple[float, float]:
    """(algorithm bandwidth, bus bandwidth) in GB/s, with nccl-tests' bus factors: all-reduce
    2(n-1)/n, all-to-all (n-1)/n; comparable to the link speed whatever the group size."""
    alg = nbytes / max(seconds, 1e-12) / 1e9
    factor = {"all_reduce": 2 * (n - 1) / n, "all_to_all": (n - 1) / n}[op]
    return alg, alg * factor


def summarize(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def rank_ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, ranks = [], sorted(ranks)
    start = prev = None
    for r in ranks + [None]:
        if start is None:
            start = prev = r
        elif r is not None and r == prev + 1:
            prev = r
        else:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = prev = r
    return ", ".join(out)
