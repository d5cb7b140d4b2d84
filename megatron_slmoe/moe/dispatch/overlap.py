"""The all-to-all dispatcher's overlap: token chunks pipelined through the same hops with
asynchronous exchanges, a chunk's rows travelling while another chunk's experts compute, in the
forward and in the hand-written backward, in both modes. Its results equal running the chunks one
after another through ``dispatch``/``combine`` bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_slmoe.moe.dispatch.exchange import start_exchange
from megatron_slmoe.moe.dispatch.hops import (
    Entries,
    entry_metadata,
    expansion,
    plan_hop,
    received_entries,
    sum_rows,
    token_entries,
)
from megatron_slmoe.moe.stages import COMBINE, DISPATCH, EXPERTS, stage


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


class Pipeline(torch.autograd.Function):
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
        specs = dispatcher.hop_specs(x_TL.device)
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
            dispatcher.account(chunk.hops, x_TL, forward=True)
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
            dispatcher.account(chunk.hops, out_RL, forward=False)
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
