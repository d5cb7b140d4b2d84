"""Where a training step's time goes, by stage, from a torch.profiler trace (benchmark helper).

Stages are the ``record_function`` ranges named ``slmoe.stage::<stage>`` (``megatron_slmoe.moe.stages``:
the MoE layer's router, latent, dispatch, experts, combine, shared expert; the benchmarks add
attention and optimizer). Forward time is each range's own time (minus stage ranges nested in it).
Backward time goes to the stage whose forward created the autograd node: the profiler gives every
forward op and every ``autograd::engine::evaluate_function`` event the node's sequence number, so
each backward node is charged to the innermost stage range around its forward op. What no stage
claims (embedding, norms, loss, gradient accumulation and reduction, Python between ops) is
``other``.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

import torch

from megatron_slmoe.moe.stages import PREFIX, stage

BACKWARD = "autograd::engine::evaluate_function"
OTHER = "other"


def _duration_us(event) -> float:
    return event.time_range.end - event.time_range.start


def _nearest(event, predicate):
    parent = event.cpu_parent
    while parent is not None and not predicate(parent):
        parent = parent.cpu_parent
    return parent


def _is_stage(event) -> bool:
    return event.name.startswith(PREFIX)


def _is_backward(event) -> bool:
    return event.name.startswith(BACKWARD)


def stage_times_us(events, wall_us: float) -> dict[str, float]:
    """Microseconds per stage over the profiled region (``wall_us`` long) of this process."""
    times: dict[str, float] = defaultdict(float)
    creator: dict[tuple[int, int], str] = {}
    for event in events:
        if _is_stage(event):
            inner = sum(_duration_us(c) for c in _stage_children(event))
            times[event.name[len(PREFIX):]] += _duration_us(event) - inner
        elif event.sequence_nr >= 0 and not _is_backward(event):
            owner = _nearest(event, _is_stage)
            if owner is not None:
                creator[(event.thread, event.sequence_nr)] = owner.name[len(PREFIX):]
    for event in events:
        if not _is_backward(event):
            continue
        # Top-level backward nodes outside any stage range (a range's own time already holds the
        # backward work run inside it, e.g. a pipelined exchange's hand-written backward).
        if _nearest(event, lambda e: _is_backward(e) or _is_stage(e)) is not None:
            continue
        name = creator.get((event.fwd_thread, event.sequence_nr), OTHER)
        inner = sum(_duration_us(c) for c in _stage_children(event))
        times[name] += _duration_us(event) - inner
    times[OTHER] += wall_us - sum(times.values())
    return dict(times)


def _stage_children(event):
    """Stage ranges nested in ``event`` with no other stage range in between."""
    found = []
    stack = list(event.cpu_children)
    while stack:
        child = stack.pop()
        if _is_stage(child):
            found.append(child)
        else:
            stack.extend(child.cpu_children)
    return found


def wrap_forward(module: torch.nn.Module, name: str) -> None:
    """Run ``module``'s forward inside the stage range ``name`` (this instance only)."""
    forward = module.forward

    def staged(*args, **kwargs):
        with stage(name):
            return forward(*args, **kwargs)

    module.forward = staged


@contextmanager
def profiled():
    """A CPU profiler whose events ``stage_times_us`` reads."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield prof
