"""All-to-all token dispatcher: sends each routed row only to the rank that holds its expert.

Runs unchanged on NCCL, HCCL and gloo: the only collectives are ``all_to_all_single`` (through
Megatron-Core's autograd ``all_to_all``, whose backward is the reverse exchange), and the split
sizes reach the host once per exchange. Implements ``megatron_slmoe.moe.dispatch.base``.

Flat mode (one exchange over the expert-parallel group):
  permute the (token, expert) pairs by destination expert (stable: token order within an expert),
  exchange per-expert counts, exchange the rows with variable splits, regroup the received rows by
  local expert. ``combine`` is the exact reverse.

Hierarchical mode (multi-node; DeepEP-style two hops):
  1. inter-node: each token goes once to every node that hosts one of its experts, to the rank
     there with the same position in the node as the sender, with its router probabilities for
     that node's experts;
  2. intra-node: that rank forwards the token once to every rank of its node that hosts one of the
     token's experts, where it is expanded into (token, local expert) rows.
  Each token crosses the inter-node network at most once per destination node, so with
  node-limited routing (``moe_router_num_groups`` = nodes) inter-node bytes per token are bounded by
  the group limit. ``combine`` reverses both hops, summing partial outputs on the way back.

Capacity dropping and padding are decided by the router (Megatron's ``moe_expert_capacity_factor``,
``moe_token_drop_policy``, ``moe_pad_expert_input_to_capacity``); the dispatcher moves whatever the
routing map selects, including nothing: ranks and experts with zero rows are ordinary cases.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
from megatron.core.tensor_parallel.mappings import all_to_all

from megatron_slmoe.launch.topology import NodeLayout, node_size_from_env
from megatron_slmoe.moe.dispatch.base import Dispatched, TokenDispatcher
from megatron_slmoe.moe.dispatch.traffic import TrafficAccumulator


def _exchange(group, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]):
    """Variable-split all-to-all with autograd (the backward is the reverse exchange)."""
    if group is None or group.size() == 1:
        return rows
    return all_to_all(group, rows, recv_counts, send_counts)


def _exchange_counts(group, counts_D: torch.Tensor) -> torch.Tensor:
    """Every rank sends ``counts_D.view(size, -1)[r]`` to rank r; returns what it received."""
    if group is None or group.size() == 1:
        return counts_D.clone()
    received = torch.empty_like(counts_D)
    torch.distributed.all_to_all_single(received, counts_D.contiguous(), group=group)
    return received


def _grouped_order(mask_NG: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a boolean [N, G] selection: (group, item) index pairs sorted group-major, items in
    their original order (a stable permutation by destination)."""
    group_R, item_R = mask_NG.t().nonzero(as_tuple=True)
    return group_R, item_R


@dataclass
class _FlatPlan:
    token_R: torch.Tensor
    expert_R: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]
    regroup_R: torch.Tensor
    tokens_per_expert_E: torch.Tensor


