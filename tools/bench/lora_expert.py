"""Benchmark the grouped LoRA expert linear (CPU, or CUDA) against the usual ways of writing it.

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

CUDA (--device cuda; says it is skipped and exits 0 where there is no GPU): bf16 by default, on
DeepSeek-V3-like (7168x2048, 2048x7168) and Qwen3-30B-like (2048x768, 768x2048) expert
projections, 16 local experts, 64..2048 rows per expert, uniform and skewed groups (skewed: the
same rows spread ~1/(e+1) over the experts, two of them empty). Adds the variant

  grouped_mm   torch._grouped_mm for the base GEMM and for the LoRA shrink and expand (unfused)

and two base-only runs (rank 0: no LoRA term) that every row is compared with:

  fused_base       the native kernel without the LoRA term
  grouped_mm_base  torch._grouped_mm without the LoRA term

Times come from CUDA events. base_tflops is the base GEMM's work (fwd 2 T d_in d_out, fwd+bwd
4 T d_in d_out: W is frozen, so no dW) over the variant's time; ovh_% is the variant's time over
the fastest base-only run of the same configuration (the LoRA term's cost against the best base
GEMM available), and lora_ovh_% (JSON) the fused kernel over its own base-only run. In a few minutes
on one H200:

    python tools/bench/lora_expert.py --device cuda --json runs/bench/lora_expert_cuda.json
    python tools/bench/lora_expert.py --device cuda --quick
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch
from torch import nn

from megatron_slmoe.ops import LoRAGroupedLinear, lora_grouped_linear_reference, native_extension_error
from megatron_slmoe.utils.atomic import write_json_atomic

SCALING = 2.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Norm-relative error a correct variant stays under, per dtype (max over y, dx, dA, dB).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
VARIANTS = ("fused", "loop", "materialize", "separate")
CUDA_VARIANTS = VARIANTS + ("grouped_mm",)
BASE_VARIANTS = {"fused_base": "fused", "grouped_mm_base": "grouped_mm"}  # rank-0 runs of these
GROUPS = ("uniform", "skewed")
# The CUDA suite's expert projections (d_in, d_out), by model.
CUDA_SHAPES = {
    (7168, 2048): "deepseek_v3",  # hidden -> moe_intermediate (gate or up)
    (2048, 7168): "deepseek_v3",  # moe_intermediate -> hidden (down)
    (2048, 768): "qwen3_30b",
    (768, 2048): "qwen3_30b",
}


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
            return mods.to(weights.device, weights.dtype).requires_grad_(trainable)

        self.base = linears(weight_EOD, d_in, d_out, False)
        self.lora_a = linears(lora_a_ERD, d_in, r, True)
        self.lora_b = linears(lora_b_EOR, r, d_out, True)
        self.d_out = d_out
        # Routing indices as a router would hand them over: one expert id per row.
        self.expert_idx_T = torch.repeat_interleave(torch.arange(E), tokens_per_expert_E).to(weight_EOD.device)

    def forward(self, x_TD):
        y_TO = x_TD.new_zeros((x_TD.shape[0], self.d_out))
        for e in self.expert_idx_T.unique().tolist():
            token_idx = torch.nonzero(self.expert_idx_T == e).squeeze(1)
            x_nD = x_TD[token_idx]
            y_nO = self.base[e](x_nD) + SCALING * self.lora_b[e](self.lora_a[e](x_nD))
            y_TO.index_add_(0, token_idx, y_nO)
        return y_TO

    def lora_grads(self):
        def grad(m):  # an expert no row was routed to never saw a backward
            return m.weight.grad if m.weight.grad is not None else torch.zeros_like(m.weight)

        return torch.stack([grad(m) for m in self.lora_a]), torch.stack([grad(m) for m in self.lora_b])

    def zero_grad(self):
        for m in (*self.lora_a, *self.lora_b):
            m.weight.grad = None


class GroupedMM(Fused):
    """torch._grouped_mm (cuBLAS / CUTLASS grouped GEMM): y = x W^T + s (x A^T) B^T as three grouped GEMMs."""

    def __init__(self, *args):
        super().__init__(*args)
        if not hasattr(torch, "_grouped_mm"):
            raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm")
        # Group ends, int32 on the device, as _grouped_mm takes them.
        self.offs = torch.cumsum(self.tokens_per_expert_E, 0).to(self.weight_EOD.device, torch.int32)

    def forward(self, x_TD):
        gmm = torch._grouped_mm
        y_TO = gmm(x_TD, self.weight_EOD.transpose(-2, -1), offs=self.offs)
        if self.lora_a_ERD.shape[1] == 0:  # rank 0: the base GEMM alone
            return y_TO
        h_TR = gmm(x_TD, self.lora_a_ERD.transpose(-2, -1), offs=self.offs)
        return y_TO + SCALING * gmm(h_TR, self.lora_b_EOR.transpose(-2, -1), offs=self.offs)


VARIANT_CLASSES = {"fused": Fused, "loop": Loop, "materialize": Materialize, "separate": Separate,
                   "grouped_mm": GroupedMM}


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
    # Zero-size tensors (dA, dB at rank 0) have nothing to compare.
    return max(((g.double() - w).norm() / w.norm()).item() for g, w in zip(got, want) if w.numel())


def median_ms(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def checked_variants(experts, rows, rank, d_in, d_out, dtype_name, names):
    """The inputs of one configuration, a row per variant in ``names`` (status "ok" or why it is
    not timed) and the variants that agree with the fp64 reference, by name."""
    dtype = DTYPES[dtype_name]
    inp = make_inputs(experts, rows, rank, d_in, d_out, dtype)
    want = reference(inp)
    common = dict(device="cpu", dtype=dtype_name, experts=experts, rows_per_expert=rows, rank=rank,
                  d_in=d_in, d_out=d_out, threads=torch.get_num_threads())
    rows_out, variants = [], {}
    for name in names:
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
        variants[name] = variant
    return inp, rows_out, variants


def bench_config(experts, rows, rank, d_in, d_out, args):
    inp, rows_out, variants = checked_variants(experts, rows, rank, d_in, d_out, args.dtype,
                                               args.variants)
    for row in rows_out:
        variant = variants.get(row["variant"])
        if variant is None:
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


# ---------------------------------------------------------------------------------------------
# CUDA


def group_counts(experts, rows, groups):
    """Rows per expert: `rows` each (uniform), or the same total spread ~1/(e+1) with two experts empty."""
    if groups == "uniform":
        return [rows] * experts
    weights = [1.0 / (e + 1) for e in range(experts)]
    if experts > 2:
        weights[experts // 3] = weights[experts - 1] = 0.0
    total = experts * rows
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted((e for e in range(experts) if weights[e] > 0), key=lambda e: counts[e] - exact[e])
    for e in by_remainder[: total - sum(counts)]:  # largest remainders first
        counts[e] += 1
    return counts


def make_device_inputs(counts, rank, d_in, d_out, dtype, device, seed=0):
    """As make_inputs, for any group sizes, drawn on the device (fast for the big shapes)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, fan_in):
        return (torch.randn(*shape, generator=g, device=device) / math.sqrt(fan_in)).to(dtype)

    E, T = len(counts), sum(counts)
    return dict(
        x_TD=rand(T, d_in, fan_in=1),
        weight_EOD=rand(E, d_out, d_in, fan_in=d_in),
        lora_a_ERD=rand(E, rank, d_in, fan_in=d_in),
        lora_b_EOR=rand(E, d_out, rank, fan_in=max(rank, 1)),
        tokens_per_expert_E=torch.tensor(counts, dtype=torch.int64),  # the op takes it on the CPU
        grad_y_TO=rand(T, d_out, fan_in=1),
    )


