"""All-to-all token dispatcher: each token goes at most once to each rank (or node) that holds one
of its experts, DeepEP-style, and is expanded into (token, expert) rows on arrival.

Runs unchanged on NCCL, HCCL and gloo: the only collectives are ``all_to_all_single`` with split
sizes that reach the host once per exchange. Implements ``megatron_slmoe.moe.dispatch.base``.

A dispatch runs the hops of its mode (``hops``: flat over the expert-parallel group, or
hierarchical: across nodes, then within the node, each token crossing between two nodes at most
once; with node-limited routing, ``moe_router_num_groups`` = nodes, the inter-node rows per token
are bounded by the group limit). A hop is two collectives (``exchange``): the counts, then rows and
entries together in one byte buffer; the backward sends row and probability gradients back in one.
``combine`` runs the hops backwards: every rank first sums its expert outputs per received row (one
row per token and rank, whatever the number of its experts there), sends that back, and each hop's
sender sums what comes back per item. ``dispatch_compute_combine`` with ``chunks > 1`` pipelines
token chunks through the same hops (``overlap``).

Capacity dropping and padding are decided by the router; the dispatcher moves whatever the routing
map selects, including nothing: ranks and experts with zero rows are ordinary cases.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch

from megatron_slmoe.moe.dispatch.base import Dispatched, TokenDispatcher
from megatron_slmoe.moe.dispatch.exchange import exchange
from megatron_slmoe.moe.dispatch.groups import node_groups
from megatron_slmoe.moe.dispatch.hops import (
    ExchangePlan,
    HopSpec,
    entry_metadata,
    expansion,
    flat_hops,
    hierarchical_hops,
    on_device,
    plan_hop,
    received_entries,
    sum_rows,
    token_entries,
)
from megatron_slmoe.moe.dispatch.overlap import Pipeline
from megatron_slmoe.moe.dispatch.traffic import (
    TrafficAccumulator,
    flat_traffic_rows,
    hierarchical_traffic_rows,
)
from megatron_slmoe.parallel.topology import NodeLayout, node_size_from_env


class AllToAllDispatcher(TokenDispatcher):
    supports_overlap = True

    def __init__(self, num_experts: int, local_expert_indices: list[int], ep_group, *,
                 hierarchical: bool = False, node_size: Optional[int] = None,
                 timeout: Optional[timedelta] = None) -> None:
        self.num_experts = num_experts
        self.num_local = len(local_expert_indices)
        self.first_local = local_expert_indices[0]
        self.ep_group = ep_group
        self.ep_size = ep_group.size() if ep_group is not None else 1
        self.ep_rank = ep_group.rank() if ep_group is not None else 0
        if self.first_local != self.ep_rank * self.num_local:
            raise ValueError("experts must be laid out contiguously by expert-parallel rank")
        self.traffic = TrafficAccumulator()
        ep_ranks = (torch.distributed.get_process_group_ranks(ep_group)
                    if ep_group is not None and torch.distributed.is_initialized() else [0])
        self.node_size = node_size_from_env(node_size)
        self.layout = NodeLayout.from_ranks(ep_ranks, self.node_size)
        self.hierarchical = hierarchical and self.layout.nodes > 1
        self.inter_group = self.intra_group = None
        if self.hierarchical:
            self.inter_group, self.intra_group = node_groups(ep_ranks, self.node_size, timeout)
            self._hops = hierarchical_hops(self.inter_group, self.intra_group, self.layout,
                                           num_experts, self.num_local)
        else:
            self._hops = flat_hops(ep_group, self.ep_size, num_experts, self.num_local)
        self._device_hops: dict = {}

    def hop_specs(self, device: torch.device) -> tuple[HopSpec, ...]:
        """The hops with their expert tables on ``device`` (copied once per device)."""
        if device not in self._device_hops:
            self._device_hops[device] = on_device(self._hops, device)
        return self._device_hops[device]

    # -- dispatch and combine (autograd through the exchanges) -----------------------------------

    def dispatch(self, x_TL: torch.Tensor, probs_TE: torch.Tensor,
                 routing_map_TE: torch.Tensor) -> Dispatched:
        items, entries = x_TL, token_entries(probs_TE, routing_map_TE)
        hops = []
        for spec in self.hop_specs(x_TL.device):
            plan, positions_K = plan_hop(spec, items.shape[0], entries)
            prob_K, index_K2 = entry_metadata(plan, entries, positions_K)
            items, prob_K, index_K2 = exchange(
                plan.group, [items.index_select(0, plan.pair_item_P), prob_K, index_K2],
                [plan.send_rows, plan.send_entries, plan.send_entries],
                [plan.recv_rows, plan.recv_entries, plan.recv_entries], (True, True, False))
            entries = received_entries(plan, prob_K, index_K2)
            hops.append(plan)
        self.account(hops, x_TL, forward=True)
        row_entry_R, tokens_per_expert_E = expansion(hops[-1], entries, self.num_local,
                                                     self.first_local)
        row_item_R = entries.item_K.index_select(0, row_entry_R)
        plan = ExchangePlan(tuple(hops), row_item_R, row_entry_R, items.shape[0],
                            tokens_per_expert_E)
        return Dispatched(items.index_select(0, row_item_R), tokens_per_expert_E,
                          entries.prob_K.index_select(0, row_entry_R), plan)

    def combine(self, out_RL: torch.Tensor, plan: ExchangePlan) -> torch.Tensor:
        y = sum_rows(out_RL, plan.row_item_R, plan.num_items)
        for hop in reversed(plan.hops):
            (back,) = exchange(hop.group, [y], [hop.recv_rows], [hop.send_rows], (True,))
            y = sum_rows(back, hop.pair_item_P, hop.num_items)
        self.account(plan.hops, out_RL, forward=False)
        return y

    # -- pipelined -------------------------------------------------------------------------------

    def dispatch_compute_combine(self, x_TL, probs_TE, routing_map_TE, experts, chunks: int):
        """dispatch -> experts -> combine over ``chunks`` token slices, one slice's exchanges in
        flight while another's experts compute, forward and backward (see ``overlap.Pipeline``)."""
        if chunks == 1:
            return super().dispatch_compute_combine(x_TL, probs_TE, routing_map_TE, experts, 1)
        if not isinstance(experts, torch.nn.Module):
            raise TypeError("overlapped dispatch needs the experts as a torch.nn.Module (its "
                            "parameters get their gradients from the pipelined backward)")
        bounds = torch.linspace(0, x_TL.shape[0], chunks + 1).long().tolist()
        parts = tuple(slice(a, b) for a, b in zip(bounds[:-1], bounds[1:]))
        params = [p for p in experts.parameters() if p.requires_grad]
        needs_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (x_TL, probs_TE, *params))
        return Pipeline.apply(self, experts, parts, needs_grad, routing_map_TE, x_TL, probs_TE,
                              *params)

    # -- accounting ------------------------------------------------------------------------------

    def account(self, hops, rows: torch.Tensor, forward: bool) -> None:
        """Token rows this rank sends to other ranks in dispatch (forward) or combine."""
        sent = [h.send_rows if forward else h.recv_rows for h in hops]
        if self.hierarchical:
            intra, inter = hierarchical_traffic_rows(sent[0], _rank_in(self.inter_group),
                                                     sent[1], _rank_in(self.intra_group))
        else:
            intra, inter = flat_traffic_rows(sent[0], self.layout.node_of_group_rank, self.ep_rank)
        row_bytes = rows.shape[-1] * rows.element_size()
        self.traffic.add(intra=intra * row_bytes, inter=inter * row_bytes)


def _rank_in(group) -> int:
    return group.rank() if group is not None else 0
