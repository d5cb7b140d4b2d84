"""Where ranks sit: which node each rank is on, and how a group of ranks splits into nodes.

Shared by the MoE dispatchers (the hierarchical all-to-all and the byte accounting within and
between nodes) and the preflight (collectives within and between nodes). Pure Python; only
``node_size_from_env`` asks torch.distributed for the world size when nothing else says.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence


def node_size_from_env(explicit: Optional[int] = None) -> int:
    """Ranks per node: the flag if given, else the launcher's LOCAL_WORLD_SIZE, else one node."""
    if explicit:
        return explicit
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value:
        return int(value)
    import torch

    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


@dataclass(frozen=True)
class NodeLayout:
    """Where the ranks of one group sit: ``nodes`` x ``per_node`` ranks, node = rank // node_size."""

    nodes: int
    per_node: int
    node_of_group_rank: tuple[int, ...]
    slot_of_group_rank: tuple[int, ...]

    @staticmethod
    def from_ranks(ranks: Sequence[int], node_size: int) -> "NodeLayout":
        node_ids_ = [r // node_size for r in ranks]
        distinct = sorted(set(node_ids_))
        members = {n: [i for i, m in enumerate(node_ids_) if m == n] for n in distinct}
        per_node = {len(v) for v in members.values()}
        if len(per_node) != 1:
            raise ValueError(f"group {list(ranks)} spans nodes unevenly (node size {node_size}); "
                             "a hierarchical exchange needs the same number of its ranks on "
                             "every node")
        node_of, slot_of = [0] * len(ranks), [0] * len(ranks)
        for n_index, n in enumerate(distinct):
            for slot, group_rank in enumerate(members[n]):
                node_of[group_rank], slot_of[group_rank] = n_index, slot
        return NodeLayout(len(distinct), per_node.pop(), tuple(node_of), tuple(slot_of))

    def peers(self, group_rank: int) -> tuple[int, int]:
        """(other ranks of the group on this node, ranks of the group on other nodes)."""
        me = self.node_of_group_rank[group_rank]
        intra = sum(1 for r, n in enumerate(self.node_of_group_rank) if r != group_rank and n == me)
        return intra, len(self.node_of_group_rank) - 1 - intra


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
