"""``python -m megatron_slmoe.preflight``: see the package docstring. Run under torchrun."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.preflight import PreflightError, PreflightOptions, run
from megatron_slmoe.preflight.report import format_table
from megatron_slmoe.training.cli import parse_command_line
from megatron_slmoe.utils.atomic import write_json_atomic


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_slmoe.preflight", allow_abbrev=False,
        description="Check that every rank joins, time the job's collectives within and between "
                    "nodes and sweep rank pairs. Other flags (or all after --) are the training "
                    "job's: the parallel layout comes from them.")
    p.add_argument("--report", default=None,
                   help="JSON report (default: <--output-dir>/preflight.json, else runs/logs/)")
    p.add_argument("--size-mb", type=float, default=None,
                   help="message of the all-reduce / all-to-all (default 1 on CPU, 64 on GPU/NPU)")
    p.add_argument("--iters", type=int, default=5, help="timed repetitions of each collective")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--p2p-size-mb", type=float, default=None,
                   help="message of the pairwise sweep (default 1 on CPU, 16 on GPU/NPU)")
    p.add_argument("--p2p-iters", type=int, default=3, help="round trips per pair")
    p.add_argument("--p2p-time-budget", type=float, default=10.0,
                   help="seconds after which no further round of pairs starts")
    p.add_argument("--p2p-max-rounds", type=int, default=64,
                   help="rounds of disjoint pairs at most (world size - 1 cover every pair)")
    p.add_argument("--node-size", type=int, default=None,
                   help="treat blocks of this many ranks as one node (default: torchrun's nodes)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds for every rank to join and for each collective")
    return p


def _training_config(argv: list[str]):
    """The job's run configuration, read by the job's own parser (``--config`` YAML included) but
    without its layout checks against the world size: the preflight needs only the parallel layout
    and the output directory, and may run on its own on any number of ranks."""
    try:
        return parse_command_line(argv, prog="megatron_slmoe.preflight (training flags)",
                                  description="", world_size=0).run
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    rest = [a for a in rest if a != "--"]
    for name in ("iters", "p2p_iters", "p2p_max_rounds"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    for name in ("size_mb", "p2p_size_mb", "node_size", "timeout"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    train = _training_config(rest)
    report_path = args.report or os.path.join(
        train.output.output_dir or os.path.join("runs", "logs"), "preflight.json")
    options = PreflightOptions(
        tp=train.parallel.tensor_model_parallel_size,
        pp=train.parallel.pipeline_model_parallel_size,
        ep=train.parallel.expert_model_parallel_size, size_mb=args.size_mb, iters=args.iters,
        warmup=args.warmup, p2p_size_mb=args.p2p_size_mb, p2p_iters=args.p2p_iters,
        p2p_time_budget=args.p2p_time_budget, p2p_max_rounds=args.p2p_max_rounds,
        node_size=args.node_size, timeout=args.timeout)
    try:
        report = run(options)
    except PreflightError as err:
        if str(err):
            print(f"preflight: error: {err}", file=sys.stderr, flush=True)
        return 1
    if report is not None:
        write_json_atomic(report_path, report)
        for line in format_table(report, report_path).splitlines():
            print(f"[preflight] {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
