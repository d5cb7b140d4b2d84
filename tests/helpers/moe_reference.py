"""An independent, deliberately plain MoE forward for tests: token by token, expert by expert.

Routing is Megatron's default softmax top-k (top-k on fp32 logits, softmax over the chosen),
optionally with capacity dropping applied per source rank's tokens. No code is shared with the
package.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def route(logits_TE: torch.Tensor, topk: int):
    """[T, E] fp64 probs (zero where not chosen) and the boolean routing map."""
    top_logits, top_idx = logits_TE.topk(topk, dim=-1)
    probs = torch.zeros_like(logits_TE).scatter(1, top_idx, top_logits.softmax(dim=-1))
    routing = torch.zeros_like(logits_TE, dtype=torch.bool).scatter(1, top_idx, True)
    return probs, routing


def drop_over_capacity(probs_TE, routing_TE, topk: int, capacity_factor: float, policy: str):
    """Each expert keeps at most ceil(T * topk / E * factor) of this rank's tokens: the most
    probable ones ("probs") or the earliest ones ("position")."""
    num_tokens, num_experts = probs_TE.shape
    capacity = math.ceil(num_tokens * topk / num_experts * capacity_factor)
    keep = torch.zeros_like(routing_TE)
    for e in range(num_experts):
        tokens = [t for t in range(num_tokens) if routing_TE[t, e]]
        if policy == "probs":
            tokens = sorted(tokens, key=lambda t: -probs_TE[t, e].item())
        for t in tokens[:capacity]:
            keep[t, e] = True
    return probs_TE * keep, keep


def moe_forward(x_TD, params: dict, topk: int, rank_slices=None, capacity_factor=None,
                drop_policy="probs"):
    """``params``: router [E, D], optional down [L, D] / up [D, L], fc1 [E, 2F, L], fc2 [E, L, F].
    ``rank_slices``: the token slices owned by each source rank (capacity is per rank)."""
    x = x_TD.double()
    logits = x @ params["router"].double().t()
    probs, routing = route(logits, topk)
    if capacity_factor is not None:
        parts = [drop_over_capacity(probs[s], routing[s], topk, capacity_factor, drop_policy)
                 for s in (rank_slices or [slice(None)])]
        probs = torch.cat([p for p, _ in parts])
        routing = torch.cat([r for _, r in parts])
    latent = x @ params["down"].double().t() if "down" in params else x
    fc1, fc2 = params["fc1"].double(), params["fc2"].double()
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(fc2.shape[1], dtype=torch.float64)
        for e in routing[t].nonzero().flatten().tolist():
            gate, value = (fc1[e] @ latent[t]).chunk(2)
            acc = acc + probs[t, e] * (fc2[e] @ (F.silu(gate) * value))
        rows.append(acc)
    out = torch.stack(rows)
    if "up" in params:
        out = out @ params["up"].double().t()
    return out, routing
