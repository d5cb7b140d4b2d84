"""Loading the native extension and asking the dispatcher which devices have a kernel.

The extension (``megatron_slmoe._C``, built from ``csrc/``) declares its ops under ``torch.ops.slmoe``
and registers one kernel per device it was built for. Loading never raises: a missing or broken
build is recorded and reported by :func:`native_extension_error`, and every op falls back to its
pure-torch reference.
"""

from __future__ import annotations

import importlib
import os
from functools import lru_cache

import torch

from megatron_slmoe.compat.torch import has_kernel_for_dispatch_key

# Dispatch key of each device type we may run on (Ascend NPUs register as PrivateUse1).
_DISPATCH_KEY = {"cpu": "CPU", "cuda": "CUDA", "npu": "PrivateUse1"}

# What registers each device's kernels in a native build.
_KERNEL_SOURCES = {"cpu": "ATen (csrc/cpu)", "cuda": "CUDA (csrc/cuda)", "npu": "AscendC (csrc/ascendc)"}

# Public op name -> the torch.ops.slmoe ops it needs, all of which must have a kernel.
NATIVE_OPS = {
    "lora_grouped_linear": ("slmoe::lora_grouped_linear_fwd", "slmoe::lora_grouped_linear_bwd"),
    # The same over packed (quantised) frozen weights: ops.quantized_weights' formats.
    "lora_grouped_linear_packed": ("slmoe::lora_grouped_linear_packed_fwd",
                                   "slmoe::lora_grouped_linear_packed_bwd"),
}


@lru_cache(maxsize=None)
def _load() -> str | None:
    """Imports the extension once; returns why it failed, or None."""
    try:
        importlib.import_module("megatron_slmoe._C")
    except ImportError as exc:  # not built, or built against another torch (undefined symbol)
        return f"{type(exc).__name__}: {exc}"
    return None


_load()  # at import, so torch.ops.slmoe is populated for every caller


def native_op(name: str):
    """``torch.ops.slmoe.<name>``, or a RuntimeError saying why the extension is not there."""
    why = native_extension_error()
    if why is not None:
        raise RuntimeError(f"megatron_slmoe._C is not loaded, so slmoe::{name} is unavailable: {why}")
    return getattr(torch.ops.slmoe, name)


@torch.compiler.assume_constant_result  # torch.compile: known at trace time, not traced
def native_extension_error() -> str | None:
    """Why ``megatron_slmoe._C`` could not be loaded, or None when it is loaded."""
    return _load()


@lru_cache(maxsize=None)
def has_native_kernel(op: str, device_type: str) -> bool:
    """Whether the extension has a kernel for public op ``op`` on ``device_type`` (cpu | cuda | npu)."""
    key = _DISPATCH_KEY.get(device_type)
    if key is None or _load() is not None:
        return False
    try:
        return all(has_kernel_for_dispatch_key(name, key) for name in NATIVE_OPS[op])
    except RuntimeError:  # an extension built before the op was declared: no such operator
        return False


def native_kernels() -> dict:
    """What the native build provides: ``{"extension": bool, <op>: [device types with a kernel],
    "implementations": {device type: the kernels' source}}``."""
    report: dict = {"extension": _load() is None}
    devices = set()
    for op in NATIVE_OPS:
        report[op] = [dev for dev in _DISPATCH_KEY if has_native_kernel(op, dev)]
        devices.update(report[op])
    report["implementations"] = {dev: _KERNEL_SOURCES[dev] for dev in _DISPATCH_KEY if dev in devices}
    return report


KERNELS_ENV = "SLMOE_KERNELS"
_KERNEL_CHOICES = ("auto", "native", "reference")


@torch.compiler.assume_constant_result  # torch.compile: decided once at trace time, not traced
def choose_backend(op: str, device: torch.device | str) -> str:
    """``"native"`` or ``"reference"`` for running ``op`` on ``device``.

    ``SLMOE_KERNELS``: ``auto`` (default) takes the native kernel where one is registered for the
    device, else the reference; ``reference`` always takes the reference; ``native`` insists on the
    kernel and raises where there is none.
    """
    choice = os.environ.get(KERNELS_ENV, "").strip() or "auto"
    if choice not in _KERNEL_CHOICES:
        raise ValueError(f"{KERNELS_ENV} must be one of {', '.join(_KERNEL_CHOICES)}, got {choice!r}")
    if choice == "reference":
        return "reference"
    device_type = torch.device(device).type
    if has_native_kernel(op, device_type):
        return "native"
    if choice == "native":
        why = native_extension_error() or f"the extension was built without a {device_type} kernel"
        raise RuntimeError(f"{KERNELS_ENV}=native but there is no native {op} for {device_type}: {why}")
    return "reference"