def median_ms_cuda(fn, warmup, reps):
    """Median over reps of the time between CUDA events around fn (host gaps included)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def first_line(exc):
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:160]


def bench_cuda_variant(name, cls_name, inp, want, args, common):
    """One row: checked against the fp64 reference first, timed only if it agrees."""
    dtype = DTYPES[args.dtype]
    row = dict(common, variant=name, rank=inp["lora_a_ERD"].shape[1], fwd_ms=None, fwd_bwd_ms=None,
               max_rel_err=None, status="ok")
    try:
        variant = VARIANT_CLASSES[cls_name](inp["weight_EOD"], inp["lora_a_ERD"], inp["lora_b_EOR"],
                                            inp["tokens_per_expert_E"])
        row["max_rel_err"] = max_rel_err(step(variant, inp["x_TD"], inp["grad_y_TO"]), want)
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:  # e.g. _grouped_mm's limits
        row["status"] = f"unavailable: {first_line(exc)}"
        return row
    if not row["max_rel_err"] <= TOLERANCE[dtype]:  # also catches NaN
        row["status"] = f"mismatch: error {row['max_rel_err']:.2e} over {TOLERANCE[dtype]:.0e}, not timed"
        return row
    x_TD = inp["x_TD"].detach().requires_grad_()
    row["fwd_ms"] = median_ms_cuda(lambda: variant.forward(x_TD), args.warmup, args.reps)
    row["fwd_bwd_ms"] = median_ms_cuda(lambda: step(variant, inp["x_TD"], inp["grad_y_TO"]), args.warmup, args.reps)
    return row


def bench_cuda_config(experts, rows, groups, rank, d_in, d_out, args):
    dtype = DTYPES[args.dtype]
    counts = group_counts(experts, rows, groups)
    T = sum(counts)
    inp = make_device_inputs(counts, rank, d_in, d_out, dtype, "cuda")
    common = dict(device="cuda", dtype=args.dtype, model=CUDA_SHAPES.get((d_in, d_out), "-"), experts=experts,
                  rows_per_expert=rows, groups=groups, max_rows=max(counts), empty_experts=counts.count(0),
                  d_in=d_in, d_out=d_out)
    rows_out = []
    want = reference(inp)
    for name in args.variants:
        rows_out.append(bench_cuda_variant(name, name, inp, want, args, common))
    del want
    # Base-only: the same inputs at rank 0.
    base_inp = dict(inp, lora_a_ERD=inp["lora_a_ERD"][:, :0], lora_b_EOR=inp["lora_b_EOR"][:, :, :0])
    want = reference(base_inp)
    for name, cls_name in BASE_VARIANTS.items():
        rows_out.append(bench_cuda_variant(name, cls_name, base_inp, want, args, common))
    del want, inp, base_inp

    flops = {"fwd": 2.0 * T * d_in * d_out, "fwd_bwd": 4.0 * T * d_in * d_out}  # W frozen: no dW
    by_name = {r["variant"]: r for r in rows_out}
    for key in ("fwd", "fwd_bwd"):
        base_times = [by_name[b][f"{key}_ms"] for b in BASE_VARIANTS if by_name[b][f"{key}_ms"]]
        best_base = min(base_times) if base_times else None
        own_base = by_name["fused_base"][f"{key}_ms"]
        loop = by_name.get("loop", {}).get(f"{key}_ms")
        for row in rows_out:
            ms = row[f"{key}_ms"]
            row[f"{key}_base_tflops"] = flops[key] / (ms * 1e-3) / 1e12 if ms else None
            row[f"{key}_ovh_pct"] = (ms / best_base - 1) * 100 if ms and best_base else None
            row[f"{key}_x_loop"] = loop / ms if ms and loop else None
            if row["variant"] == "fused":
                row[f"{key}_lora_ovh_pct"] = (ms / own_base - 1) * 100 if ms and own_base else None
    return rows_out


CUDA_COLS = [("model", 11, "s"), ("d_in", 5, "d"), ("d_out", 5, "d"), ("experts", 7, "d"), ("groups", 7, "s"),
             ("rows_per_expert", 5, "d"), ("rank", 4, "d"), ("variant", 15, "s"), ("fwd_ms", 8, ".3f"),
             ("fwd_bwd_ms", 10, ".3f"), ("fwd_base_tflops", 8, ".1f"), ("fwd_bwd_base_tflops", 8, ".1f"),
             ("fwd_ovh_pct", 7, ".1f"), ("fwd_bwd_ovh_pct", 7, ".1f"), ("max_rel_err", 11, ".1e")]
CUDA_TITLES = {"rows_per_expert": "rows", "fwd_base_tflops": "fwd_TF/s", "fwd_bwd_base_tflops": "f+b_TF/s",
               "fwd_ovh_pct": "fwd_ovh%", "fwd_bwd_ovh_pct": "f+b_ovh%"}


def print_cuda_row(row, header=False):
    if header:
        print(" ".join(f"{CUDA_TITLES.get(c, c):>{w}}" for c, w, _ in CUDA_COLS) + "  status")
        return
    cells = [f"{fmt(row.get(c), spec):>{w}}" for c, w, spec in CUDA_COLS]
    print(" ".join(cells) + ("" if row["status"] == "ok" else f"  {row['status']}"), flush=True)


def main_cuda(args):
    if not torch.cuda.is_available():
        print("lora_expert bench: --device cuda skipped, torch.cuda.is_available() is False")
        return 0
    if native_extension_error() is not None:
        print(f"lora_expert bench: the native extension did not load: {native_extension_error()}")
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name()}, dtype {args.dtype}, "
          f"warmup {args.warmup}, reps {args.reps}, grouped_mm {'yes' if hasattr(torch, '_grouped_mm') else 'no'}")
    print_cuda_row(None, header=True)
    rows = []
    for d_in, d_out in args.shapes:
        for experts in args.experts:
            for rows_per_expert in args.rows_per_expert:
                for groups in args.groups:
                    for rank in args.ranks:
                        for row in bench_cuda_config(experts, rows_per_expert, groups, rank, d_in, d_out, args):
                            print_cuda_row(row)
                            rows.append(row)
    write_json(rows, args.json)
    # Our kernel must run and agree; a baseline torch cannot run here (e.g. _grouped_mm's alignment
    # rules) is reported, not a failure.
    bad = [r for r in rows if r["status"].startswith("mismatch")
           or (r["variant"] in ("fused", "fused_base") and r["status"] != "ok")]
    return 1 if bad else 0


def write_json(rows, path):
    if not path:
        return
    write_json_atomic(path, rows, indent=1)
    print(f"wrote {len(rows)} rows to {path}")


# ---------------------------------------------------------------------------------------------


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
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the GPU suite (see the module docstring); skipped where there is no GPU")
    p.add_argument("--quick", action="store_true", help="small shapes and few reps, for a smoke run")
    p.add_argument("--experts", type=positive_int, nargs="+", help="local experts (default 8 64 256; cuda 16)")
    p.add_argument("--rows-per-expert", type=positive_int, nargs="+",
                   help="default 16 64 256; cuda 64 256 1024 2048")
    p.add_argument("--groups", choices=GROUPS, nargs="+", default=list(GROUPS),
                   help="cuda: uniform and/or skewed group sizes (default both)")
    p.add_argument("--ranks", type=positive_int, nargs="+", help="LoRA ranks (default 8 16; cuda 16)")
    p.add_argument("--shapes", type=shape, nargs="+",
                   help="d_in x d_out (default 256x128 128x256; cuda 7168x2048 2048x7168 2048x768 768x2048)")
    p.add_argument("--variants", nargs="+", choices=CUDA_VARIANTS,
                   help=f"default {' '.join(VARIANTS)}; cuda adds grouped_mm")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default float32; cuda bfloat16")
    p.add_argument("--warmup", type=positive_int, help="untimed runs per measurement (default 2, quick 1; cuda 3)")
    p.add_argument("--reps", type=positive_int, help="timed runs per measurement (default 5; cuda 10)")
    p.add_argument("--json", metavar="FILE", help="write the rows as a JSON list")
    args = p.parse_args(argv)
    quick = args.quick
    if args.device == "cuda":
        defaults = dict(
            experts=[16],
            rows_per_expert=[64, 512] if quick else [64, 256, 1024, 2048],
            ranks=[16],
            shapes=[(2048, 768), (768, 2048)] if quick else list(CUDA_SHAPES),
            variants=list(CUDA_VARIANTS),
            dtype="bfloat16",
            warmup=1 if quick else 3,
            reps=5 if quick else 10,
        )
    else:
        defaults = dict(
            experts=[8, 64] if quick else [8, 64, 256],
            rows_per_expert=[16, 64] if quick else [16, 64, 256],
            ranks=[8, 16],
            shapes=[(128, 64)] if quick else [(256, 128), (128, 256)],
            variants=list(VARIANTS),
            dtype="float32",
            warmup=1 if quick else 2,
            reps=5,
        )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda":
        return main_cuda(args)
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
    write_json(rows, args.json)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
