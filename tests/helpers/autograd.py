"""What autograd keeps for backward, measured: the reference the planner's activation estimates
are held equal to."""

from __future__ import annotations

from typing import Callable

import torch


def saved_activation_bytes(model: torch.nn.Module, forward: Callable[[], object]) -> int:
    """Bytes of the distinct storages autograd keeps for backward while ``forward()`` runs,
    ``model``'s parameters and buffers excluded."""
    owned = {p.untyped_storage().data_ptr() for p in model.parameters()}
    owned |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    kept: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in owned:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(kept.values())
