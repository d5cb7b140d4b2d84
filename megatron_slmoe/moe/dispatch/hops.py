"""Hop planning of the all-to-all dispatcher: which rows and entries one hop sends where, the
hops of each mode, and where each expert row sits after the last one.

**One hop** moves *items* (token rows, or rows received in an earlier hop) to the members of a
process group. For every destination, each item goes once if any of its experts is there, carrying
its *entries* for that destination: (router probability, the item's position among the rows sent
there, global expert id), 12 bytes per (token, expert) pair. Planning a hop exchanges its counts
(rows, and entries per bucket, per destination): the one host sync of a hop.

* Flat mode (``flat_hops``): one hop over the expert-parallel group; destination = the rank of the
  expert.
* Hierarchical mode (``hierarchical_hops``): hop A over the same-slot ranks of every node
  (destination: the node of the expert), then hop B within the node (destination: the rank of
  the expert).

After the last hop the entries are sorted by local expert (``expansion``; stable: by source, then
token order) and each becomes one expert row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from megatron_slmoe.moe.dispatch.exchange import exchange_counts
from megatron_slmoe.parallel.topology import NodeLayout

# Entry positions travel as int32.
_MAX_INT32 = (1 << 31) - 1


class _SumRows(torch.autograd.Function):
    """``zeros(n, L).index_add(0, index, rows)`` keeping only the index for the backward
    (``index_add`` would keep ``rows`` as well, an expert output's worth of memory per layer)."""

    @staticmethod
    def forward(ctx, rows, index, n):
        ctx.save_for_backward(index)
        return rows.new_zeros(n, rows.shape[-1]).index_add_(0, index, rows)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


def sum_rows(rows: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """[n, L]: row i is the sum of the ``rows`` whose ``index`` is i, in their order."""
    if not rows.requires_grad:
        return rows.new_zeros(n, rows.shape[-1]).index_add_(0, index, rows)
    return _SumRows.apply(rows, index, n)



class Entries(NamedTuple):
    """(item, expert) pairs to deliver, with their router probabilities."""

    item_K: torch.Tensor    # which item: a token, or a row received in the previous hop
    expert_K: torch.Tensor  # global expert id
    prob_K: torch.Tensor    # router probability (fp32; carries the gradient)


@dataclass(frozen=True)
class HopSpec:
    """A hop: its group and where each global expert's entries go within it."""

    group: Any
    size: int
    dest_of_expert_E: torch.Tensor
    buckets: int
    """Entry counts travel per bucket (the local expert, in the last hop) so the receiver knows
    its tokens per expert without another device-to-host copy."""
    bucket_of_expert_E: torch.Tensor


@dataclass(frozen=True)
class HopPlan:
    """One hop's exchange, everything its reverse needs. Sending side unless said otherwise."""

    group: Any
    num_items: int
    pair_item_P: torch.Tensor
    """The item of each row sent, destination-major (items in order within a destination)."""
    entry_order_K: torch.Tensor
    """Send order of the entries (indices into the hop's input entries)."""
    send_rows: list[int]
    recv_rows: list[int]
    send_entries: list[int]
    recv_entries: list[int]
    recv_bucket_counts: list[list[int]]
    """Receiving side: entries received per (source, bucket)."""


def plan_hop(spec: HopSpec, num_items: int, entries: Entries) -> tuple[HopPlan, torch.Tensor]:
    """The rows and entries of one hop, and the exchange of their counts (one host sync).
    Returns the plan and the sending side's entry positions (row index within the destination)."""
    if num_items >= _MAX_INT32:
        raise ValueError(f"all-to-all dispatch: {num_items} rows in one exchange exceed the "
                         f"{_MAX_INT32} its int32 entry positions can index")
    device = entries.item_K.device
    dest_K = spec.dest_of_expert_E[entries.expert_K]
    mask_GN = torch.zeros(spec.size, num_items, dtype=torch.bool, device=device)
    mask_GN[dest_K, entries.item_K] = True
    pair_dest_P, pair_item_P = mask_GN.nonzero(as_tuple=True)
    send_rows_G = torch.bincount(pair_dest_P, minlength=spec.size)
    first_G = torch.cumsum(send_rows_G, 0) - send_rows_G
    position_GN = torch.zeros(spec.size, num_items, dtype=torch.long, device=device)
    position_GN[pair_dest_P, pair_item_P] = (
        torch.arange(pair_item_P.numel(), device=device) - first_G[pair_dest_P])
    num_experts = spec.dest_of_expert_E.numel()
    # By destination, then expert; stable, so an expert's entries keep their order.
    entry_order_K = torch.sort(dest_K * num_experts + entries.expert_K, stable=True).indices
    bucket_K = spec.bucket_of_expert_E[entries.expert_K]
    counts_GB = torch.bincount(dest_K * spec.buckets + bucket_K,
                               minlength=spec.size * spec.buckets).view(spec.size, spec.buckets)
    counts_GC = torch.cat([send_rows_G.unsqueeze(1), counts_GB], dim=1)
    recv_GC = exchange_counts(spec.group, counts_GC)
    send_host, recv_host = torch.stack([counts_GC, recv_GC]).tolist()
    positions_K = position_GN[dest_K, entries.item_K]
    plan = HopPlan(
        group=spec.group, num_items=num_items, pair_item_P=pair_item_P,
        entry_order_K=entry_order_K,
        send_rows=[c[0] for c in send_host], recv_rows=[c[0] for c in recv_host],
        send_entries=[sum(c[1:]) for c in send_host], recv_entries=[sum(c[1:]) for c in recv_host],
        recv_bucket_counts=[c[1:] for c in recv_host])
    return plan, positions_K




def entry_metadata(plan: HopPlan, entries: Entries, positions_K: torch.Tensor):
    """In send order: the probabilities (fp32) and [K, 2] int32 (row position at the
    destination, expert)."""
    order = plan.entry_order_K
    index_K2 = torch.stack([positions_K.index_select(0, order),
                            entries.expert_K.index_select(0, order)], dim=1).to(torch.int32)
    return entries.prob_K.float().index_select(0, order), index_K2


def received_entries(plan: HopPlan, prob_K: torch.Tensor, index_K2: torch.Tensor) -> Entries:
    """The entries a hop delivered, their items indexing the rows received (source-major)."""
    device = prob_K.device
    sources = torch.arange(len(plan.recv_rows), device=device)
    source_K = torch.repeat_interleave(
        sources, torch.tensor(plan.recv_entries, device=device), output_size=prob_K.shape[0])
    first_row = torch.tensor([sum(plan.recv_rows[:s]) for s in range(len(plan.recv_rows))],
                             dtype=torch.long, device=device)
    item_K = index_K2[:, 0].long() + first_row[source_K]
    return Entries(item_K, index_K2[:, 1].long(), prob_K)


@dataclass(frozen=True)
class ExchangePlan:
    """What ``combine`` needs: the hops, and where each expert row's token sits after them."""

    hops: tuple[HopPlan, ...]
    row_item_R: torch.Tensor
    """The received row (last hop) of each expert row, expert-grouped."""
    row_entry_R: torch.Tensor
    """The received entry (last hop) of each expert row."""
    num_items: int
    """Rows received in the last hop."""
    tokens_per_expert_E: torch.Tensor


def expansion(plan_last: HopPlan, entries: Entries, num_local: int, first_local: int):
    """Sort the last hop's entries by local expert (stable): (row_entry_R, tokens_per_expert_E)."""
    local_K = entries.expert_K - first_local
    row_entry_R = torch.sort(local_K, stable=True).indices
    tokens_per_expert_E = torch.tensor(
        [sum(counts[e] for counts in plan_last.recv_bucket_counts) for e in range(num_local)],
        dtype=torch.int64)
    return row_entry_R, tokens_per_expert_E


def token_entries(probs_TE: torch.Tensor, routing_map_TE: torch.Tensor) -> Entries:
    """Every routed (token, expert) pair, expert-major, tokens in order within an expert."""
    expert_K, token_K = routing_map_TE.t().nonzero(as_tuple=True)
    return Entries(token_K, expert_K, probs_TE[token_K, expert_K])


def flat_hops(ep_group, ep_size: int, num_experts: int, num_local: int) -> tuple[HopSpec, ...]:
    """One hop to the expert's rank; entry counts per local expert."""
    rank_of_expert_E = torch.arange(num_experts) // num_local
    local_of_expert_E = torch.arange(num_experts) % num_local
    return (HopSpec(ep_group, ep_size, rank_of_expert_E, num_local, local_of_expert_E),)


def hierarchical_hops(inter_group, intra_group, layout: NodeLayout, num_experts: int,
                      num_local: int) -> tuple[HopSpec, ...]:
    """Hop A to the expert's node (one bucket), hop B to its rank there (per local expert)."""
    rank_of_expert_E = torch.arange(num_experts) // num_local
    local_of_expert_E = torch.arange(num_experts) % num_local
    node_of = torch.tensor(layout.node_of_group_rank)
    slot_of = torch.tensor(layout.slot_of_group_rank)
    return (
        HopSpec(inter_group, layout.nodes, node_of[rank_of_expert_E], 1,
                torch.zeros(num_experts, dtype=torch.long)),
        HopSpec(intra_group, layout.per_node, slot_of[rank_of_expert_E], num_local,
                local_of_expert_E),
    )


def on_device(hops: tuple[HopSpec, ...], device: torch.device) -> tuple[HopSpec, ...]:
    return tuple(HopSpec(h.group, h.size, h.dest_of_expert_E.to(device), h.buckets,
                         h.bucket_of_expert_E.to(device)) for h in hops)
