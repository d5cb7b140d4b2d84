"""The pure-torch packed expert op (what an NPU runs without the AscendC build, and any device
with SLMOE_KERNELS=reference) holds one decoded tile per call plus one decode step's intermediates,
as the planner prices it (``plan.memory.packed_scratch_bytes``): the live tensor bytes of a
forward and of a backward, counted by ``plan.live_bytes``, for every format, at a tile large
against a decode step (decoding a whole tile at once held 7-11 tiles' worth at its peak)."""

import pytest
import torch

from megatron_slmoe.ops import KERNELS_ENV, PackedWeight, lora_grouped_linear
from megatron_slmoe.ops import quantized_weights as qw
from megatron_slmoe.plan.live_bytes import LiveTensorBytes

E, OUT, IN, R = 3, 1024, 1024, 4
COUNTS = [5, 0, 7]
FORMATS = [(qw.MXFP4, {}), (qw.INT4, {"group_size": 32}), (qw.BLOCK_FP8, {"block": (128, 128)})]


@pytest.mark.parametrize("fmt, kw", FORMATS, ids=[f for f, _ in FORMATS])
def test_a_call_holds_one_tile_and_one_decode_step(fmt, kw, monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "reference")
    T, tile = sum(COUNTS), OUT * IN * 2
    # Row-sized temporaries of the LoRA shrink/expand and the GEMMs (a few rows of x or y each).
    rows = 8 * T * max(IN, OUT) * 4
    # Every input is made inside the count (a view of a storage made before it would count as new).
    with LiveTensorBytes() as live:
        g = torch.Generator().manual_seed(0)
        weight = PackedWeight.encode(torch.randn(E, OUT, IN, generator=g) / 32, fmt, **kw)
        x = torch.randn(T, IN, generator=g).bfloat16().requires_grad_()
        a = (torch.randn(E, R, IN, generator=g) / 32).bfloat16().requires_grad_()
        b = (torch.randn(E, OUT, R, generator=g) / 2).bfloat16().requires_grad_()
        grad_y = torch.randn(T, OUT, generator=g).bfloat16()
        live.reset_peak()
        inputs = live.current
        y = lora_grouped_linear(x, weight, a, b, torch.tensor(COUNTS), 2.0)
        forward_peak = live.peak - inputs
        live.reset_peak()
        before_backward = live.current
        y.backward(grad_y)
        backward_peak = live.peak - before_backward
    step = qw.decode_chunk_bytes(OUT, IN, weight.block[0])
    assert tile + step + rows < 7 * tile  # a whole-tile decode (7-11 tiles at its peak) fails
    assert tile <= forward_peak <= tile + step + rows, (forward_peak, tile, step)
    gradients = sum(t.numel() * t.element_size() for t in (x.grad, a.grad, b.grad))
    assert tile <= backward_peak <= tile + step + rows + gradients, (backward_peak, tile, step)
