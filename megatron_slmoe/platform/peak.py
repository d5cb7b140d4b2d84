"""The peak dense matrix rate of this process's device, the denominator of MFU.

On a GPU or NPU it is the datasheet's (what Megatron users compare against); on a CPU there is no
datasheet that means anything for a process with N threads, so it is measured once: the best of a
few large square GEMMs in the run's dtype with this process's threads, cached per machine (CPU
model, threads, dtype) in the node cache directory so that later runs do not measure again.
"""

from __future__ import annotations

import json
import os
import platform as host
import time
from typing import Optional

import torch

from megatron_slmoe.utils.atomic import write_json_atomic

DATASHEET_TFLOPS = {  # dense bf16 (fp32: a quarter); substring of the device name -> TFLOP/s
    "H200": 989.0, "H100": 989.0, "A100": 312.0, "910B": 313.0,
}

GEMM_SIZE = 2048
REPEATS = 3


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return host.processor() or host.machine()


def _cache_file() -> str:
    root = os.environ.get("SLMOE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "megatron_slmoe")
    return os.path.join(root, "peak_flops.json")


def measure_cpu_gemm_flops(dtype: torch.dtype, size: int = GEMM_SIZE) -> float:
    """FLOP/s of the best of a few ``size``-cubed GEMMs with this process's threads."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm up
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def peak_flops(device: torch.device, dtype: torch.dtype) -> Optional[float]:
    """Peak FLOP/s of one device (a CPU process: its threads), or None where it is unknown."""
    if device.type in ("cuda", "npu"):
        name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                else getattr(torch, "npu").get_device_name(device))
        tflops = next((v for k, v in DATASHEET_TFLOPS.items() if k in name), None)
        if tflops is None:
            return None
        return tflops * 1e12 * (1.0 if dtype in (torch.bfloat16, torch.float16) else 0.25)
    key = f"{_cpu_model()}|threads={torch.get_num_threads()}|{str(dtype).removeprefix('torch.')}"
    path = _cache_file()
    try:
        with open(path, encoding="utf-8") as f:
            cached = json.load(f)
    except (OSError, ValueError):
        cached = {}
    if isinstance(cached, dict) and isinstance(cached.get(key), (int, float)):
        return float(cached[key])
    measured = measure_cpu_gemm_flops(dtype)
    try:
        write_json_atomic(path, {**(cached if isinstance(cached, dict) else {}), key: measured})
    except OSError:
        pass  # measured again next time
    return measured
