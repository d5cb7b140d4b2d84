"""The contract every token dispatcher implements.

A dispatcher moves each token's (latent) row to the ranks that hold its experts and back::

    dispatched = dispatcher.dispatch(x_TL, probs_TE, routing_map_TE)
    out_RL = experts(dispatched.rows_RL, dispatched.tokens_per_expert_E, dispatched.probs_R)
    y_TL = dispatcher.combine(out_RL, dispatched.plan)

``rows_RL`` holds one row per (token, local expert) assignment, grouped by local expert in expert
order (tokens in their original order within a group); ``tokens_per_expert_E`` gives the group
sizes (a CPU int64 tensor, zeros allowed) and ``probs_R`` each row's router probability. ``combine``
sums the rows back onto their tokens (the experts have already weighted them by ``probs_R``).
Everything ``combine`` needs travels in ``plan``: a dispatcher keeps no per-call state, so
recomputation, several micro-batches in flight and re-entrant calls are safe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import torch

from megatron_slmoe.moe.dispatch.traffic import TrafficAccumulator
from megatron_slmoe.moe.stages import COMBINE, DISPATCH, EXPERTS, stage

ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""experts(rows_RL, tokens_per_expert_E, probs_R) -> out_RL."""


@dataclass(frozen=True)
class Dispatched:
    rows_RL: torch.Tensor
    tokens_per_expert_E: torch.Tensor
    probs_R: torch.Tensor
    plan: Any
    """What ``combine`` needs to send the rows back (dispatcher-specific)."""


class TokenDispatcher(ABC):
    traffic: TrafficAccumulator
    """Bytes this rank sent within and between nodes since the last reset (routing monitor)."""

    supports_overlap: bool = False
    """Whether ``dispatch_compute_combine`` overlaps communication with expert computation."""

    @abstractmethod
    def dispatch(self, x_TL: torch.Tensor, probs_TE: torch.Tensor,
                 routing_map_TE: torch.Tensor) -> Dispatched:
        ...

    @abstractmethod
    def combine(self, out_RL: torch.Tensor, plan: Any) -> torch.Tensor:
        ...

    def dispatch_compute_combine(self, x_TL: torch.Tensor, probs_TE: torch.Tensor,
                                 routing_map_TE: torch.Tensor, experts: ExpertsFn,
                                 chunks: int) -> torch.Tensor:
        """dispatch -> experts -> combine; dispatchers with ``supports_overlap`` pipeline it."""
        with stage(DISPATCH):
            dispatched = self.dispatch(x_TL, probs_TE, routing_map_TE)
        with stage(EXPERTS):
            out_RL = experts(dispatched.rows_RL, dispatched.tokens_per_expert_E, dispatched.probs_R)
        with stage(COMBINE):
            return self.combine(out_RL, dispatched.plan)
