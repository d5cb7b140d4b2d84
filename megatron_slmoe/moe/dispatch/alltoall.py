"""All-to-all token dispatcher: each token goes at most once to each rank (or node) that holds one
of its experts, DeepEP-style, and is expanded into (token, expert) rows on arrival.

Runs unchanged on NCCL, HCCL and gloo: the only collectives are ``all_to_all_single`` with split
sizes that reach the host once per exchange. Implements ``megatron_slmoe.moe.dispatch.base``.

**One hop** moves *items* (token rows, or rows received in an earlier hop) to the members of a
process group. For every destination, each item goes once if any of its experts is there, carrying
its *entries* for that destination: (router probability, the item's position among the rows sent
there, global expert id), 12 bytes per (token, expert) pair. A hop is two collectives: the counts
(rows, and entries per bucket, per destination), then rows and entries together in one byte
buffer (``start_exchange``); the backward sends row and probability gradients back in one. On
arrival the receiver knows each entry's row.

* Flat mode: one hop over the expert-parallel group; destination = the rank of the expert.
* Hierarchical mode (multi-node): hop A over the same-slot ranks of every node (destination: the
  node of the expert, each token crosses between two nodes at most once), then hop B within the
  node (destination: the rank of the expert). With node-limited routing (``moe_router_num_groups``
  = nodes) the inter-node rows per token are bounded by the group limit.

After the last hop the entries are sorted by local expert (stable: by source, then token order) and
each becomes one expert row. ``combine`` runs the hops backwards: every rank first sums its expert
outputs per received row (one row per token and rank, whatever the number of its experts there),
sends that back, and each hop's sender sums what comes back per item.

``dispatch_compute_combine`` with ``chunks > 1`` pipelines token chunks through the same hops with
asynchronous exchanges: a chunk's rows travel while another chunk's experts compute, in the forward
and in the hand-written backward (``_Pipeline``), in both modes. Its results equal running the
chunks one after another through ``dispatch``/``combine`` bit for bit.

Capacity dropping and padding are decided by the router; the dispatcher moves whatever the routing
map selects, including nothing: ranks and experts with zero rows are ordinary cases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from math import comb
from typing import Any, NamedTuple, Optional

import torch

from megatron_slmoe.parallel.topology import NodeLayout, node_size_from_env
from megatron_slmoe.moe.dispatch.base import Dispatched, TokenDispatcher
from megatron_slmoe.moe.dispatch.traffic import TrafficAccumulator
from megatron_slmoe.moe.stages import COMBINE, DISPATCH, EXPERTS, stage

# Entry positions travel as int32.
_MAX_INT32 = (1 << 31) - 1


# --- exchanges -----------------------------------------------------------------------------------


class _DoneWork:
    def wait(self) -> bool:
        return True


def _all_to_all(group, tensor: torch.Tensor, send: list[int], recv: list[int],
                async_op: bool = False):
    """Variable-split all-to-all without autograd: (output, work to wait on before reading it)."""
    if group is None or group.size() == 1:
        return tensor, _DoneWork()
    tensor = tensor.contiguous()
    out = tensor.new_empty((sum(recv), *tensor.shape[1:]))
    work = torch.distributed.all_to_all_single(out, tensor, recv, send, group=group,
                                               async_op=async_op)
    return out, (work if async_op else _DoneWork())


class Pending:
    """A started exchange: ``result()`` waits for it and returns the received tensors."""

    def __init__(self, work, unpack) -> None:
        self._work, self._unpack = work, unpack

    def result(self) -> list[torch.Tensor]:
        self._work.wait()
        return self._unpack()


def start_exchange(group, tensors: list[torch.Tensor], sends: list[list[int]],
                   recvs: list[list[int]]) -> Pending:
    """Start one all-to-all that carries several tensors: ``tensors[i]`` holds ``sends[i][g]`` rows
    for group member g (destination-major); what arrives holds ``recvs[i][g]`` rows from member g
    (source-major). Several tensors travel as one byte buffer, since on every backend each
    collective costs a latency that small payloads cannot hide."""
    if group is None or group.size() == 1:
        return Pending(_DoneWork(), lambda: list(tensors))
    if len(tensors) == 1:
        out, work = _all_to_all(group, tensors[0], sends[0], recvs[0], async_op=True)
        return Pending(work, lambda: [out])
    tensors = [t.contiguous() for t in tensors]
    row_bytes = [math.prod(t.shape[1:]) * t.element_size() for t in tensors]
    members = group.size()
    pieces, offsets = [], [0] * len(tensors)
    for g in range(members):
        for i, t in enumerate(tensors):
            pieces.append(t.narrow(0, offsets[i], sends[i][g]).reshape(-1).view(torch.uint8))
            offsets[i] += sends[i][g]
    send_bytes = [sum(sends[i][g] * row_bytes[i] for i in range(len(tensors))) for g in range(members)]
    recv_bytes = [sum(recvs[i][g] * row_bytes[i] for i in range(len(tensors))) for g in range(members)]
    buffer = torch.cat(pieces)
    out = buffer.new_empty(sum(recv_bytes))
    work = torch.distributed.all_to_all_single(out, buffer, recv_bytes, send_bytes, group=group,
                                               async_op=True)

    def unpack() -> list[torch.Tensor]:
        parts: list[list[torch.Tensor]] = [[] for _ in tensors]
        position = 0
        for g in range(members):
            for i in range(len(tensors)):
                size = recvs[i][g] * row_bytes[i]
                parts[i].append(out.narrow(0, position, size))
                position += size
        return [torch.cat(p).view(t.dtype).view(-1, *t.shape[1:]) for p, t in zip(parts, tensors)]

    return Pending(work, unpack)


class _Exchange(torch.autograd.Function):
    """``start_exchange(...).result()`` with autograd: the backward sends the gradients back the
    same way (one all-to-all). Tensors whose ``differentiable`` flag is off carry none."""

    @staticmethod
    def forward(ctx, group, sends, recvs, differentiable, *tensors):
        ctx.group, ctx.sends, ctx.recvs, ctx.differentiable = group, sends, recvs, differentiable
        outs = start_exchange(group, list(tensors), sends, recvs).result()
        ctx.mark_non_differentiable(*(o for o, d in zip(outs, differentiable) if not d))
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        which = [i for i, d in enumerate(ctx.differentiable) if d]
        back = start_exchange(ctx.group, [grads[i] for i in which],
                              [ctx.recvs[i] for i in which], [ctx.sends[i] for i in which]).result()
        out: list = [None] * len(grads)
        for i, g in zip(which, back):
            out[i] = g
        return (None, None, None, None, *out)


def _exchange(group, tensors, sends, recvs, differentiable):
    if group is None or group.size() == 1:
        return list(tensors)
    return list(_Exchange.apply(group, sends, recvs, differentiable, *tensors))


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


# --- one hop -------------------------------------------------------------------------------------


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
    recv_GC = _exchange_counts(spec.group, counts_GC)
    send_host, recv_host = torch.stack([counts_GC, recv_GC]).tolist()
    positions_K = position_GN[dest_K, entries.item_K]
    plan = HopPlan(
        group=spec.group, num_items=num_items, pair_item_P=pair_item_P,
        entry_order_K=entry_order_K,
        send_rows=[c[0] for c in send_host], recv_rows=[c[0] for c in recv_host],
        send_entries=[sum(c[1:]) for c in send_host], recv_entries=[sum(c[1:]) for c in recv_host],
        recv_bucket_counts=[c[1:] for c in recv_host])
    return plan, positions_K


def _exchange_counts(group, counts_GC: torch.Tensor) -> torch.Tensor:
    if group is None or group.size() == 1:
        return counts_GC.clone()
    received = torch.empty_like(counts_GC)
    torch.distributed.all_to_all_single(received, counts_GC.contiguous(), group=group)
    return received


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


# --- the dispatcher ------------------------------------------------------------------------------


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
        rank_of_expert_E = torch.arange(num_experts) // self.num_local
        local_of_expert_E = torch.arange(num_experts) % self.num_local
        if self.hierarchical:
            self.inter_group, self.intra_group = _node_groups(ep_ranks, self.node_size, timeout)
            node_of = torch.tensor(self.layout.node_of_group_rank)
            slot_of = torch.tensor(self.layout.slot_of_group_rank)
            self._hops = (
                HopSpec(self.inter_group, self.layout.nodes, node_of[rank_of_expert_E], 1,
                        torch.zeros(num_experts, dtype=torch.long)),
                HopSpec(self.intra_group, self.layout.per_node, slot_of[rank_of_expert_E],
                        self.num_local, local_of_expert_E),
            )
        else:
            self._hops = (HopSpec(ep_group, self.ep_size, rank_of_expert_E, self.num_local,
                                  local_of_expert_E),)
        self._device_hops: dict = {}

    def _hop_specs(self, device: torch.device) -> tuple[HopSpec, ...]:
        if device not in self._device_hops:
            self._device_hops[device] = tuple(
                HopSpec(h.group, h.size, h.dest_of_expert_E.to(device), h.buckets,
                        h.bucket_of_expert_E.to(device)) for h in self._hops)
        return self._device_hops[device]

    # -- dispatch and combine (autograd through the exchanges) -----------------------------------

    def dispatch(self, x_TL: torch.Tensor, probs_TE: torch.Tensor,
                 routing_map_TE: torch.Tensor) -> Dispatched:
        items, entries = x_TL, token_entries(probs_TE, routing_map_TE)
        hops = []
        for spec in self._hop_specs(x_TL.device):
            plan, positions_K = plan_hop(spec, items.shape[0], entries)
            prob_K, index_K2 = entry_metadata(plan, entries, positions_K)
            items, prob_K, index_K2 = _exchange(
                plan.group, [items.index_select(0, plan.pair_item_P), prob_K, index_K2],
                [plan.send_rows, plan.send_entries, plan.send_entries],
                [plan.recv_rows, plan.recv_entries, plan.recv_entries], (True, True, False))
            entries = received_entries(plan, prob_K, index_K2)
            hops.append(plan)
        self._account(hops, x_TL, forward=True)
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
            (back,) = _exchange(hop.group, [y], [hop.recv_rows], [hop.send_rows], (True,))
            y = sum_rows(back, hop.pair_item_P, hop.num_items)
        self._account(plan.hops, out_RL, forward=False)
        return y

    # -- pipelined -------------------------------------------------------------------------------

    def dispatch_compute_combine(self, x_TL, probs_TE, routing_map_TE, experts, chunks: int):
        """dispatch -> experts -> combine over ``chunks`` token slices, one slice's exchanges in
        flight while another's experts compute, forward and backward (see ``_Pipeline``)."""
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
        return _Pipeline.apply(self, experts, parts, needs_grad, routing_map_TE, x_TL, probs_TE,
                               *params)

    # -- accounting ------------------------------------------------------------------------------

    def _account(self, hops, rows: torch.Tensor, forward: bool) -> None:
        """Token rows this rank sends to other ranks in dispatch (forward) or combine."""
        sent = [h.send_rows if forward else h.recv_rows for h in hops]
        if self.hierarchical:
            intra, inter = hierarchical_traffic_rows(sent[0], _rank_in(self.inter_group),
                                                     sent[1], _rank_in(self.intra_group))
        else:
            intra, inter = flat_traffic_rows(sent[0], self.layout.node_of_group_rank, self.ep_rank)
        row_bytes = rows.shape[-1] * rows.element_size()
        self.traffic.add(intra=intra * row_bytes, inter=inter * row_bytes)


