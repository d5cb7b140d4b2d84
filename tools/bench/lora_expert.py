"""Benchmark the grouped LoRA expert linear on CPU against the usual ways of writing it.

Variants (each computes y = x W_e^T + s (x A_e^T) B_e^T per expert, W frozen, A and B trained):
  fused        the native kernel (torch.ops.slmoe via LoRAGroupedLinear)
  loop         the tutorial loop: per expert present in the routing indices, select its rows with a
               boolean mask, apply the frozen base and that expert's pair of LoRA nn.Linear,
               scatter-add back
  materialize  W_e + s B_e A_e per expert (one batched op), then one GEMM per expert
  separate     base GEMM plus separate shrink and expand per expert over contiguous row slices

Every variant is first checked against the fp64 reference (y, dx, dA, dB); one that disagrees is
reported and not timed. Times are medians after warmup; fwd_ms records the autograd graph as a
training forward does. x_loop columns are loop's time over the variant's (above 1: faster than loop).

    python tools/bench/lora_expert.py --quick
    python tools/bench/lora_expert.py --experts 64 --json runs/bench_lora_expert.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
from torch import nn

from megatron_slmoe.ops import LoRAGroupedLinear, lora_grouped_linear_reference, native_extension_error

SCALING = 2.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Norm-relative error a correct variant stays under, per dtype (max over y, dx, dA, dB).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
VARIANTS = ("fused", "loop", "materialize", "separate")


class Fused:
    def __init__(self, weight_EOD, lora_a_ERD, lora_b_EOR, tokens_per_expert_E):
        self.weight_EOD, self.tokens_per_expert_E = weight_EOD, tokens_per_expert_E
        self.lora_a_ERD = lora_a_ERD.clone().requires_grad_()
        self.lora_b_EOR = lora_b_EOR.clone().requires_grad_()

    def forward(self, x_TD):
        return LoRAGroupedLinear.apply(
            x_TD, self.weight_EOD, self.lora_a_ERD, self.lora_b_EOR, self.tokens_per_expert_E, SCALING
        )

    def lora_grads(self):
        return self.lora_a_ERD.grad, self.lora_b_EOR.grad

    def zero_grad(self):
        self.lora_a_ERD.grad = self.lora_b_EOR.grad = None


class Separate(Fused):
    def __init__(self, *args):
        super().__init__(*args)
        self.counts = self.tokens_per_expert_E.tolist()

    def forward(self, x_TD):
        w, a, b = self.weight_EOD, self.lora_a_ERD, self.lora_b_EOR
        parts = [x_nD @ w[e].T + SCALING * ((x_nD @ a[e].T) @ b[e].T) for e, x_nD in enumerate(x_TD.split(self.counts))]
        return torch.cat(parts)


class Materialize(Separate):
    def forward(self, x_TD):
        w_eff_EOD = torch.baddbmm(self.weight_EOD, self.lora_b_EOR, self.lora_a_ERD, alpha=SCALING)
        return torch.cat([x_nD @ w_eff_EOD[e].T for e, x_nD in enumerate(x_TD.split(self.counts))])


class Loop:
    def __init__(self, weight_EOD, lora_a_ERD, lora_b_EOR, tokens_per_expert_E):
        E, d_out, d_in = weight_EOD.shape
        r = lora_a_ERD.shape[1]

        def linears(weights, d_from, d_to, trainable):
            mods = nn.ModuleList(nn.Linear(d_from, d_to, bias=False) for _ in range(E))
            with torch.no_grad():
                for mod, w in zip(mods, weights):
                    mod.weight.copy_(w)
            return mods.to(weights.dtype).requires_grad_(trainable)

        self.base = linears(weight_EOD, d_in, d_out, False)
        self.lora_a = linears(lora_a_ERD, d_in, r, True)
        self.lora_b = linears(lora_b_EOR, r, d_out, True)
        self.d_out = d_out
        # Routing indices as a router would hand them over: one expert id per row.
        self.expert_idx_T = torch.repeat_interleave(torch.arange(E), tokens_per_expert_E)

    def forward(self, x_TD):
        y_TO = x_TD.new_zeros((x_TD.shape[0], self.d_out))
        for e in self.expert_idx_T.unique().tolist():
            token_idx = torch.nonzero(self.expert_idx_T == e).squeeze(1)
            x_nD = x_TD[token_idx]
            y_nO = self.base[e](x_nD) + SCALING * self.lora_b[e](self.lora_a[e](x_nD))
            y_TO.index_add_(0, token_idx, y_nO)
        return y_TO

    def lora_grads(self):
        return (torch.stack([m.weight.grad for m in self.lora_a]), torch.stack([m.weight.grad for m in self.lora_b]))

    def zero_grad(self):
        for m in (*self.lora_a, *self.lora_b):
            m.weight.grad = None


VARIANT_CLASSES = {"fused": Fused, "loop": Loop, "materialize": Materialize, "separate": Separate}


def make_inputs(experts, rows, rank, d_in, d_out, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, fan_in):
        return (torch.randn(*shape, generator=g) / math.sqrt(fan_in)).to(dtype)

    T = experts * rows
    return dict(
        x_TD=rand(T, d_in, fan_in=1),
        weight_EOD=rand(experts, d_out, d_in, fan_in=d_in),
        lora_a_ERD=rand(experts, rank, d_in, fan_in=d_in),
        lora_b_EOR=rand(experts, d_out, rank, fan_in=rank),
        tokens_per_expert_E=torch.full((experts,), rows, dtype=torch.int64),
        grad_y_TO=rand(T, d_out, fan_in=1),
    )


def step(variant, x_TD, grad_y_TO):
    """One forward + backward; returns y, dx, dA, dB."""
    variant.zero_grad()
    x_TD = x_TD.detach().requires_grad_()
    y_TO = variant.forward(x_TD)
    y_TO.backward(grad_y_TO)
    return (y_TO.detach(), x_TD.grad, *variant.lora_grads())


def reference(inp):
    """fp64 y, dx, dA, dB from the pure-torch reference on the same (rounded) inputs."""
    x = inp["x_TD"].double().requires_grad_()
    a = inp["lora_a_ERD"].double().requires_grad_()
    b = inp["lora_b_EOR"].double().requires_grad_()
    y = lora_grouped_linear_reference(x, inp["weight_EOD"].double(), a, b, inp["tokens_per_expert_E"], SCALING)
    y.backward(inp["grad_y_TO"].double())
    return y.detach(), x.grad, a.grad, b.grad


def max_rel_err(got, want):
    return max(((g.double() - w).norm() / w.norm()).item() for g, w in zip(got, want))


def median_ms(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench_config(experts, rows, rank, d_in, d_out, args):
    dtype = DTYPES[args.dtype]
    inp = make_inputs(experts, rows, rank, d_in, d_out, dtype)
    want = reference(inp)
    common = dict(device="cpu", dtype=args.dtype, experts=experts, rows_per_expert=rows, rank=rank,
                  d_in=d_in, d_out=d_out, threads=torch.get_num_threads())
    rows_out = []
    for name in args.variants:
        row = dict(common, variant=name, fwd_ms=None, fwd_bwd_ms=None, max_rel_err=None, status="ok")
        rows_out.append(row)
        if name == "fused" and native_extension_error() is not None:
            row["status"] = f"unavailable: {native_extension_error()}"
            continue
        variant = VARIANT_CLASSES[name](inp["weight_EOD"], inp["lora_a_ERD"], inp["lora_b_EOR"],
                                        inp["tokens_per_expert_E"])
        row["max_rel_err"] = max_rel_err(step(variant, inp["x_TD"], inp["grad_y_TO"]), want)
        if not row["max_rel_err"] <= TOLERANCE[dtype]:  # also catches NaN
            row["status"] = f"mismatch: error {row['max_rel_err']:.2e} over {TOLERANCE[dtype]:.0e}, not timed"
            continue
        x_TD = inp["x_TD"].detach().requires_grad_()
        row["fwd_ms"] = median_ms(lambda: variant.forward(x_TD), args.warmup, args.reps)
        row["fwd_bwd_ms"] = median_ms(lambda: step(variant, inp["x_TD"], inp["grad_y_TO"]), args.warmup, args.reps)
    loop = next((r for r in rows_out if r["variant"] == "loop"), None)
    for row in rows_out:
        for key in ("fwd", "fwd_bwd"):
            mine, base = row[f"{key}_ms"], loop and loop[f"{key}_ms"]
            row[f"{key}_x_loop"] = base / mine if mine and base else None
    return rows_out


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def print_row(row, header=False):
    cols = [("experts", 7, "d"), ("rows_per_expert", 5, "d"), ("rank", 4, "d"), ("d_in", 5, "d"),
            ("d_out", 5, "d"), ("variant", 11, "s"), ("fwd_ms", 9, ".2f"), ("fwd_bwd_ms", 10, ".2f"),
            ("fwd_x_loop", 10, ".2f"), ("fwd_bwd_x_loop", 14, ".2f"), ("max_rel_err", 11, ".1e")]
    titles = {"rows_per_expert": "rows", "fwd_bwd_x_loop": "fwd_bwd_x_loop"}
    if header:
        print(" ".join(f"{titles.get(c, c):>{w}}" for c, w, _ in cols) + "  status")
        return
    cells = [f"{fmt(row[c], s):>{w}}" for c, w, s in cols]
    print(" ".join(cells) + ("" if row["status"] == "ok" else f"  {row['status']}"), flush=True)


def positive_int(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def shape(text):
    try:
        d_in, d_out = (positive_int(p) for p in text.lower().split("x"))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"shape must look like 256x128 (d_in x d_out), got {text!r}") from None
    return d_in, d_out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes and few reps, for a smoke run")
    p.add_argument("--experts", type=positive_int, nargs="+", help="local experts (default 8 64 256)")
    p.add_argument("--rows-per-expert", type=positive_int, nargs="+", help="default 16 64 256")
    p.add_argument("--ranks", type=positive_int, nargs="+", help="LoRA ranks (default 8 16)")
    p.add_argument("--shapes", type=shape, nargs="+", help="d_in x d_out (default 256x128 128x256)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--warmup", type=positive_int, help="untimed runs per measurement (default 2, quick 1)")
    p.add_argument("--reps", type=positive_int, help="timed runs per measurement (default 5)")
    p.add_argument("--json", metavar="FILE", help="write the rows as a JSON list")
    args = p.parse_args(argv)
    quick = args.quick
    defaults = dict(
        experts=[8, 64] if quick else [8, 64, 256],
        rows_per_expert=[16, 64] if quick else [16, 64, 256],
        ranks=[8, 16],
        shapes=[(128, 64)] if quick else [(256, 128), (128, 256)],
        warmup=1 if quick else 2,
        reps=5,
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None):
    args = parse_args(argv)
    print(f"torch {torch.__version__}, device cpu, dtype {args.dtype}, threads {torch.get_num_threads()}, "
          f"warmup {args.warmup}, reps {args.reps}")
    print_row(None, header=True)
    rows = []
    for experts in args.experts:
        for rows_per_expert in args.rows_per_expert:
            for rank in args.ranks:
                for d_in, d_out in args.shapes:
                    for row in bench_config(experts, rows_per_expert, rank, d_in, d_out, args):
                        print_row(row)
                        rows.append(row)
    if args.json:
        # Write whole or not at all: a temp file renamed into place.
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        tmp = f"{args.json}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
        os.replace(tmp, args.json)
        print(f"wrote {len(rows)} rows to {args.json}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
