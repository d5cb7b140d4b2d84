"""One adaptor per platform; each is a PatchRegistry (or behaves like one) applied once."""

from __future__ import annotations

from functools import lru_cache

from megatron_slmoe.platform.adaptors.compat import register_without_te
from megatron_slmoe.platform.adaptors.cpu import build_registry
from megatron_slmoe.platform.adaptors.npu import NpuAdaptor
from megatron_slmoe.platform.patching import PatchRegistry


@lru_cache(maxsize=None)
def adaptor_for(platform: str):
    if platform == "cpu":
        return build_registry()
    if platform == "npu":
        return NpuAdaptor()
    if platform == "cuda":
        # Megatron-Core is written for CUDA: only the fixes for a missing TransformerEngine.
        registry = PatchRegistry()
        register_without_te(registry)
        return registry
    raise ValueError(f"unknown platform {platform!r}")