# --- the pipeline --------------------------------------------------------------------------------


def _run_round_robin(tasks) -> None:
    """Advance generator tasks in turn until all are done. Every rank runs the same tasks in the
    same order, so their collectives are issued in the same order everywhere."""
    active = list(tasks)
    while active:
        still = []
        for task in active:
            try:
                next(task)
                still.append(task)
            except StopIteration:
                pass
        active = still


@dataclass
class _Chunk:
    part: slice
    entries: Entries
    hops: list
    hop_entry_counts: list
    """Entries each hop took in (their gradients go back in that many)."""
    row_item_R: Optional[torch.Tensor] = None
    row_entry_R: Optional[torch.Tensor] = None
    num_items: int = 0
    rows_leaf: Optional[torch.Tensor] = None
    probs_leaf: Optional[torch.Tensor] = None
    out_RL: Optional[torch.Tensor] = None


class _Pipeline(torch.autograd.Function):
    """dispatch -> experts -> combine over token chunks with asynchronous exchanges.

    Forward: each chunk is a task that plans a hop, starts its row and entry exchanges, yields
    while they travel, and continues on arrival; the experts run under autograd on the received
    rows (kept for the backward). Backward, written out so it can be pipelined the same way: the
    output gradient follows the hops forwards (the reverse of combine), the experts' graph gives
    the gradients of rows, probabilities and parameters, and those follow the hops backwards. Every
    step is the same tensor operation, in the same order, as autograd applies to
    ``dispatch``/``combine`` run chunk by chunk, so the results are bitwise those. Parameter
    gradients of the chunks are summed last chunk first, as the autograd engine sums them.
    """

    @staticmethod
    def forward(ctx, dispatcher, experts, parts, grad, routing_map_TE, x_TL, probs_TE, *params):
        specs = dispatcher._hop_specs(x_TL.device)
        chunks = [_Chunk(part, token_entries(probs_TE[part].detach(), routing_map_TE[part]), [], [])
                  for part in parts]
        y_parts: list = [None] * len(chunks)

        def task(index: int, chunk: _Chunk):
            items, entries = x_TL[chunk.part].detach(), chunk.entries
            for spec in specs:
                with stage(DISPATCH):
                    plan, positions_K = plan_hop(spec, items.shape[0], entries)
                    pending = start_exchange(
                        plan.group, [items.index_select(0, plan.pair_item_P),
                                     *entry_metadata(plan, entries, positions_K)],
                        [plan.send_rows, plan.send_entries, plan.send_entries],
                        [plan.recv_rows, plan.recv_entries, plan.recv_entries])
                yield
                with stage(DISPATCH):
                    items, prob_K, index_K2 = pending.result()
                    chunk.hops.append(plan)
                    chunk.hop_entry_counts.append(entries.item_K.numel())
                    entries = received_entries(plan, prob_K, index_K2)
            dispatcher._account(chunk.hops, x_TL, forward=True)
            with stage(DISPATCH):
                chunk.row_entry_R, counts_E = expansion(chunk.hops[-1], entries,
                                                        dispatcher.num_local, dispatcher.first_local)
                chunk.row_item_R = entries.item_K.index_select(0, chunk.row_entry_R)
                chunk.num_items = items.shape[0]
                chunk.rows_leaf = items.index_select(0, chunk.row_item_R)
                chunk.probs_leaf = entries.prob_K.index_select(0, chunk.row_entry_R)
            with stage(EXPERTS), torch.enable_grad():
                if grad:
                    chunk.rows_leaf.requires_grad_(x_TL.requires_grad)
                    chunk.probs_leaf.requires_grad_(probs_TE.requires_grad)
                    out_RL = experts(chunk.rows_leaf, counts_E, chunk.probs_leaf)
                else:
                    with torch.no_grad():
                        out_RL = experts(chunk.rows_leaf, counts_E, chunk.probs_leaf)
            chunk.out_RL = out_RL if grad else None
            y = sum_rows(out_RL.detach(), chunk.row_item_R, chunk.num_items)
            for hop in reversed(chunk.hops):
                with stage(COMBINE):
                    pending = start_exchange(hop.group, [y], [hop.recv_rows], [hop.send_rows])
                yield
                with stage(COMBINE):
                    (back,) = pending.result()
                    y = sum_rows(back, hop.pair_item_P, hop.num_items)
            dispatcher._account(chunk.hops, out_RL, forward=False)
            y_parts[index] = y

        _run_round_robin([task(i, c) for i, c in enumerate(chunks)])
        ctx.chunks, ctx.num_params = chunks, len(params)
        ctx.x_shape, ctx.probs_shape = x_TL.shape, probs_TE.shape
        ctx.x_dtype, ctx.probs_dtype = x_TL.dtype, probs_TE.dtype
        ctx.params = params
        return torch.cat(y_parts) if len(y_parts) > 1 else y_parts[0]

    @staticmethod
    def backward(ctx, grad_y_TL):
        chunks = ctx.chunks
        need_x, need_probs = ctx.needs_input_grad[5], ctx.needs_input_grad[6]
        grad_x = grad_y_TL.new_zeros(ctx.x_shape, dtype=ctx.x_dtype) if need_x else None
        grad_probs = (grad_y_TL.new_zeros(ctx.probs_shape, dtype=ctx.probs_dtype)
                      if need_probs else None)
        param_grads: list = [None] * len(chunks)

        def task(index: int, chunk: _Chunk):
            # The reverse of combine: the output gradient follows the hops forwards.
            g = grad_y_TL[chunk.part]
            for hop in chunk.hops:
                with stage(COMBINE):
                    pending = start_exchange(hop.group, [g.index_select(0, hop.pair_item_P)],
                                             [hop.send_rows], [hop.recv_rows])
                yield
                with stage(COMBINE):
                    (g,) = pending.result()
            with stage(EXPERTS):
                inputs = [t for t in (chunk.rows_leaf, chunk.probs_leaf) if t.requires_grad]
                wanted = inputs + list(ctx.params)
                grads = [None] * len(wanted)
                if chunk.out_RL.requires_grad and wanted:
                    grads = list(torch.autograd.grad(chunk.out_RL, wanted,
                                                     g.index_select(0, chunk.row_item_R),
                                                     allow_unused=True))
                g_rows_R = grads.pop(0) if chunk.rows_leaf.requires_grad else None
                g_probs_R = grads.pop(0) if chunk.probs_leaf.requires_grad else None
                param_grads[index] = grads
                chunk.out_RL = None  # free the experts' graph
            # The reverse of dispatch: row and probability gradients follow the hops backwards,
            # in one exchange per hop as in dispatch's (absent ones travel as zeros there too).
            with stage(DISPATCH):
                num_entries = chunk.row_entry_R.numel()
                if g_rows_R is None:
                    g_rows_R = g.new_zeros(chunk.row_item_R.numel(), ctx.x_shape[-1],
                                           dtype=ctx.x_dtype)
                if g_probs_R is None:
                    g_probs_R = g.new_zeros(num_entries, dtype=torch.float32)
                g_items = sum_rows(g_rows_R, chunk.row_item_R, chunk.num_items)
                g_entries = g_probs_R.new_zeros(num_entries).index_add(
                    0, chunk.row_entry_R, g_probs_R)
            for hop, num_entries in zip(reversed(chunk.hops), reversed(chunk.hop_entry_counts)):
                with stage(DISPATCH):
                    pending = start_exchange(hop.group, [g_items, g_entries],
                                             [hop.recv_rows, hop.recv_entries],
                                             [hop.send_rows, hop.send_entries])
                yield
                with stage(DISPATCH):
                    back_rows, back_entries = pending.result()
                    g_items = sum_rows(back_rows, hop.pair_item_P, hop.num_items)
                    g_entries = back_entries.new_zeros(num_entries).index_add(
                        0, hop.entry_order_K, back_entries)
            with stage(DISPATCH):
                if grad_x is not None:
                    grad_x[chunk.part] = g_items
                if grad_probs is not None:
                    source = chunk.entries
                    grad_probs[chunk.part] = torch.zeros(
                        grad_probs[chunk.part].shape, dtype=ctx.probs_dtype,
                        device=grad_probs.device).index_put_(
                        (source.item_K, source.expert_K), g_entries.to(ctx.probs_dtype),
                        accumulate=True)

        _run_round_robin([task(i, c) for i, c in enumerate(chunks)])
        summed = []
        for p in range(ctx.num_params):
            total = None
            for grads in reversed(param_grads):  # last chunk first, as autograd accumulates
                g = grads[p]
                if g is not None:
                    total = g if total is None else total + g
            summed.append(total)
        ctx.chunks = ctx.params = None
        return (None, None, None, None, None, grad_x, grad_probs, *summed)


# --- byte accounting -----------------------------------------------------------------------------
# The byte accounting of both modes, as pure functions of the split sizes so that the layout
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
