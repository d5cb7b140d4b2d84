"""Ascend NPU adaptor: torch_npu, its CUDA-to-NPU transfer, and MindSpeed's adaptor if installed.

Untested in this project's CI (no NPU there). It must run before Megatron-Core is imported, which
``import megatron_slmoe`` guarantees when it is the first import; we check and warn otherwise.
"""

from __future__ import annotations

import importlib.util
import logging
import sys

log = logging.getLogger(__name__)


class NpuAdaptor:
    def __init__(self) -> None:
        self.applied = False
        self._steps: list[dict[str, str]] = []

    def _step(self, target: str, reason: str) -> None:
        self._steps.append({"target": target, "reason": reason})

    def apply(self) -> None:
        if self.applied:
            return
        if any(name.startswith("megatron.core") for name in sys.modules):
            log.warning("megatron.core was imported before megatron_slmoe: NPU patches may miss "
                        "references taken at import time; import megatron_slmoe first")
        import torch_npu  # noqa: F401

        self._step("torch_npu", "registers the npu device and the hccl backend")
        from torch_npu.contrib import transfer_to_npu  # noqa: F401

        self._step("torch_npu.contrib.transfer_to_npu",
                   "routes Megatron-Core's torch.cuda calls and 'cuda' devices to the NPU")
        if importlib.util.find_spec("mindspeed") is not None:
            import mindspeed.megatron_adaptor  # noqa: F401

            self._step("mindspeed.megatron_adaptor", "MindSpeed's fused kernels and Megatron patches")
        self.applied = True

    def describe(self) -> list[dict[str, str]]:
        return list(self._steps)

    def targets(self) -> list[str]:
        return ["torch_npu", "torch_npu.contrib.transfer_to_npu"]

    def missing_targets(self) -> list[str]:
        return [t for t in self.targets() if importlib.util.find_spec(t.split(".")[0]) is None]
