"""The planner's price of the packed experts' decode scratch is what the device's kernel holds: on
CUDA (and on an NPU with the AscendC build) a chunk of experts as csrc/packed_scratch.h sizes it,
read back from the extension's own rule (``slmoe::packed_scratch_experts``), not from the
planner's copy of it."""

import dataclasses

import pytest
import torch

from megatron_slmoe.ops import native_extension_error
from megatron_slmoe.ops.lora_expert import PACKED_SCRATCH_BYTES
from megatron_slmoe.ops.quantized_weights import decode_chunk_bytes
from megatron_slmoe.plan import DEVICES, RunSettings, estimate_memory, load_shape
from megatron_slmoe.plan.memory import packed_scratch_bytes

MXFP4_BYTES = 0.5 + 1 / 32


def kernel_chunk(experts: int, expert_bytes: int) -> int:
    """Experts the CUDA packed kernel decodes at once: the extension's rule, run."""
    assert native_extension_error() is None, native_extension_error()
    return torch.ops.slmoe.packed_scratch_experts(experts, expert_bytes)


def packed(shape, **changes):
    return dataclasses.replace(shape, packed_expert_bytes=MXFP4_BYTES, experts_packed=True,
                               **changes)


def test_the_scratch_cap_is_the_kernels():
    """PACKED_SCRATCH_BYTES is kPackedScratchBytes: experts of one byte, the chunk is the cap."""
    assert kernel_chunk(2**40, 1) == PACKED_SCRATCH_BYTES
    assert kernel_chunk(2**40, 2 * PACKED_SCRATCH_BYTES) == 1  # at least one expert


@pytest.mark.parametrize("experts,width,ffn,ep,dtype", [
    (8, 32, 32, 1, "bf16"),         # every expert in one chunk
    (64, 2048, 1536, 2, "bf16"),    # fc1 (12 MiB) and fc2 chunks capped at 256 MiB
    (16, 8192, 8192, 4, "fp32"),    # one fc1 expert (512 MiB) over the cap: one at a time
])
def test_cuda_scratch_is_the_kernels_chunk_of_the_larger_projection(experts, width, ffn, ep,
                                                                    dtype):
    shape = packed(load_shape("tiny"), experts=experts, hidden=width, latent=None,
                   expert_ffn=ffn)
    settings = RunSettings(ep=ep, dp=ep, dtype=dtype)
    size = settings.element_size
    local = experts // ep
    fc1, fc2 = 2 * ffn * width * size, width * ffn * size  # gated: fc1 is gate|up
    want = max(kernel_chunk(local, fc1) * fc1, kernel_chunk(local, fc2) * fc2)
    assert packed_scratch_bytes(shape, settings, DEVICES["h100"]) == want
    # An NPU runs the AscendC binding's chunk (the kernel's rule) or, without that build, the
    # pure-torch twin: one tile and one decode step's intermediates (held to the measured peak in
    # tests/unit/test_packed_decode_scratch.py); the plan prices the larger, in fp32 the twin's.
    twin = fc1 + max(decode_chunk_bytes(2 * ffn, width), decode_chunk_bytes(width, ffn))
    npu = twin if dtype == "fp32" else max(twin, want)
    assert packed_scratch_bytes(shape, settings, DEVICES["910b"]) == npu
    # And it is what the stage's weights carry on each device.
    weights = {name: estimate_memory(shape, settings, DEVICES[name]).peak_stage.weights
               for name in ("h100", "910b")}
    assert weights["h100"] - weights["910b"] == want - npu


def test_k3_moe_layer_on_an_h200_at_ep_64():
    """Kimi K3 (896 experts, 3584-wide latent, 3072 ffn, MXFP4) in bf16 at EP=64: 14 experts per
    rank; fc1 [6144, 3584] (42 MiB) six at a time, fc2 [3584, 3072] twelve: 252 MiB (was priced
    as one 42 MiB tile)."""
    shape = packed(load_shape("kimi-k3"))
    settings = RunSettings(tp=8, pp=3, ep=64, dp=64)
    fc1 = 6144 * 3584 * 2
    assert kernel_chunk(896 // 64, fc1) == 6
    assert packed_scratch_bytes(shape, settings, DEVICES["h200"]) == 6 * fc1 == 252 * 2**20


def test_k3_on_an_npu_prices_the_ascendc_bindings_chunk():
    """The AscendC binding holds the CUDA kernel's chunk (csrc/ascendc/lora_expert_npu.cpp): K3 in
    bf16 at EP=64 on a 910B, six fc1 experts (252 MiB), not the pure-torch twin's one tile and a
    decode step (42 MiB + 6 MiB); in fp32 the binding decodes with ATen ops in the twin's steps."""
    shape = packed(load_shape("kimi-k3"))
    fc1 = 6144 * 3584 * 2
    chunk = kernel_chunk(896 // 64, fc1) * fc1
    bf16 = RunSettings(tp=8, pp=3, ep=64, dp=64)
    assert packed_scratch_bytes(shape, bf16, DEVICES["910b"]) == chunk == 252 * 2**20
    fp32 = dataclasses.replace(bf16, dtype="fp32")
    twin = 2 * fc1 + decode_chunk_bytes(6144, 3584)
    assert packed_scratch_bytes(shape, fp32, DEVICES["910b"]) == twin
