"""Accelerators the planner knows: memory, matrix rate, links, and what a process loses up front.

Memory is what the device reports as total (``torch.cuda.mem_get_info``, nvidia-smi's MiB), in
bytes; reports print GiB. Rates and
bandwidths are the vendors' datasheet figures; ``efficiency`` is the share of the peak matrix rate
an MoE training step reaches (a ranking assumption, not a promise: step times are for ordering
layouts). Links: ``intra_node_gbps`` per device within a node (NVLink / HCCS), ``inter_node_gbps``
per device between nodes (one 400 Gb/s NIC per device = 50 GB/s).

``framework_overhead`` is memory a process holds outside the tensors the memory model counts
(CUDA/CANN context, NCCL/HCCL communicator buffers, cuBLAS workspaces, the allocator's own pools);
``fragmentation`` is the share of the peak the caching allocator keeps reserved on top of what is
allocated. Both are per device kind and should be measured on the cluster
(``tools/bench/plan_accuracy.py`` on the device, or ``--framework-overhead-gb`` / ``--fragmentation``
to override). The CPU entry's figures are measured by that benchmark on CPU runs (live tensor
bytes, see ``megatron_slmoe.plan.live_bytes``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GB = 10**9
MiB = 2**20
GiB = 2**30


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: int
    """Total device memory."""
    bf16_tflops: float
    """Peak dense bf16 matrix rate (fp32 runs are priced at a quarter of it)."""
    intra_node_gbps: float
    """GB/s per device to the other devices of its node."""
    inter_node_gbps: float
    """GB/s per device to other nodes."""
    devices_per_node: int = 8
    efficiency: float = 0.35
    """Share of the peak matrix rate a step reaches (ranking assumption)."""
    framework_overhead: int = 0
    """Bytes held outside the counted tensors (context, communicator buffers, workspaces)."""
    fragmentation: float = 0.0
    """Allocator margin: this share of the peak on top (reserved beyond allocated)."""
    kind: str = "cuda"
    """Whose kernels the run uses: cuda, npu or cpu (they hold different scratch, see
    ``plan.memory.packed_scratch_bytes``)."""

    def with_overrides(self, **changes) -> "DeviceSpec":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


# GPU/NPU overhead and fragmentation are starting values, not measurements of this project (no
# accelerator was available when they were set): CUDA context with NCCL communicators and cuBLAS
# workspaces usually takes 2-4 GB per process on Hopper; PyTorch's caching allocator's
# reserved/allocated ratio in long MoE runs is typically 1.05-1.15. Measure and override them.
DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("NVIDIA H100 80GB (SXM)", memory_bytes=81559 * MiB, bf16_tflops=989.0,
                       intra_node_gbps=450.0, inter_node_gbps=50.0,
                       framework_overhead=3 * GiB, fragmentation=0.10),
    "h200": DeviceSpec("NVIDIA H200 141GB (SXM)", memory_bytes=143771 * MiB, bf16_tflops=989.0,
                       intra_node_gbps=450.0, inter_node_gbps=50.0,
                       framework_overhead=3 * GiB, fragmentation=0.10),
    "910b": DeviceSpec("Huawei Ascend 910B 64GB", memory_bytes=64 * GiB, bf16_tflops=313.0,
                       intra_node_gbps=196.0, inter_node_gbps=25.0,
                       framework_overhead=3 * GiB, fragmentation=0.10, kind="npu"),
}
"""Presets for ``--device``."""


def generic_device(memory_bytes: int, devices_per_node: int = 8) -> DeviceSpec:
    """A device given only by its memory (``--device-memory-gb``): H100-class rates and links."""
    base = DEVICES["h100"]
    return dataclasses.replace(base, name=f"{memory_bytes / GiB:g} GiB device",
                               memory_bytes=memory_bytes, devices_per_node=devices_per_node)
