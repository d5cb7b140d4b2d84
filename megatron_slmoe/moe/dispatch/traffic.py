"""Bytes a dispatcher sends within its node and to other nodes: the per-step accumulator, and the
rules that count them (shared with the layout planner, which imports this module alone: nothing
here runs a collective).
"""

from __future__ import annotations

from math import comb

import torch


class TrafficAccumulator:
    """Counts the token rows (hidden or latent width) this rank sent to other ranks; router
    probabilities and masks ride along and are not counted (a few bytes per row)."""

    def __init__(self) -> None:
        self.state = torch.zeros(2, dtype=torch.float64)  # [intra-node bytes, inter-node bytes]

    def add(self, intra: int, inter: int) -> None:
        self.state[0] += intra
        self.state[1] += inter

    def reset(self) -> None:
        self.state.zero_()

    @property
    def bytes_intra_node(self) -> int:
        return int(self.state[0].item())

    @property
    def bytes_inter_node(self) -> int:
        return int(self.state[1].item())


# The all-to-all's rows in both modes, as pure functions of the split sizes so that the layout
# planner (megatron_slmoe.plan) prices an exchange by the same rules: a token row costs its width
# times its element size, and what a rank sends to itself costs no network. Counts may be expected
# (fractional) rows. The entry metadata (12 bytes per token and expert) is not counted.


def flat_traffic_rows(send_counts, node_of_ep_rank: list[int], ep_rank: int):
    """(rows to other ranks of this node, rows to other nodes) of one flat exchange;
    ``send_counts[r]`` rows go to expert-parallel rank r."""
    me = node_of_ep_rank[ep_rank]
    intra = sum(n for r, n in enumerate(send_counts) if r != ep_rank and node_of_ep_rank[r] == me)
    inter = sum(n for r, n in enumerate(send_counts) if node_of_ep_rank[r] != me)
    return intra, inter


def hierarchical_traffic_rows(node_send_counts, node_index: int, slot_send_counts, slot: int):
    """(intra-node rows, inter-node rows) of one hierarchical exchange: ``node_send_counts[m]``
    rows cross to the same slot of node m (hop A), ``slot_send_counts[s]`` rows go to slot s of
    this node (hop B)."""
    inter = sum(n for m, n in enumerate(node_send_counts) if m != node_index)
    intra = sum(n for s, n in enumerate(slot_send_counts) if s != slot)
    return intra, inter


def expected_rows_per_destination(num_experts: int, topk: int, destinations: int,
                                  groups: int = 0, group_topk: int = 0) -> float:
    """Expected rows one token sends to one destination (a rank, or a node, holding
    ``num_experts / destinations`` experts): the probability that one of its ``topk`` experts is
    there, as a token goes once to every destination that holds one of its experts. Experts are
    taken as equally likely; with group-limited routing (``groups`` expert groups of which each
    token picks ``group_topk``) its experts lie in the picked groups only."""
    def hit(pool: int, there: int) -> float:  # P(one of k experts drawn from `pool` is `there`)
        return 1.0 - comb(pool - there, topk) / comb(pool, topk)

    per_destination = num_experts // destinations
    if groups and group_topk:
        if groups % destinations == 0:  # a destination holds whole groups
            mine = groups // destinations
            return 1.0 - comb(groups - mine, group_topk) / comb(groups, group_topk)
        if destinations % groups == 0:  # a group spans several destinations
            picked_pool = group_topk * (num_experts // groups)
            return group_topk / groups * hit(picked_pool, per_destination)
    return hit(num_experts, per_destination)
