"""Bytes a dispatcher sent within its node and to other nodes, accumulated over a step."""

from __future__ import annotations

import torch


class TrafficAccumulator:
    """Counts the token rows (hidden or latent width) this rank sent to other ranks; router
    probabilities and masks ride along and are not counted (a few bytes per row)."""

    def __init__(self) -> None:
        self.state = torch.zeros(2, dtype=torch.float64)  # [intra-node bytes, inter-node bytes]

    def add(self, intra: int, inter: int) -> None:
        self.state[0] += intra
        self.state[1] += inter

    def reset(self) -> None:
        self.state.zero_()

    @property
    def bytes_intra_node(self) -> int:
        return int(self.state[0].item())

    @property
    def bytes_inter_node(self) -> int:
        return int(self.state[1].item())
