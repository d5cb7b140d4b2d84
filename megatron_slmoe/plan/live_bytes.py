"""Peak bytes of live tensors in this process: the CPU stand-in for ``max_memory_allocated``.

On a CPU there is no allocator statistic to ask. Peak resident memory (RSS) mixes in the Python
heap, the libraries' code and glibc's arena policy, and never goes down, so it cannot tell the
memory model's components apart. ``LiveTensorBytes`` counts what the memory model predicts and
what a GPU's caching allocator reports as allocated: the bytes of every tensor storage created
while it is active, from its creation until it is freed.

How: a ``TorchDispatchMode`` sees the outputs of every operator call (forward, the autograd
backward on the same thread, optimizer steps, collectives' outputs allocated from Python); each new
storage is counted once, keyed by its data pointer, and a ``weakref.finalize`` on the storage
object subtracts it when the storage dies (PyTorch keeps a storage's Python object alive as long as
the storage itself, so the callback fires at the free). Views share their base's storage and are
not counted again. Not seen: tensors created before ``start()`` (start it first thing) and buffers
that C++ libraries allocate outside PyTorch's operators (gloo's internal copies) — as on a GPU,
where NCCL's buffers are outside the allocator too.

It slows every operator call by a Python round trip: a measurement tool, not for production runs.
"""

from __future__ import annotations

import threading
import weakref

import torch

from megatron_slmoe.compat.torch import TorchDispatchMode, tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """``with LiveTensorBytes() as live: ...``; ``live.current``, ``live.peak``,
    ``live.reset_peak()``. Counts storages on CPU (and any device) tensors; meta tensors are free."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes."""
        with self._lock:
            self.peak = self.current

    def _free(self, key: int, nbytes: int) -> None:
        with self._lock:
            if self._live.get(key) == nbytes:
                del self._live[key]
                self.current -= nbytes

    def _track(self, tensor: torch.Tensor) -> None:
        if tensor.is_meta:
            return
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if not key or not nbytes:
            return
        with self._lock:
            if key in self._live:
                return
            self._live[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._track(value)
        return out
