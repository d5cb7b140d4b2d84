"""Warnings Megatron-Core prints about itself that a user cannot act on: the optional fused
kernels it looks for at import (Transformer Engine, Apex; ``python -m megatron_slmoe.platform``
reports which are installed), a CUDA tuning hint, its own use of a deprecated ``full`` scope and of
torch.distributed names torch renamed. Left on, they bury the one ``error:`` line of a mistyped
flag and the first screen of every training log.

Torch-free and idempotent; the package root calls it on import, before anything of ours can
import Megatron-Core."""

from __future__ import annotations

import warnings

_IGNORED = (
    (UserWarning, r".*(Apex|Transformer Engine).* (is|are) not installed"),
    (UserWarning, r".*CUDA_DEVICE_MAX_CONNECTIONS"),
    (UserWarning, r"full scope is deprecated"),
    (FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`"),
)


def quiet_upstream_noise() -> None:
    for category, message in _IGNORED:
        warnings.filterwarnings("ignore", message=message, category=category)
