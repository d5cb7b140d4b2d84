"""The all-to-all exchanges of the dispatcher: variable-split ``all_to_all_single`` of several
tensors in one byte buffer (``start_exchange``, asynchronous), the same under autograd with the
gradients sent back the reverse way (``exchange``), and the fixed-size exchange of counts.

Runs unchanged on NCCL, HCCL and gloo; a group of one (or none) exchanges nothing.
"""

from __future__ import annotations

import math

import torch


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


def exchange(group, tensors, sends, recvs, differentiable) -> list[torch.Tensor]:
    """``start_exchange(...).result()`` under autograd (see ``_Exchange``)."""
    if group is None or group.size() == 1:
        return list(tensors)
    return list(_Exchange.apply(group, sends, recvs, differentiable, *tensors))



def exchange_counts(group, counts_GC: torch.Tensor) -> torch.Tensor:
    """Row and entry counts per destination [G, C] in, per source out (fixed size: no splits)."""
    if group is None or group.size() == 1:
        return counts_GC.clone()
    received = torch.empty_like(counts_GC)
    torch.distributed.all_to_all_single(received, counts_GC.contiguous(), group=group)
    return received

