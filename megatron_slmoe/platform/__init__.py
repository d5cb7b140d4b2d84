"""Which accelerator and collective backend this process uses, decided in one place.

Detection order: ``SLMOE_PLATFORM`` (cpu | cuda | npu) if set, else CUDA if available, else an
Ascend NPU if ``torch_npu`` is installed and sees a device, else the CPU. ``SLMOE_DIST_BACKEND``
overrides the collective backend (nccl | hccl | gloo). Everything else in the package asks this
module for the device instead of calling ``torch.cuda``.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from megatron_slmoe.platform.adaptors import adaptor_for

PLATFORM_ENV = "SLMOE_PLATFORM"
BACKEND_ENV = "SLMOE_DIST_BACKEND"

_DEFAULT_BACKEND = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


class PlatformError(RuntimeError):
    """The requested platform or backend cannot be used here. The message is one line."""


@dataclass(frozen=True)
class Platform:
    name: str  # cuda | npu | cpu
    backend: str  # nccl | hccl | gloo

    @property
    def device_type(self) -> str:
        return self.name

    def device(self, local_rank: int | None = None) -> torch.device:
        if self.name == "cpu":
            return torch.device("cpu")
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device(self.name, local_rank)

    def set_device(self, local_rank: int) -> None:
        if self.name == "cuda":
            torch.cuda.set_device(local_rank)
        elif self.name == "npu":
            torch.npu.set_device(local_rank)  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        if self.name == "cuda":
            torch.cuda.synchronize()
        elif self.name == "npu":
            torch.npu.synchronize()  # type: ignore[attr-defined]

    def device_memory_bytes(self) -> int | None:
        """Memory of one accelerator; None on the CPU (no device limit to plan against)."""
        if self.name == "cuda":
            return torch.cuda.get_device_properties(0).total_memory
        if self.name == "npu":
            return torch.npu.get_device_properties(0).total_memory  # type: ignore[attr-defined]
        return None

    def max_memory_allocated(self) -> int:
        """Peak bytes allocated on the accelerator; 0 on the CPU, where torch does not track it."""
        if self.name == "cuda":
            return torch.cuda.max_memory_allocated()
        if self.name == "npu":
            return torch.npu.max_memory_allocated()  # type: ignore[attr-defined]
        return 0


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


def _check_available(name: str) -> None:
    if name == "cuda" and not torch.cuda.is_available():
        raise PlatformError(
            f"{PLATFORM_ENV}=cuda but CUDA is not available "
            f"(torch {torch.__version__}, {torch.cuda.device_count()} visible GPUs)"
        )
    if name == "npu" and not _npu_available():
        raise PlatformError(
            f"{PLATFORM_ENV}=npu but no Ascend NPU is usable (torch_npu missing or sees no device)"
        )


def _check_backend(name: str, backend: str) -> None:
    import torch.distributed as dist

    known = ("nccl", "hccl", "gloo")
    if backend not in known:
        raise PlatformError(f"{BACKEND_ENV}={backend!r} is not one of {', '.join(known)}")
    if not dist.is_available():
        raise PlatformError("torch.distributed is not available in this PyTorch build")
    if backend == "hccl":
        if name != "npu":
            raise PlatformError(f"backend hccl needs platform npu, not {name}")
        return  # registered by torch_npu
    if not dist.is_backend_available(backend):
        raise PlatformError(f"collective backend {backend!r} is not available in torch {torch.__version__}")
    if backend == "nccl" and name != "cuda":
        raise PlatformError(f"backend nccl needs platform cuda, not {name}")


def detect() -> Platform:
    """Decide the platform from the environment and the hardware; raises PlatformError."""
    requested = os.environ.get(PLATFORM_ENV, "").strip().lower()
    if requested:
        if requested not in _DEFAULT_BACKEND:
            raise PlatformError(
                f"{PLATFORM_ENV}={requested!r} is not one of {', '.join(_DEFAULT_BACKEND)}"
            )
        _check_available(requested)
        name = requested
    elif torch.cuda.is_available():
        name = "cuda"
    elif _npu_available():
        name = "npu"
    else:
        name = "cpu"
    backend = os.environ.get(BACKEND_ENV, "").strip().lower() or _DEFAULT_BACKEND[name]
    _check_backend(name, backend)
    return Platform(name, backend)


_current: Platform | None = None


def current() -> Platform:
    """The platform of this process, detected once."""
    global _current
    if _current is None:
        _current = detect()
    return _current


def apply_adaptor() -> Platform:
    """Detect the platform and make Megatron-Core run on it. Idempotent."""
    platform = current()
    adaptor_for(platform.name).apply()
    return platform


def applied_patches() -> list[dict[str, str]]:
    registry = adaptor_for(current().name)
    return registry.describe() if registry.applied else []
