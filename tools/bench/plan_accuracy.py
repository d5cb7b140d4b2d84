#!/usr/bin/env python
"""Predicted vs measured peak memory per rank of real fine-tuning runs (the planner's accuracy).

Each run is the real training entry point under ``torchrun --nproc-per-node 2`` on the tiny model
(``tools/bench/measured_run.py``), in a different layout or setting. Measured: the peak bytes of
live tensors per rank during each training step (``megatron_slmoe.plan.live_bytes``, the CPU
stand-in for ``max_memory_allocated``), taken over the steps after the first (when Adam's state
exists). Predicted: ``megatron_slmoe.plan.estimate_memory`` for the same settings, with the
CPU framework overhead measured once, in the first run, as the live bytes before a step that are
not model parameters, buffers, DDP gradient buffers or optimizer state (the data, RNG states,
Megatron's globals). Prints a table, writes JSON; the goal is within 10% on every run.

    python tools/bench/plan_accuracy.py --json runs/bench/plan_accuracy.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from measured_run import read_ranks  # a sibling: tools/bench is the script's folder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name -> (finetune flags, RunSettings fields). Two ranks each; tiny model, seq 128.
RUNS = {
    "ep2": (["--expert-model-parallel-size", "2", "--micro-batch-size", "4"],
            dict(ep=2, dp=2, micro_batch_size=4)),
    "ep2-distopt-mbs2": (["--expert-model-parallel-size", "2", "--micro-batch-size", "2",
                          "--use-distributed-optimizer"],
                         dict(ep=2, dp=2, micro_batch_size=2, distributed_optimizer=True)),
    "tp2-ep2": (["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                 "--micro-batch-size", "8"],
                dict(tp=2, ep=2, dp=1, micro_batch_size=8)),
    "pp2-mbs2": (["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2"],
                 dict(pp=2, dp=1, micro_batch_size=2)),
    "ep2-sel-attn-moe": (["--expert-model-parallel-size", "2", "--micro-batch-size", "8",
                          "--recompute-granularity", "selective", "--recompute-modules",
                          "core_attn", "moe"],
                         dict(ep=2, dp=2, micro_batch_size=8, recompute="selective",
                              recompute_modules=("core_attn", "moe"))),
    "ep2-full-distopt": (["--expert-model-parallel-size", "2", "--micro-batch-size", "8",
                          "--recompute-granularity", "full", "--use-distributed-optimizer"],
                         dict(ep=2, dp=2, micro_batch_size=8, recompute="full",
                              distributed_optimizer=True)),
    "ep2-bf16": (["--expert-model-parallel-size", "2", "--micro-batch-size", "4", "--bf16"],
                 dict(ep=2, dp=2, micro_batch_size=4, dtype="bf16")),
}
SEQ, GLOBAL_BATCH, ITERS = 128, 16, 3


# --- the benchmark ------------------------------------------------------------------------------


COMMON = ["--model-config", "tiny", "--seq-length", str(SEQ), "--global-batch-size",
          str(GLOBAL_BATCH), "--lr-warmup-iters", "0", "--eval-iters", "1", "--eval-interval",
          "1000", "--save-interval", "1000", "--log-interval", "1000", "--no-tensorboard",
          "--eval-accuracy-samples", "0", "--no-plots"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


def _make_base(work: str) -> str:
    """A base for the LoRA runs (random weights after one full step: memory does not care, and
    LoRA refuses an unnamed base)."""
    base = os.path.join(work, "base")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
               "--master-port", "29499", "-m", "megatron_slmoe.training.finetune", *COMMON,
               "--finetune-mode", "full", "--data-format", "pretrain", "--train-iters", "1",
               "--micro-batch-size", "4", "--output-dir", os.path.join(work, "base-run"),
               "--save-base", base]
    proc = subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"making the base failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return base


def _measure(name: str, flags: list[str], work: str, base: str) -> list[dict]:
    out = os.path.join(work, name)
    os.makedirs(out, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(29500 + abs(hash(name)) % 1000),
               os.path.join(os.path.dirname(os.path.abspath(__file__)), "measured_run.py"), out,
               str(ITERS), "--", *COMMON, "--train-iters", str(ITERS + 10),
               "--base-checkpoint", base, "--output-dir", os.path.join(out, "run"), *flags]
    proc = subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=ROOT)
    return read_ranks(out, proc, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=list(RUNS))
    parser.add_argument("--json", default=None)
    parser.add_argument("--work-dir", default=None, help="default: a temporary directory")
    args = parser.parse_args(argv)

    from megatron_slmoe.plan.devices import DeviceSpec
    from megatron_slmoe.plan.memory import estimate_memory
    from megatron_slmoe.plan.model_shape import load_shape
    from megatron_slmoe.plan.settings import RunSettings
    from megatron_slmoe.utils.atomic import write_json_atomic

    shape = load_shape("tiny")
    work = args.work_dir or tempfile.mkdtemp(prefix="plan_accuracy-")
    base = _make_base(work)
    measured = {name: _measure(name, RUNS[name][0], work, base) for name in args.runs}
    # The CPU framework overhead, measured in the first run: what is live before a step beyond
    # the training state the memory model counts.
    first = measured[args.runs[0]]
    overhead = max(r["steps"][1]["before"] - r["steps"][1]["held_by_state"] for r in first)
    cpu = DeviceSpec("cpu (live tensor bytes)", memory_bytes=2**40, bf16_tflops=1.0,
                     intra_node_gbps=1.0, inter_node_gbps=1.0, devices_per_node=2,
                     framework_overhead=overhead, fragmentation=0.0)
    rows = []
    for name in args.runs:
        fields = {"dtype": "fp32", "seq_length": SEQ, "global_batch_size": GLOBAL_BATCH,
                  "devices_per_node": 2, "moe_imbalance": 1.25, **RUNS[name][1]}
        settings = RunSettings(**fields)
        estimate = estimate_memory(shape, settings, cpu)
        for rank, result in enumerate(measured[name]):
            stage = estimate.stages[min(rank // (settings.tp * settings.dp), settings.pp - 1)]
            peak = max(step["peak"] for step in result["steps"][1:])
            rows.append({"run": name, "rank": rank, "layout": settings.describe(),
                         "dtype": settings.dtype, "predicted_bytes": stage.peak,
                         "measured_bytes": peak,
                         "relative_error": (stage.peak - peak) / peak,
                         "predicted_breakdown": stage.breakdown()})
    print(f"peak live-tensor bytes per rank, tiny model, seq {SEQ}, global batch {GLOBAL_BATCH}, "
          f"{ITERS} steps, 2 gloo ranks; CPU framework overhead measured {overhead / 2**20:.2f} MiB")
    print(f"{'run':<20}{'rank':>5}  {'layout':<38}{'dtype':<6}{'predicted MiB':>14}"
          f"{'measured MiB':>14}{'error':>8}")
    for row in rows:
        print(f"{row['run']:<20}{row['rank']:>5}  {row['layout']:<38}{row['dtype']:<6}"
              f"{row['predicted_bytes'] / 2**20:>14.2f}{row['measured_bytes'] / 2**20:>14.2f}"
              f"{row['relative_error']:>+8.1%}")
    worst = max(abs(r["relative_error"]) for r in rows)
    print(f"worst |error| {worst:.1%} (goal 10%)")
    if args.json:
        write_json_atomic(args.json, {"machine": "cpu", "framework_overhead_bytes": overhead,
                                      "rows": rows, "worst_relative_error": worst})
    return 0


if __name__ == "__main__":
    sys.exit(main())
