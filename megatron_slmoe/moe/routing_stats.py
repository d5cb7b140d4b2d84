"""Per-layer routing statistics, accumulated by the router over the micro-batches of one step.

The router records every forward (training or not) into its accumulator; the routing monitor
reduces all layers' accumulators across ranks once per step, turns them into metrics and resets
them. Everything is kept as one flat float64 tensor per layer so the reduction is one collective.
"""

from __future__ import annotations

import torch


class RoutingStatsAccumulator:
    """Sums over tokens: tokens per expert, per-token routing entropy, squared router logits.

    Layout of ``state``: ``[tokens_per_expert (E), num_tokens, entropy_sum, logit_sq_sum,
    logit_max_abs]``; the last entry is a running maximum, the others running sums.
    """

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.state = torch.zeros(num_experts + 4, dtype=torch.float64)

    SUM_FIELDS = slice(0, -1)  # reduce these with SUM across ranks
    MAX_FIELD = -1  # reduce this one with MAX

    @torch.no_grad()
    def record(self, logits_TE: torch.Tensor, scores_TE: torch.Tensor,
               routing_map_TE: torch.Tensor) -> None:
        """``logits_TE``: raw router logits; ``scores_TE``: the scores (softmax over experts, or
        sigmoid, normalised per token here) used for the entropy; ``routing_map_TE``: bool, True
        where a token is routed to an expert. Stays on the logits' device: no host sync."""
        if self.state.device != logits_TE.device:
            self.state = self.state.to(logits_TE.device)
        logits = logits_TE.detach().double().reshape(-1, self.num_experts)
        probs = scores_TE.detach().double().reshape(-1, self.num_experts)
        probs = probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-30)
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(dim=-1)
        tokens = routing_map_TE.reshape(-1, self.num_experts).sum(dim=0).double()
        self.state[: self.num_experts] += tokens
        self.state[self.num_experts] += logits.shape[0]
        self.state[self.num_experts + 1] += entropy.sum()
        self.state[self.num_experts + 2] += logits.square().sum()
        if logits.numel():
            self.state[self.MAX_FIELD] = torch.maximum(self.state[self.MAX_FIELD],
                                                       logits.abs().max())

    def reset(self) -> None:
        self.state.zero_()

    @staticmethod
    def unpack(state: torch.Tensor, num_experts: int) -> dict[str, torch.Tensor | float]:
        return {
            "tokens_per_expert": state[:num_experts],
            "num_tokens": state[num_experts].item(),
            "entropy_sum": state[num_experts + 1].item(),
            "logit_sq_sum": state[num_experts + 2].item(),
            "logit_max_abs": state[num_experts + 3].item(),
        }
