"""Choosing the next token from the last position's logits: greedy, or temperature with nucleus
(top-p) filtering, drawn from one generator per prompt so a prompt's sample does not depend on
which rank, batch or position in the batch it was given."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen."""

    temperature: float = 0.0
    """0: greedy (argmax); > 0: sample from softmax(logits / temperature)."""
    top_p: float = 1.0
    """Sample only from the smallest set of most likely tokens whose probability reaches top_p
    (1.0: no filtering). Needs temperature > 0."""
    seed: int = 0
    """Seed of the per-prompt generators (with the prompt's index)."""

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise ValueError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_p < 1.0 and self.temperature == 0.0:
            raise ValueError("--top-p needs --temperature > 0 (temperature 0 is greedy)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def prompt_generator(seed: int, prompt_index: int) -> torch.Generator:
    """The CPU generator of one prompt, the same on every rank and in every layout."""
    digest = hashlib.sha256(f"{seed}:{prompt_index}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def nucleus_mask(probs_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    """True for the tokens kept by top-p: in descending order of probability, a token is kept
    while the mass of the tokens before it is below ``top_p`` (so the most likely one always is)."""
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
    mass_before_BV = sorted_BV.cumsum(dim=-1) - sorted_BV
    keep_sorted_BV = mass_before_BV < top_p
    return torch.zeros_like(keep_sorted_BV).scatter(-1, order_BV, keep_sorted_BV)


def sample_next_tokens(logits_BV: torch.Tensor, sampling: SamplingConfig,
                       generators: Sequence[torch.Generator],
                       drawing_B: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The next token of each row (int64 [B], on the logits' device). ``generators``: one per row
    (used only when sampling). ``drawing_B``: the rows that really generate now (default all);
    only their generators advance, so a prompt's draws do not depend on how long the other
    prompts of its batch are. The other rows get the argmax."""
    greedy_B = logits_BV.argmax(dim=-1)
    if sampling.greedy:
        return greedy_B
    drawing = (torch.ones(len(generators), dtype=torch.bool) if drawing_B is None
               else drawing_B.cpu())
    rows = drawing.nonzero().flatten().tolist()
    if not rows:
        return greedy_B
    logits_BV = logits_BV[rows]
    probs_BV = torch.softmax(logits_BV.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        probs_BV = probs_BV * nucleus_mask(probs_BV, sampling.top_p)
        probs_BV = probs_BV / probs_BV.sum(dim=-1, keepdim=True)
    # Inverse-CDF draw with one uniform per row from that row's own generator.
    uniform_B = torch.stack([torch.rand((), generator=generators[r], dtype=torch.float64)
                             for r in rows])
    cdf_BV = probs_BV.double().cpu().cumsum(dim=-1)
    # Token j is drawn when cdf[j-1] <= u < cdf[j]: zero-probability tokens never are. Scaling u
    # by the total keeps it below the last cdf entry despite rounding.
    uniform_B = uniform_B * cdf_BV[:, -1]
    index_B = torch.searchsorted(cdf_BV, uniform_B.unsqueeze(-1), right=True).squeeze(-1)
    greedy_B[rows] = index_B.to(greedy_B.device)
    return greedy_B
