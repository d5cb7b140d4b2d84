#!/usr/bin/env python
"""Bytes resident for one routed-expert layer with the experts kept packed (as the checkpoint ships
them) against the same experts dequantised to BF16, and the scratch the packed LoRA expert op adds.

Each layer's experts are PackedWeight values of the real shapes (the bytes counted are those of
the packed tensors and scales the op keeps; nothing is estimated): Kimi K3 (MXFP4, 896 experts in
the 3584-wide latent, w1/w3 3072x3584, w2 3584x3072), Kimi-K2.5 (INT4 pack-quantized group 32, 384
experts, 2048x7168 and 7168x2048) and DeepSeek-V3 (block FP8 128x128, 256 experts, the same shapes).
The op's scratch is one decoded expert matrix per thread in the compute dtype (bf16), for the call
only.

    python tools/bench/packed_experts.py [--json out.json]

``--speed``: the packed LoRA expert op against the same op on the experts dequantised to BF16 (the
baseline, in the same run), forward + backward (dx, dA, dB), one projection of each model above at
its real shape (K3 w1 3072x3584 MXFP4, Kimi-K2.5 w1 2048x7168 INT4 group 32, DeepSeek-V3 w1
2048x7168 FP8 128x128), ``--experts`` local experts of ``--tokens-per-expert`` rows each, bf16.
Each row gives the parity (max norm-relative difference of y, dx, dA, dB between the two: the
packed op decodes into a tile and runs the same GEMMs, so 0 is expected), both medians and
``packed_speed`` = dense time / packed time (target >= 0.8), with the load average of the machine:

    python tools/bench/packed_experts.py --speed [--device cpu|cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megatron_slmoe.ops import lora_grouped_linear  # noqa: E402
from megatron_slmoe.ops import quantized_weights as qw  # noqa: E402
from megatron_slmoe.ops._native import choose_backend  # noqa: E402

# name, format, experts, (gate/up rows, cols), (down rows, cols), group or block
MODELS = [
    ("Kimi K3 (latent MoE)", qw.MXFP4, 896, (3072, 3584), (3584, 3072), (1, 32)),
    ("Kimi-K2.5", qw.INT4, 384, (2048, 7168), (7168, 2048), (1, 32)),
    ("DeepSeek-V3", qw.BLOCK_FP8, 256, (2048, 7168), (7168, 2048), (128, 128)),
]


def one_matrix(fmt: str, rows: int, cols: int, block: tuple[int, int]) -> qw.PackedWeight:
    """A packed [rows, cols] weight of zeros in ``fmt``: real tensors, so nbytes is what is held."""
    scale_shape = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if fmt == qw.MXFP4:
        packed = torch.zeros(rows, cols // 2, dtype=torch.uint8)
        scale = torch.zeros(scale_shape, dtype=torch.uint8)
    elif fmt == qw.INT4:
        packed = torch.zeros(rows, cols // 8, dtype=torch.int32)
        scale = torch.ones(scale_shape, dtype=torch.bfloat16)
    else:
        packed = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
        scale = torch.ones(scale_shape, dtype=torch.float32)
    return qw.PackedWeight(fmt, packed, scale, (rows, cols), block)


def layer_row(name, fmt, experts, up_shape, down_shape, block, threads) -> dict:
    matrices = [one_matrix(fmt, *up_shape, block), one_matrix(fmt, *up_shape, block),
                one_matrix(fmt, *down_shape, block)]  # w1 (gate), w3 (up), w2 (down)
    packed = experts * sum(m.nbytes for m in matrices)
    bf16 = experts * sum(qw.bf16_bytes(m) for m in matrices)
    scratch = threads * max(qw.bf16_bytes(m) for m in matrices)
    return {"model": name, "format": fmt, "experts": experts,
            "expert_bytes_packed": packed // experts, "layer_bytes_packed": packed,
            "layer_bytes_bf16": bf16, "packed_over_bf16": packed / bf16,
            "scratch_bytes": scratch, "threads": threads}


# --- speed: packed op vs the op on the BF16-dequantised experts ----------------------------------

RANK, SCALING = 16, 2.0


def random_packed(fmt, experts, rows, cols, block, g, device) -> qw.PackedWeight:
    """Random bytes (every code occurs) with scales that keep the weights near 1/sqrt(cols)."""
    if fmt == qw.MXFP4:
        packed = torch.randint(0, 256, (experts, rows, cols // 2), generator=g).to(torch.uint8)
        scale = torch.randint(118, 124, (experts, rows, cols // 32), generator=g).to(torch.uint8)
    elif fmt == qw.INT4:
        packed = torch.randint(-2**31, 2**31, (experts, rows, cols // 8), generator=g,
                               dtype=torch.int64).to(torch.int32)
        scale = (torch.rand(experts, rows, cols // block[1], generator=g) / (4 * cols**0.5)).to(
            torch.bfloat16)
    else:
        codes = torch.randint(0, 256, (experts, rows, cols), generator=g)
        packed = torch.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes).to(torch.uint8).view(
            torch.float8_e4m3fn)
        scale = torch.rand(experts, math.ceil(rows / block[0]), math.ceil(cols / block[1]),
                           generator=g) / (100 * cols**0.5)
    return qw.PackedWeight(fmt, packed, scale, (rows, cols), block).to(device)


def fwd_bwd(x, weight, a, b, counts, grad_y):
    """y and the gradients of x, A, B of one training step of the op."""
    x, a, b = (t.detach().requires_grad_() for t in (x, a, b))
    y = lora_grouped_linear(x, weight, a, b, counts, SCALING)
    y.backward(grad_y)
    return y.detach(), x.grad, a.grad, b.grad


def median_ms(fn, device, warmup, reps) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def speed_row(name, fmt, up_shape, block, args, device) -> dict:
    g = torch.Generator().manual_seed(0)
    rows, cols = up_shape
    E, n = args.experts, args.tokens_per_expert
    packed = random_packed(fmt, E, rows, cols, block, g, device)
    dense = packed.decode(torch.bfloat16)  # the baseline: the experts held dequantised

    def rand(*shape, fan_in=1):
        return (torch.randn(*shape, generator=g) / fan_in**0.5).to(torch.bfloat16).to(device)

    x, grad_y = rand(E * n, cols), rand(E * n, rows)
    a, b = rand(E, RANK, cols, fan_in=cols), rand(E, rows, RANK, fan_in=RANK)
    counts = torch.full((E,), n, dtype=torch.int64)
    got = fwd_bwd(x, packed, a, b, counts, grad_y)
    want = fwd_bwd(x, dense, a, b, counts, grad_y)
    parity = max(float((p.double() - d.double()).norm() / d.double().norm()) for p, d in zip(got, want))
    dense_ms = median_ms(lambda: fwd_bwd(x, dense, a, b, counts, grad_y), device, args.warmup, args.reps)
    packed_ms = median_ms(lambda: fwd_bwd(x, packed, a, b, counts, grad_y), device, args.warmup, args.reps)
    return {"model": name, "format": fmt, "shape": [rows, cols], "experts": E, "tokens_per_expert": n,
            "rank": RANK, "device": str(device), "dtype": "bfloat16",
            "backend_packed": choose_backend("lora_grouped_linear_packed", device),
            "backend_dense": choose_backend("lora_grouped_linear", device),
            "parity_max_rel": parity, "dense_bf16_ms": dense_ms, "packed_ms": packed_ms,
            "packed_speed": dense_ms / packed_ms, "target": 0.8,
            "weight_bytes_packed": packed.nbytes, "weight_bytes_bf16": qw.bf16_bytes(packed)}


def main_speed(args) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("packed_experts --speed: skipped, no CUDA device")
        return 0
    load = open("/proc/loadavg", encoding="utf-8").read().split()[:3]
    rows = [speed_row(name, fmt, up, block, args, device) for name, fmt, _, up, _, block in MODELS]
    print(f"packed LoRA expert op vs the op on BF16-dequantised experts, fwd+bwd, {device}, "
          f"{args.experts} experts x {args.tokens_per_expert} rows, rank {RANK}; load average "
          f"{' '.join(load)}")
    print(f"{'model':22} {'format':22} {'shape':>10} {'backend':>9} {'parity':>8} {'dense ms':>9} "
          f"{'packed ms':>9} {'packed speed':>12}")
    for r in rows:
        print(f"{r['model']:22} {r['format']:22} {r['shape'][0]:>4}x{r['shape'][1]:<5} "
              f"{r['backend_packed']:>9} {r['parity_max_rel']:8.1e} {r['dense_bf16_ms']:9.1f} "
              f"{r['packed_ms']:9.1f} {r['packed_speed']:8.2f} {'ok' if r['packed_speed'] >= 0.8 else 'LOW'}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"load_average": load, "rows": rows}, f, indent=1)
    return 1 if any(r["parity_max_rel"] > 0 for r in rows) else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="threads whose scratch tiles to count (default: torch's)")
    parser.add_argument("--speed", action="store_true",
                        help="time the packed op against the op on BF16-dequantised experts")
    parser.add_argument("--device", default="cpu", help="--speed: cpu or cuda (default cpu)")
    parser.add_argument("--experts", type=int, default=None,
                        help="--speed: local experts (default 4 on cpu, 32 on cuda)")
    parser.add_argument("--tokens-per-expert", type=int, default=None,
                        help="--speed: rows per expert (default 128 on cpu, 512 on cuda)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    if args.speed:
        cuda = args.device.startswith("cuda")
        args.experts = args.experts or (32 if cuda else 4)
        args.tokens_per_expert = args.tokens_per_expert or (512 if cuda else 128)
        if min(args.experts, args.tokens_per_expert, args.warmup + 1, args.reps) < 1:
            print("packed_experts: --experts, --tokens-per-expert and --reps must be positive", file=sys.stderr)
            return 2
        return main_speed(args)
    rows = [layer_row(*model, args.threads) for model in MODELS]
    gib = 2**30
    print(f"{'model':22} {'format':22} {'experts':>7} {'bytes/expert':>13} {'layer packed':>13} "
          f"{'layer bf16':>11} {'packed/bf16':>11} {'scratch':>9}")
    for r in rows:
        print(f"{r['model']:22} {r['format']:22} {r['experts']:7d} {r['expert_bytes_packed']:13,d} "
              f"{r['layer_bytes_packed'] / gib:10.2f} GiB {r['layer_bytes_bf16'] / gib:7.2f} GiB "
              f"{r['packed_over_bf16']:11.3f} {r['scratch_bytes'] / 2**20:5.0f} MiB")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
