"""Pure helpers of the preflight: which node each rank is on, how groups split into their
within-node and across-node parts, the pairwise sweep's schedule and the bandwidth formulas.
No torch.distributed here, so the unit tests exercise these directly."""

from __future__ import annotations

import statistics
from typing import Optional, Sequence

MIB = 1 << 20


def node_ids(ranks: Sequence[dict], node_size: Optional[int] = None) -> list[int]:
    """Node index of every rank, from the per-rank records gathered at start-up.

    ``node_size`` forces blocks of that many consecutive ranks (logical nodes on one machine).
    Otherwise each record's ``group_rank`` (torchrun's node rank) when every rank has one, else
    blocks of ``local_world_size`` ranks, else one node per distinct hostname (in rank order).
    """
    if node_size:
        return [r["rank"] // node_size for r in ranks]
    if all(r.get("group_rank") is not None for r in ranks):
        return [int(r["group_rank"]) for r in ranks]
    if all(r.get("local_world_size") for r in ranks):
        return [r["rank"] // int(r["local_world_size"]) for r in ranks]
    order: dict[str, int] = {}
    return [order.setdefault(r["host"], len(order)) for r in ranks]


def scope(group: Sequence[int], node_of: Sequence[int]) -> str:
    return "intra" if len({node_of[r] for r in group}) == 1 else "inter"


def split_by_node(group: Sequence[int], node_of: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
    """A group's within-node parts (its ranks on each node) and across-node parts (the i-th rank
    of the group on every node), each of at least two ranks: the two hops of a hierarchical
    collective. Both are empty for a group that is already within one node, or that has one
    rank per node (its across-node part would be the group itself)."""
    by_node: dict[int, list[int]] = {}
    for rank in group:
        by_node.setdefault(node_of[rank], []).append(rank)
    if len(by_node) < 2 or len(by_node) == len(group):
        return [], []
    intra = [ranks for ranks in by_node.values() if len(ranks) > 1]
    depth = max(len(ranks) for ranks in by_node.values())
    inter = [[ranks[i] for ranks in by_node.values() if i < len(ranks)] for i in range(depth)]
    return intra, [g for g in inter if len(g) > 1]


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
