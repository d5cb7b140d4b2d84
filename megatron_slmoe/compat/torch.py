"""PyTorch's private names that megatron_slmoe uses."""

from __future__ import annotations

from importlib.metadata import version
from typing import Callable

from torch._C import _dispatch_has_kernel_for_dispatch_key as has_kernel_for_dispatch_key
from torch.utils._device import _device_constructors as device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_slmoe.compat import CompatError

TESTED = "2.13"
_COMPILED_ORIGINAL = "_torchdynamo_orig_callable"


def uncompiled(fn: Callable) -> Callable:
    """The function a ``torch.compile`` wrapper runs when compiled, called eagerly instead."""
    original = getattr(fn, _COMPILED_ORIGINAL, None)
    if original is None:
        raise CompatError(f"{getattr(fn, '__qualname__', fn)!r} has no {_COMPILED_ORIGINAL}: it is "
                          f"not torch.compile'd, or torch {version('torch')} keeps the compiled "
                          f"function elsewhere (tested with torch {TESTED})")
    return original


__all__ = ["TorchDispatchMode", "device_constructors",
           "has_kernel_for_dispatch_key", "tree_flatten", "uncompiled"]
