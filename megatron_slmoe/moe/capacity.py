"""Capacity dropping: each expert keeps at most ``ceil(T * k / E * capacity_factor)`` of the T
tokens routed on this rank.

Megatron-Core's version ranks tokens for the "position" policy with ``topk`` over a 0/1 routing map,
whose ties fall wherever the kernel puts them (on CPU it keeps e.g. tokens 9, 7, 8 of 12, not the
first three). Here "position" keeps the earliest tokens, as its name promises, and "probs" the most
probable ones (as Megatron's).
"""

from __future__ import annotations

import math

import torch

POLICIES = ("probs", "position")


def expert_capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def apply_capacity(probs_TE: torch.Tensor, routing_map_TE: torch.Tensor, topk: int,
                   capacity_factor: float, policy: str, pad_to_capacity: bool = False):
    """Returns (probs, routing_map) with the tokens over capacity dropped. With
    ``pad_to_capacity`` every expert gets exactly ``capacity`` rows, padded with zero-probability
    tokens, so expert inputs have a static shape."""
    if policy not in POLICIES:
        raise ValueError(f"--moe-token-drop-policy {policy!r} is not one of {', '.join(POLICIES)}")
    num_tokens, num_experts = probs_TE.shape
    capacity = expert_capacity(num_tokens, topk, num_experts, capacity_factor)
    if capacity >= num_tokens:
        keep_TE = torch.ones_like(routing_map_TE)
    else:
        if policy == "probs":
            priority_TE = probs_TE.detach().float()
        else:  # earlier tokens first
            order_T = torch.arange(num_tokens, 0, -1, device=probs_TE.device, dtype=torch.float32)
            priority_TE = order_T.unsqueeze(1).expand(num_tokens, num_experts)
        # Routed tokens always outrank unrouted ones; unrouted ones only fill padding.
        priority_TE = torch.where(routing_map_TE, priority_TE + 1.0, priority_TE.new_zeros(()) - 1.0)
        keep_idx = torch.topk(priority_TE, k=capacity, dim=0).indices
        keep_TE = torch.zeros_like(routing_map_TE).scatter(0, keep_idx, True)
    final_map = keep_TE if pad_to_capacity else routing_map_TE & keep_TE
    return probs_TE * final_map, final_map
