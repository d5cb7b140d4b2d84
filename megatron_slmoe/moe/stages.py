"""Named profiler ranges around the stages of an MoE layer.

``with stage(DISPATCH): ...`` opens a ``torch.profiler.record_function`` range called
``slmoe.stage::dispatch`` (a prefix of its own: the native ops already appear as
``slmoe::<op>``). With no profiler running a range costs a few microseconds; under a profiler the
ranges say where a step's time goes (``tools/bench/lora_step.py`` attributes each backward op to
the range of the forward op that created it). The names are the one vocabulary the layer, the
dispatchers and the benchmarks share.
"""

from __future__ import annotations

import torch

PREFIX = "slmoe.stage::"

ROUTER = "router"
LATENT = "latent"
"""The latent down- and up-projections (d -> l before dispatch, l -> d after combine)."""
DISPATCH = "dispatch"
"""Planning the exchange, sending the rows, expanding them into (token, expert) rows."""
EXPERTS = "experts"
COMBINE = "combine"
"""Reducing the expert outputs per rank, sending them back, summing them per token."""
SHARED = "shared_expert"

LAYER_STAGES = (ROUTER, LATENT, DISPATCH, EXPERTS, COMBINE, SHARED)


def stage(name: str) -> torch.profiler.record_function:
    return torch.profiler.record_function(PREFIX + name)
