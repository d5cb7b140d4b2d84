"""Benchmark the CPU paths of Kimi Delta Attention's core (the delta rule with per-channel decay).

Variants, all given the same q, k, v, decay g (K3's gate, -5 sigmoid(.)) and beta, with the
L2 norm of q and k inside, float32:

  chunked       ours: megatron_slmoe.ops.kda.kda_chunked (chunks of 64, WY/UT form)
  transformers  transformers' Kimi-Linear ``chunk_kimi_delta_attention`` torch fallback (the path
                it takes without fla-core)
  recurrent     ours: the per-token recurrence (kda_recurrent), the reference

Each mode runs forward only (no autograd graph) and forward+backward (a loss on the output, all
five inputs needing gradients). Every variant's output is compared with the recurrence's
(max_abs_err). Times are medians of --reps after --warmup: ms of wall clock and cpu_ms of this
process's CPU time (all its threads; less disturbed than the wall clock when other work shares
the cores); tok_s = batch x tokens / wall time; x_vs_chunked and x_cpu_vs_chunked = the variant's
time over ours (above 1: ours is faster). The 1-minute load average before and after each row is
printed and recorded.

    python tools/bench/kda.py                       # 1k, 2k, 4k tokens, 2 heads of 128
    python tools/bench/kda.py --quick
    python tools/bench/kda.py --tokens 4096 --heads 4 --json runs/bench/kda.json
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

import torch

from megatron_slmoe.ops.kda import kda_chunked, kda_recurrent
from megatron_slmoe.utils.atomic import write_json_atomic

VARIANTS = ("chunked", "transformers", "recurrent")
MODES = ("fwd", "fwd+bwd")


def _transformers_chunk():
    from transformers.models.kimi_linear import modeling_kimi_linear

    # It logs on every call that fla is missing and it falls back to torch: that is the point here.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return modeling_kimi_linear.chunk_kimi_delta_attention


def _run(variant: str, q, k, v, g, beta):
    if variant == "chunked":
        return kda_chunked(q, k, v, g, beta, qk_l2norm=True)[0]
    if variant == "recurrent":
        return kda_recurrent(q, k, v, g, beta, qk_l2norm=True)[0]
    return _transformers_chunk()(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]


def _inputs(batch: int, tokens: int, heads: int, head_dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, tokens, heads, head_dim)
    q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
    g = -5 * torch.sigmoid(torch.randn(shape, generator=gen))
    beta = torch.sigmoid(torch.randn(batch, tokens, heads, generator=gen))
    return q, k, v, g, beta


def _time(variant: str, mode: str, inputs, warmup: int, reps: int):
    """(median wall seconds, median process CPU seconds, the output)."""
    walls, cpus, out = [], [], None
    for rep in range(warmup + reps):
        leaves = inputs if mode == "fwd" else [t.clone().requires_grad_(True) for t in inputs]
        start, cpu_start = time.perf_counter(), time.process_time()
        if mode == "fwd":
            with torch.no_grad():
                out = _run(variant, *leaves)
        else:
            out = _run(variant, *leaves)
            out.square().sum().backward()
            out = out.detach()
        if rep >= warmup:
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu_start)
    return statistics.median(walls), statistics.median(cpus), out


def bench(args) -> list[dict]:
    rows = []
    for tokens in args.tokens:
        inputs = _inputs(args.batch, tokens, args.heads, args.head_dim)
        for mode in MODES:
            measured, outputs = {}, {}
            for variant in args.variants:
                load_before = os.getloadavg()[0]
                seconds, cpu, outputs[variant] = _time(variant, mode, inputs, args.warmup,
                                                       args.reps)
                measured[variant] = (seconds, cpu, load_before, os.getloadavg()[0])
            reference = outputs.get("recurrent")
            for variant in args.variants:
                seconds, cpu, load_before, load_after = measured[variant]
                row = dict(tokens=tokens, mode=mode, variant=variant, batch=args.batch,
                           heads=args.heads, head_dim=args.head_dim, ms=1e3 * seconds,
                           cpu_ms=1e3 * cpu,
                           tok_s=args.batch * tokens / seconds,
                           load_avg_1m=[round(load_before, 2), round(load_after, 2)])
                if "chunked" in measured:
                    row["x_vs_chunked"] = seconds / measured["chunked"][0]
                    row["x_cpu_vs_chunked"] = cpu / measured["chunked"][1]
                if reference is not None:
                    row["max_abs_err"] = float((outputs[variant] - reference).abs().max())
                rows.append(row)
                print_row(row)
    return rows


COLUMNS = (("tokens", 7, "{}"), ("mode", 8, "{}"), ("variant", 13, "{}"), ("ms", 10, "{:.1f}"),
           ("cpu_ms", 10, "{:.1f}"), ("tok_s", 9, "{:.0f}"), ("x_vs_chunked", 13, "{:.2f}"),
           ("x_cpu_vs_chunked", 17, "{:.2f}"), ("max_abs_err", 12, "{:.1e}"),
           ("load_avg_1m", 13, "{0[0]:.1f}->{0[1]:.1f}"))


def print_row(row: dict | None, header: bool = False) -> None:
    if header:
        print(" ".join(f"{name:>{width}}" for name, width, _ in COLUMNS))
        return
    cells = [f"{fmt.format(row[name]) if name in row else '-':>{width}}"
             for name, width, fmt in COLUMNS]
    print(" ".join(cells), flush=True)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=_positive, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--heads", type=_positive, default=2)
    p.add_argument("--head-dim", type=_positive, default=128)
    p.add_argument("--batch", type=_positive, default=1)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=_positive, default=3)
    p.add_argument("--threads", type=_positive, help="torch's intra-op threads (default: torch's "
                   "choice); 1 avoids OpenMP stalls when other work oversubscribes the cores")
    p.add_argument("--quick", action="store_true", help="1k tokens, one warm-up and one timed run each")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.warmup, args.reps = [1024], 1, 1
    if args.warmup < 0:
        p.error(f"--warmup must be 0 or more, got {args.warmup}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, cpu, float32, threads {torch.get_num_threads()}, "
          f"batch {args.batch}, heads {args.heads}, head_dim {args.head_dim}, "
          f"warmup {args.warmup}, reps {args.reps}; load average {os.getloadavg()[0]:.2f} "
          f"(1 min) on {os.cpu_count()} cores")
    print_row(None, header=True)
    rows = bench(args)
    if args.json:
        write_json_atomic(args.json, rows, indent=1)
        print(f"wrote {len(rows)} rows to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
