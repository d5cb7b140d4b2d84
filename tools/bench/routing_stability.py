#!/usr/bin/env python
"""What each routing-stability mechanism does to a LoRA fine-tune: the same run with the routed
load-balancing loss and routing preservation each off and on, compared on task accuracy, held-out
loss, expert load at the end, collapse warnings and routing drift from the base model.

Each setting is an ordinary run of the training entry point in ``<output dir>/<setting>``; a run
that finished before (its ``summary.json`` exists) is reused. Prints a Markdown table (the
README's) and writes JSON. The runs share everything but the two coefficients, so the table
compares the mechanisms against the run with neither, measured the same way on the same machine.

    python tools/bench/routing_stability.py --base-checkpoint runs/demo/base \\
        --output-dir runs/bench/stability --json runs/bench/stability.json -- \\
        --train-iters 300 --lr 5e-3 --lora-rank 16 --lora-alpha 32 --eval-interval 100 \\
        --lora-target-modules linear_qkv linear_proj linear_fc1 linear_fc2 shared_experts
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# setting -> (--moe-routed-balance-coeff, --moe-routing-kl-coeff)
SETTINGS = {"neither": (0.0, 0.0), "balance": (0.1, 0.0), "preserve": (0.0, 1.0),
            "both": (0.1, 1.0)}


def _run(name: str, run_dir: str, args: argparse.Namespace, finetune_args: list[str]) -> None:
    if os.path.isfile(os.path.join(run_dir, "summary.json")):
        print(f"[stability] {name}: reusing {run_dir}", flush=True)
        return
    balance, kl = SETTINGS[name]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(args.nproc), "-m", "megatron_slmoe.training.finetune",
               "--base-checkpoint", args.base_checkpoint, *finetune_args,
               "--moe-routed-balance-coeff", str(balance), "--moe-routing-kl-coeff", str(kl),
               "--output-dir", run_dir, "--no-resume", "--no-plots"]
    print(f"[stability] {name}: {' '.join(command)}", flush=True)
    with open(os.path.join(run_dir + ".log"), "w") as log:
        rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if rc != 0:
        raise SystemExit(f"error: the {name} run failed (exit {rc}); see {run_dir}.log")


def measure(run_dir: str) -> dict:
    """The row of one finished run: accuracy by evaluation step, the summary's health figures,
    and the worst layer's load and drift at the last step."""
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    last = [r for r in records if r["iteration"] == summary["steps"]][-1]["moe"]["layers"]

    def smallest_share(tokens: list[int]) -> float:  # of the fair share
        return min(tokens) * len(tokens) / max(sum(tokens), 1)

    return {
        "accuracy": {r["iteration"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r},
        "eval_loss": summary["eval_loss_after"],
        "worst_imbalance": max(m["imbalance"] for m in last.values()),
        "smallest_expert_share": min(smallest_share(m["tokens_per_expert"]) for m in last.values()),
        "dead_experts_end": summary["dead_experts_end"],
        "collapse_warnings": summary["collapse_warnings"],
        "drift_kl": max(m.get("drift_kl", float("nan")) for m in last.values()),
        "drift_topk_overlap": min(m.get("drift_topk_overlap", float("nan")) for m in last.values()),
        "drift_load_change": max(m.get("drift_load_change", float("nan")) for m in last.values()),
    }


def table(rows: dict[str, dict]) -> str:
    lines = ["| balance / KL coeff | exact match at each evaluation | held-out loss | worst imbalance | "
             "smallest expert (x fair share) | experts without tokens | collapse warnings | "
             "drift KL (worst layer) | top-k overlap (worst) | load change (worst) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in rows.items():
        balance, kl = SETTINGS[name]
        accuracy = " / ".join(f"{a:.1%}" for _, a in sorted(row["accuracy"].items()))
        lines.append(
            f"| {balance or 'off'} / {kl or 'off'} | {accuracy} | {row['eval_loss']:.3f} | "
            f"{row['worst_imbalance']:.2f} | {row['smallest_expert_share']:.2f} | "
            f"{row['dead_experts_end']} | {row['collapse_warnings']} | {row['drift_kl']:.4f} | "
            f"{row['drift_topk_overlap']:.2f} | {row['drift_load_change']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-checkpoint", required=True, help="the base model (dist checkpoint)")
    parser.add_argument("--output-dir", required=True, help="one run directory per setting here")
    parser.add_argument("--nproc", type=int, default=1, help="processes per run")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv[:split])
    if not os.path.isfile(os.path.join(args.base_checkpoint, "metadata.json")):
        parser.exit(2, f"error: --base-checkpoint {args.base_checkpoint}: not a dist checkpoint "
                       f"(no metadata.json)\n")
    os.makedirs(args.output_dir, exist_ok=True)
    rows = {}
    for name in SETTINGS:
        run_dir = os.path.join(args.output_dir, name)
        _run(name, run_dir, args, argv[split + 1:])
        rows[name] = measure(run_dir)
    print(table(rows))
    if args.json:
        from megatron_slmoe.utils.atomic import write_json_atomic

        write_json_atomic(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
