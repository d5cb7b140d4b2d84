"""Choose the LoRA rank: short fine-tunes at several ranks, their held-out curves on one picture,
and the smallest rank within a margin of the best final held-out loss.

    slmoe-rank-sweep --output-dir runs/sweep -- --base-checkpoint runs/demo/base \\
        --expert-model-parallel-size 2 --train-iters 150 --eval-interval 25 --lr 5e-3

Flags after ``--`` go to every fine-tuning run (``--lora-rank``, ``--lora-alpha``,
``--output-dir`` are set per rank: alpha = --alpha-ratio x rank). Writes
``<output dir>/rank-<r>/`` (one run each; a finished one is reused), ``rank_sweep.png`` and
``rank_sweep.json``, and prints a table and the recommendation. Bad flags are one line on stderr
and exit code 2 (each run's own flags are checked before it starts); a run that fails names its
log and exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional


def parse_args(argv: Optional[list[str]]):
    argv = list(sys.argv[1:] if argv is None else argv)
    finetune_args = []
    if "--" in argv:
        cut = argv.index("--")
        argv, finetune_args = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="slmoe-rank-sweep", description=__doc__.splitlines()[0],
                                     usage="%(prog)s [options] -- [fine-tuning flags]")
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16, 32],
                        help="LoRA ranks to try [default: 4 8 16 32]")
    parser.add_argument("--margin", type=float, default=0.02,
                        help="recommend the smallest rank whose final held-out loss is at most "
                             "(1 + margin) x the best [default: 0.02]")
    parser.add_argument("--alpha-ratio", type=float, default=2.0,
                        help="lora alpha = ratio x rank, so every rank has the same scale "
                             "[default: 2]")
    parser.add_argument("--nproc-per-node", type=int, default=2,
                        help="processes per run [default: 2]")
    parser.add_argument("--output-dir", required=True, help="the sweep's directory")
    args = parser.parse_args(argv)
    args.finetune_args = finetune_args
    return args


def _check(args) -> Optional[str]:
    """One line naming what is wrong, or None."""
    from megatron_slmoe.config.errors import ConfigError
    from megatron_slmoe.training.rank_sweep import check_ranks

    try:
        check_ranks(args.ranks)
    except ValueError as err:
        return str(err)
    if args.margin < 0:
        return f"--margin must be >= 0, got {args.margin}"
    if args.alpha_ratio <= 0 or args.nproc_per_node < 1:
        return "--alpha-ratio must be positive and --nproc-per-node at least 1"
    for flag in ("--lora-rank", "--lora-alpha", "--output-dir"):
        if flag in args.finetune_args:
            return f"{flag} is set by the sweep for each rank; leave it out of the fine-tuning flags"
    # The runs' own flags, checked once before any run starts.
    from megatron_slmoe.training.finetune import parse
    from megatron_slmoe.training.inputs import check_inputs

    from megatron_slmoe.platform import apply_adaptor

    os.environ.setdefault("WORLD_SIZE", str(args.nproc_per_node))
    try:
        command = parse([*args.finetune_args, "--lora-rank", str(max(args.ranks))])
        check_inputs(command.run, args.nproc_per_node, apply_adaptor())
    except ConfigError as err:
        return str(err)
    return None


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    problem = _check(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from megatron_slmoe.training import rank_sweep as sweep
    from megatron_slmoe.utils.atomic import write_json_atomic

    results = []
    for rank in sorted(args.ranks):
        run_dir = sweep.run_dir_for(args.output_dir, rank)
        print(f"[sweep] rank {rank}: {run_dir}", flush=True)
        try:
            if not sweep.run_rank(rank, args.output_dir, args.finetune_args,
                                  args.nproc_per_node, args.alpha_ratio):
                print(f"[sweep] rank {rank}: reusing the finished run", flush=True)
        except RuntimeError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        results.append(sweep.read_result(rank, run_dir))
    chosen = sweep.recommend(results, args.margin)
    picture = sweep.plot_sweep(results, chosen, args.margin,
                               os.path.join(args.output_dir, "rank_sweep.png"))
    report = os.path.join(args.output_dir, "rank_sweep.json")
    write_json_atomic(report, {**sweep.summarize(results, chosen, args.margin),
                               "picture": picture})
    print(sweep.table(results, chosen))
    print(f"[sweep] recommended LoRA rank: {chosen.rank} (the smallest within {args.margin:.0%} "
          f"of the best final held-out loss); picture {picture}, report {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
