"""The process groups of the hierarchical all-to-all: within each node, and across nodes between
the ranks of the same slot."""

from __future__ import annotations

import torch

from megatron_slmoe.parallel.topology import NodeLayout


def node_groups(ep_ranks: list[int], node_size: int, timeout):
    """Create, collectively on every rank, the intra-node and same-slot inter-node groups of every
    expert-parallel group; return this rank's (inter, intra) pair. new_group must be called by all
    ranks in the same order, so every rank learns every EP group's members first. The groups use
    the configured distributed timeout."""
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, ep_ranks)
    mine = torch.distributed.get_rank()
    kwargs = {"timeout": timeout} if timeout is not None else {}
    inter_group = intra_group = None
    for group_ranks in sorted({tuple(g) for g in everyone}):
        layout = NodeLayout.from_ranks(list(group_ranks), node_size)
        by_node = [[r for i, r in enumerate(group_ranks) if layout.node_of_group_rank[i] == m]
                   for m in range(layout.nodes)]
        for node_ranks in by_node:
            group = torch.distributed.new_group(node_ranks, **kwargs)
            if mine in node_ranks:
                intra_group = group
        for slot in range(layout.per_node):
            slot_ranks = [by_node[m][slot] for m in range(layout.nodes)]
            group = torch.distributed.new_group(slot_ranks, **kwargs)
            if mine in slot_ranks:
                inter_group = group
    return inter_group, intra_group