class _AsyncAllToAll(torch.autograd.Function):
    """Starts a variable-split all-to-all and returns its (not yet filled) output; the caller
    waits on the work handle put in ``works`` before reading it. Backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, group, rows, send_counts, recv_counts, works):
        ctx.group, ctx.send_counts, ctx.recv_counts = group, send_counts, recv_counts
        rows = rows.contiguous()
        out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
        works.append(torch.distributed.all_to_all_single(
            out, rows, recv_counts, send_counts, group=group, async_op=True))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return None, _exchange(ctx.group, grad_out, ctx.recv_counts, ctx.send_counts), None, None, None


class _DoneWork:
    def wait(self) -> bool:
        return True


def _exchange_async(group, rows, send_counts, recv_counts):
    if group is None or group.size() == 1:
        return rows, _DoneWork()
    works: list = []
    out = _AsyncAllToAll.apply(group, rows, send_counts, recv_counts, works)
    return out, works[0]


@dataclass
class _HierState:
    token_A: torch.Tensor
    a_send: list[int]
    a_recv: list[int]
    row_B: torch.Tensor
    b_send: list[int]
    b_recv: list[int]
    num_A: int
    row_R: torch.Tensor
    num_B: int
    num_tokens: int


class AllToAllDispatcher(TokenDispatcher):
    def __init__(self, num_experts: int, local_expert_indices: list[int], ep_group, *,
                 hierarchical: bool = False, node_size: Optional[int] = None,
                 timeout: Optional[timedelta] = None) -> None:
        self.num_experts = num_experts
        self.num_local = len(local_expert_indices)
        self.ep_group = ep_group
        self.ep_size = ep_group.size() if ep_group is not None else 1
        self.ep_rank = ep_group.rank() if ep_group is not None else 0
        if local_expert_indices[0] != self.ep_rank * self.num_local:
            raise ValueError("experts must be laid out contiguously by expert-parallel rank")
        self.traffic = TrafficAccumulator()
        ep_ranks = (torch.distributed.get_process_group_ranks(ep_group)
                    if ep_group is not None and torch.distributed.is_initialized() else [0])
        self.node_size = node_size_from_env(node_size)
        self.layout = NodeLayout.from_ranks(ep_ranks, self.node_size)
        self.hierarchical = hierarchical and self.layout.nodes > 1
        self.inter_group = self.intra_group = None
        if self.hierarchical:
            self.inter_group, self.intra_group = _node_groups(ep_ranks, self.node_size, timeout)

    # -- flat ------------------------------------------------------------------------------------

    def _plan_flat(self, routing_map_TE: torch.Tensor) -> _FlatPlan:
        """Destination order of the (token, expert) rows and the exchange sizes (one host sync)."""
        expert_R, token_R = _grouped_order(routing_map_TE)
        counts_E = torch.bincount(expert_R, minlength=self.num_experts)
        recv_counts_DE = _exchange_counts(self.ep_group, counts_E).view(self.ep_size, self.num_local)
        send_counts = counts_E.view(self.ep_size, self.num_local).sum(dim=1).tolist()
        recv_counts = recv_counts_DE.sum(dim=1).tolist()
        # Received rows are source-major, then local expert: this permutation regroups them
        # local-expert-major.
        local_R = torch.arange(self.num_local).repeat(self.ep_size).repeat_interleave(
            recv_counts_DE.flatten().cpu()).to(routing_map_TE.device)
        regroup_R = torch.sort(local_R, stable=True).indices
        return _FlatPlan(token_R, expert_R, send_counts, recv_counts, regroup_R,
                         recv_counts_DE.sum(dim=0).cpu())

    def dispatch(self, x_TL: torch.Tensor, probs_TE: torch.Tensor,
                 routing_map_TE: torch.Tensor) -> Dispatched:
        if self.hierarchical:
            return self._dispatch_hierarchical(x_TL, probs_TE, routing_map_TE)
        plan = self._plan_flat(routing_map_TE)
        rows_RL = _exchange(self.ep_group, x_TL.index_select(0, plan.token_R),
                            plan.send_counts, plan.recv_counts)
        probs_R = _exchange(self.ep_group, probs_TE[plan.token_R, plan.expert_R].unsqueeze(-1),
                            plan.send_counts, plan.recv_counts).squeeze(-1)
        self._account_flat(plan.send_counts, x_TL)
        return Dispatched(rows_RL[plan.regroup_R], plan.tokens_per_expert_E,
                          probs_R[plan.regroup_R], plan=(plan, x_TL.shape[0]))

    def combine(self, out_RL: torch.Tensor, plan) -> torch.Tensor:
        if isinstance(plan, _HierState):
            return self._combine_hierarchical(out_RL, plan)
        plan, num_tokens = plan
        back_RL = torch.empty_like(out_RL).index_copy(0, plan.regroup_R, out_RL)
        back_RL = _exchange(self.ep_group, back_RL, plan.recv_counts, plan.send_counts)
        self._account_flat(plan.recv_counts, out_RL)
        y_TL = out_RL.new_zeros(num_tokens, out_RL.shape[-1])
        return y_TL.index_add(0, plan.token_R, back_RL)

    # -- flat, overlapped --------------------------------------------------------------------------

    @property
    def supports_overlap(self) -> bool:
        return not self.hierarchical

    def dispatch_compute_combine(self, x_TL, probs_TE, routing_map_TE, experts, chunks: int):
        """Flat dispatch -> experts -> combine over ``chunks`` slices of the tokens, with the
        exchanges of one slice in flight (asynchronous all-to-all) while the experts compute
        another. Forward only overlaps; the backward runs the reverse exchanges in turn."""
        if chunks == 1 or not self.supports_overlap:
            return super().dispatch_compute_combine(x_TL, probs_TE, routing_map_TE, experts, 1)
        bounds = torch.linspace(0, x_TL.shape[0], chunks + 1).long().tolist()
        slices = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]

        def launch(part: slice):
            plan = self._plan_flat(routing_map_TE[part])
            rows, w_rows = _exchange_async(self.ep_group, x_TL[part].index_select(0, plan.token_R),
                                           plan.send_counts, plan.recv_counts)
            probs, w_probs = _exchange_async(
                self.ep_group, probs_TE[part][plan.token_R, plan.expert_R].unsqueeze(-1),
                plan.send_counts, plan.recv_counts)
            self._account_flat(plan.send_counts, x_TL)
            return plan, rows, probs, (w_rows, w_probs)

        in_flight = launch(slices[0])
        returning = []
        for i, part in enumerate(slices):
            upcoming = launch(slices[i + 1]) if i + 1 < len(slices) else None
            plan, rows, probs, works = in_flight
            for work in works:
                work.wait()
            out_RL = experts(rows[plan.regroup_R], plan.tokens_per_expert_E,
                             probs.squeeze(-1)[plan.regroup_R])
            back_RL = torch.empty_like(out_RL).index_copy(0, plan.regroup_R, out_RL)
            back_RL, w_back = _exchange_async(self.ep_group, back_RL, plan.recv_counts,
                                              plan.send_counts)
            self._account_flat(plan.recv_counts, out_RL)
            returning.append((part, plan, back_RL, w_back))
            in_flight = upcoming
        width = returning[0][2].shape[-1]
        y_TL = x_TL.new_zeros(x_TL.shape[0], width)
        for part, plan, back_RL, work in returning:
            work.wait()
            y_TL = y_TL.index_add(0, plan.token_R + part.start, back_RL)
        return y_TL

    # -- hierarchical ----------------------------------------------------------------------------

    def _dispatch_hierarchical(self, x_TL, probs_TE, routing_map_TE):
        layout, n_local = self.layout, self.num_local
        nodes, per_node = layout.nodes, layout.per_node
        # Experts of node m, in slot order: a [nodes, per_node * n_local] table of expert ids.
        node_experts = torch.empty(nodes, per_node * n_local, dtype=torch.long)
        for ep_rank in range(self.ep_size):
            m, s = layout.node_of_group_rank[ep_rank], layout.slot_of_group_rank[ep_rank]
            node_experts[m, s * n_local:(s + 1) * n_local] = torch.arange(
                ep_rank * n_local, (ep_rank + 1) * n_local)
        node_experts = node_experts.to(routing_map_TE.device)
        T = x_TL.shape[0]
        # Hop A: token t to node m once if any of its experts is there.
        map_TMX = routing_map_TE[:, node_experts]  # [T, nodes, per_node*n_local]
        node_A, token_A = _grouped_order(map_TMX.any(dim=-1))
        a_send_t = torch.bincount(node_A, minlength=nodes)
        a_recv = _exchange_counts(self.inter_group, a_send_t).tolist()
        a_send = a_send_t.tolist()
        rows_A = _exchange(self.inter_group, x_TL.index_select(0, token_A), a_send, a_recv)
        probs_A = _exchange(self.inter_group, probs_TE[:, node_experts][token_A, node_A],
                            a_send, a_recv)
        mask_A = _exchange(self.inter_group, map_TMX[token_A, node_A].to(x_TL.dtype),
                           a_send, a_recv).detach().bool()
        # Hop B: a received row to slot s of this node once if any of its experts is there.
        num_A = rows_A.shape[0]
        mask_ASX = mask_A.view(num_A, per_node, n_local)
        slot_B, row_B = _grouped_order(mask_ASX.any(dim=-1))
        b_send_t = torch.bincount(slot_B, minlength=per_node)
        b_recv = _exchange_counts(self.intra_group, b_send_t).tolist()
        b_send = b_send_t.tolist()
        rows_B = _exchange(self.intra_group, rows_A.index_select(0, row_B), b_send, b_recv)
        probs_B = _exchange(self.intra_group,
                            probs_A.view(num_A, per_node, n_local)[row_B, slot_B], b_send, b_recv)
        mask_B = _exchange(self.intra_group, mask_ASX[row_B, slot_B].to(x_TL.dtype),
                           b_send, b_recv).detach().bool()
        # Expand into (row, local expert) pairs, local-expert-major.
        expert_R, row_R = _grouped_order(mask_B)
        tokens_per_expert_E = torch.bincount(expert_R, minlength=n_local).cpu()
        intra, inter = hierarchical_traffic_rows(a_send, _rank_in(self.inter_group), b_send,
                                                 _rank_in(self.intra_group))
        row_bytes = x_TL.shape[-1] * x_TL.element_size()
        self.traffic.add(intra=intra * row_bytes, inter=inter * row_bytes)
        plan = _HierState(token_A, a_send, a_recv, row_B, b_send, b_recv, num_A, row_R,
                          rows_B.shape[0], T)
        return Dispatched(rows_B.index_select(0, row_R), tokens_per_expert_E,
                          probs_B[row_R, expert_R], plan)

    def _combine_hierarchical(self, out_RL, st: _HierState):
        width = out_RL.shape[-1]
        y_B = out_RL.new_zeros(st.num_B, width).index_add(0, st.row_R, out_RL)
        y_B = _exchange(self.intra_group, y_B, st.b_recv, st.b_send)
        y_A = out_RL.new_zeros(st.num_A, width).index_add(0, st.row_B, y_B)
        y_A = _exchange(self.inter_group, y_A, st.a_recv, st.a_send)
        # Combine sends back what dispatch received.
        intra, inter = hierarchical_traffic_rows(st.a_recv, _rank_in(self.inter_group), st.b_recv,
                                                 _rank_in(self.intra_group))
        row_bytes = width * out_RL.element_size()
        self.traffic.add(intra=intra * row_bytes, inter=inter * row_bytes)
        return out_RL.new_zeros(st.num_tokens, width).index_add(0, st.token_A, y_A)

    # -- accounting ------------------------------------------------------------------------------

    def _account_flat(self, send_counts: list[int], rows: torch.Tensor) -> None:
        intra, inter = flat_traffic_rows(send_counts, self.layout.node_of_group_rank,
                                         self.ep_rank)
        row_bytes = rows.shape[-1] * rows.element_size()
        self.traffic.add(intra=intra * row_bytes, inter=inter * row_bytes)


# The byte accounting of both modes, as pure functions of the split sizes so that the layout
# planner (megatron_slmoe.plan) prices an exchange by the same rules: a row costs its width times
# its element size, and what a rank sends to itself costs no network. Counts may be expected
# (fractional) rows.


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


def _rank_in(group) -> int:
    return group.rank() if group is not None else 0


def _node_groups(ep_ranks: list[int], node_size: int, timeout):
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
