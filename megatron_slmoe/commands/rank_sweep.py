"""Choose the LoRA rank: short fine-tunes at several ranks, their held-out curves on one picture,
and the smallest adapter within a margin of the best final held-out loss.

    slmoe-rank-sweep --output-dir runs/sweep -- --base-checkpoint runs/demo/base \\
        --expert-model-parallel-size 2 --train-iters 150 --eval-interval 25 --lr 5e-3
    slmoe-rank-sweep --ranks 8 32 --expert-layouts per-expert shared-outer --expert-ranks 2 8 \\
        --output-dir runs/sweep-experts -- ...   # the routed experts' layout and own rank too

Flags after ``--`` go to every fine-tuning run (``--lora-rank``, ``--lora-alpha``,
``--output-dir``, ``--expert-lora-layout``, ``--expert-lora-rank`` are set per run: alpha =
--alpha-ratio x rank). Writes ``<output dir>/rank-<r>[-<layout>][-experts-<e>]/`` (one run each;
a finished one is reused), ``rank_sweep.png`` (with the final held-out loss against the adapter's
parameters) and ``rank_sweep.json``, and prints a table and the recommendation. Bad flags are one line on stderr
and exit code 2 (each run's own flags are checked before it starts); a run that fails names its
log and exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.lora.config import EXPERT_LAYOUTS
from megatron_slmoe.training import rank_sweep as sweep
from megatron_slmoe.training.finetune import parse
from megatron_slmoe.utils.atomic import write_json_atomic


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
    parser.add_argument("--expert-layouts", nargs="+", default=["per-expert"],
                        help="routed-expert LoRA layouts to try: per-expert, shared-outer "
                             "[default: per-expert]")
    parser.add_argument("--expert-ranks", type=int, nargs="+", default=[],
                        help="the routed experts' own ranks to try (--expert-lora-rank) "
                             "[default: the LoRA rank]")
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
    try:
        sweep.check_ranks(args.ranks)
        if args.expert_ranks:
            sweep.check_ranks(args.expert_ranks, "--expert-ranks")
    except ValueError as err:
        return str(err)
    unknown = [layout for layout in args.expert_layouts if layout not in EXPERT_LAYOUTS]
    if unknown or len(set(args.expert_layouts)) != len(args.expert_layouts):
        return (f"--expert-layouts takes distinct layouts of {', '.join(EXPERT_LAYOUTS)}, got "
                f"{' '.join(args.expert_layouts)}")
    if args.margin < 0:
        return f"--margin must be >= 0, got {args.margin}"
    if args.alpha_ratio <= 0 or args.nproc_per_node < 1:
        return "--alpha-ratio must be positive and --nproc-per-node at least 1"
    for flag in ("--lora-rank", "--lora-alpha", "--output-dir", "--expert-lora-layout",
                 "--expert-lora-rank"):
        if flag in args.finetune_args:
            return f"{flag} is set by the sweep for each rank; leave it out of the fine-tuning flags"
    if args.expert_ranks and "--moe-rank-scaling" in args.finetune_args:
        return "--moe-rank-scaling and --expert-ranks both set the experts' rank; give one"
    # The runs' own flags, checked before any run starts: the largest rank in each layout.
    from megatron_slmoe.training.inputs import prepare_run

    from megatron_slmoe.platform import apply_adaptor

    os.environ.setdefault("WORLD_SIZE", str(args.nproc_per_node))
    try:
        for layout in args.expert_layouts:
            largest = sweep.Variant(max(args.ranks), layout, max(args.expert_ranks or [0]))
            command = parse([*args.finetune_args, "--lora-rank", str(largest.rank),
                             *largest.flags])
            prepare_run(command.run, args.nproc_per_node, apply_adaptor())
    except ConfigError as err:
        return str(err)
    return None


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    problem = _check(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    results = []
    for variant in sweep.variants(args.ranks, args.expert_layouts, args.expert_ranks):
        run_dir = sweep.run_dir_for(args.output_dir, variant)
        print(f"[sweep] {variant.label}: {run_dir}", flush=True)
        try:
            if not sweep.run_rank(variant, args.output_dir, args.finetune_args,
                                  args.nproc_per_node, args.alpha_ratio):
                print(f"[sweep] {variant.label}: reusing the finished run", flush=True)
        except RuntimeError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        results.append(sweep.read_result(variant, run_dir))
    chosen = sweep.recommend(results, args.margin)
    picture = sweep.plot_sweep(results, chosen, args.margin,
                               os.path.join(args.output_dir, "rank_sweep.png"))
    report = os.path.join(args.output_dir, "rank_sweep.json")
    write_json_atomic(report, {**sweep.summarize(results, chosen, args.margin),
                               "picture": picture})
    print(sweep.table(results, chosen))
    print(f"[sweep] recommended LoRA rank: {chosen.rank}"
          + (f" ({chosen.variant.label})" if chosen.variant.flags else "")
          + f" (the smallest adapter within {args.margin:.0%} of the best final held-out "
          f"loss); picture {picture}, report {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
