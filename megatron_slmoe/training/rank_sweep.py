"""Choosing the LoRA rank: short fine-tunes at several ranks, their held-out curves on one picture,
and the smallest rank whose final held-out loss is within a stated margin of the best.

Start small (4) and go up (8, 16, 32) only while the held-out loss still gains: a larger rank
costs adapter memory, optimizer state and step time on every expert of every layer, and past the
point where the task is learnt it buys nothing. Each rank's run is an ordinary fine-tuning run in
``<sweep dir>/rank-<r>`` (``alpha = alpha_ratio * r``, so the adapters' scale stays the same); a
run that finished before (its ``summary.json`` exists) is reused, so a sweep can be extended.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence

from megatron_slmoe.training.plots import RunDataError, read_metrics

_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")


@dataclass
class RankResult:
    rank: int
    run_dir: str
    curve: list[tuple[int, float]]  # (step, held-out loss), step 0 = before training
    accuracy_curve: list[tuple[int, float]] = field(default_factory=list)

    @property
    def final_loss(self) -> float:
        return self.curve[-1][1]

    @property
    def final_accuracy(self) -> Optional[float]:
        return self.accuracy_curve[-1][1] if self.accuracy_curve else None


def run_dir_for(sweep_dir: str, rank: int) -> str:
    return os.path.join(sweep_dir, f"rank-{rank}")


def finetune_command(rank: int, run_dir: str, finetune_args: Sequence[str], nproc: int,
                     alpha_ratio: float) -> list[str]:
    """The torchrun command of one rank's run (flags after the user's, so they win)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "-m", "megatron_slmoe.training.finetune",
            *finetune_args, "--lora-rank", str(rank), "--lora-alpha", f"{alpha_ratio * rank:g}",
            "--output-dir", run_dir, "--no-plots"]


def run_rank(rank: int, sweep_dir: str, finetune_args: Sequence[str], nproc: int,
             alpha_ratio: float) -> bool:
    """Fine-tune at ``rank`` unless a finished run is there; False when it was reused."""
    run_dir = run_dir_for(sweep_dir, rank)
    if os.path.isfile(os.path.join(run_dir, "summary.json")):
        return False
    os.makedirs(run_dir, exist_ok=True)
    command = finetune_command(rank, run_dir, finetune_args, nproc, alpha_ratio)
    with open(os.path.join(run_dir, "sweep.log"), "a", encoding="utf-8") as log:
        proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"the rank-{rank} run failed (exit {proc.returncode}); its output is "
                           f"in {os.path.join(run_dir, 'sweep.log')}")
    return True


def read_result(rank: int, run_dir: str) -> RankResult:
    """The held-out curves of a finished run."""
    try:
        with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as handle:
            summary = json.load(handle)
    except (OSError, ValueError):
        raise RunDataError(f"{run_dir}: no readable summary.json (the run did not finish)") from None
    records = read_metrics(run_dir)
    curve = [(0, float(summary["eval_loss_before"]))] + [
        (r["iteration"], float(r["eval_loss"])) for r in records if "eval_loss" in r]
    accuracy = [(r["iteration"], float(r["eval_accuracy"])) for r in records
                if "eval_accuracy" in r]
    if accuracy and summary.get("accuracy_before") is not None:
        accuracy = [(0, float(summary["accuracy_before"]))] + accuracy
    return RankResult(rank, run_dir, curve, accuracy)


def recommend(results: Sequence[RankResult], margin: float) -> RankResult:
    """The smallest rank whose final held-out loss is at most ``(1 + margin)`` times the best."""
    best = min(r.final_loss for r in results)
    return min((r for r in results if r.final_loss <= best * (1.0 + margin)),
               key=lambda r: r.rank)


def plot_sweep(results: Sequence[RankResult], chosen: RankResult, margin: float,
               path: str) -> str:
    import io

    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from megatron_slmoe.utils.atomic import write_bytes_atomic

    with_accuracy = any(r.accuracy_curve for r in results)
    figure, axes = plt.subplots(2 if with_accuracy else 1, 1, figsize=(8.0, 7.0 if with_accuracy
                                                                        else 4.2),
                                sharex=True, squeeze=False)
    loss_ax = axes[0][0]
    for colour, result in zip(_COLOURS * 4, sorted(results, key=lambda r: r.rank)):
        steps, losses = zip(*result.curve)
        label = f"rank {result.rank}: {result.final_loss:.3f}"
        if result is chosen:
            label += "  (recommended)"
        loss_ax.plot(steps, losses, "o-", color=colour, markersize=3,
                     linewidth=2.4 if result is chosen else 1.2, label=label)
        if with_accuracy and result.accuracy_curve:
            a_steps, values = zip(*result.accuracy_curve)
            axes[1][0].plot(a_steps, [100 * v for v in values], "o-", color=colour,
                            markersize=3, linewidth=2.4 if result is chosen else 1.2,
                            label=f"rank {result.rank}: {100 * result.final_accuracy:.1f}%")
    best = min(r.final_loss for r in results)
    loss_ax.axhline(best * (1 + margin), color="grey", linestyle="--", linewidth=0.8,
                    label=f"best + {margin:.0%}")
    finals = [r.final_loss for r in results]
    spread = max(finals) - min(finals)
    loss_ax.set_ylim(min(finals) - spread - 0.05, max(max(finals) + 3 * spread, best * 1.5) + 0.05)
    loss_ax.set_ylabel("held-out loss")
    loss_ax.legend(fontsize=8, loc="upper right")
    loss_ax.grid(True, alpha=0.3)
    if with_accuracy:
        axes[1][0].set_ylabel("exact match (%)")
        axes[1][0].set_ylim(-2, 105)
        axes[1][0].legend(fontsize=8, loc="lower right")
        axes[1][0].grid(True, alpha=0.3)
    axes[-1][0].set_xlabel("step")
    figure.suptitle(f"LoRA rank sweep: rank {chosen.rank} is the smallest within {margin:.0%} "
                    f"of the best held-out loss", fontsize=11)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    plt.close(figure)
    write_bytes_atomic(path, buffer.getvalue())
    return path


def summarize(results: Sequence[RankResult], chosen: RankResult, margin: float) -> dict:
    return {
        "margin": margin, "recommended_rank": chosen.rank,
        "ranks": [{"rank": r.rank, "run_dir": r.run_dir, "final_eval_loss": r.final_loss,
                   "final_accuracy": r.final_accuracy,
                   "within_margin": r.final_loss <= min(x.final_loss for x in results)
                   * (1 + margin)}
                  for r in sorted(results, key=lambda r: r.rank)],
    }


def table(results: Sequence[RankResult], chosen: RankResult) -> str:
    lines = [f"{'rank':>5}  {'held-out loss':>13}  {'accuracy':>8}"]
    for r in sorted(results, key=lambda r: r.rank):
        accuracy = "n/a" if r.final_accuracy is None else f"{r.final_accuracy:.1%}"
        lines.append(f"{r.rank:>5}  {r.final_loss:>13.4f}  {accuracy:>8}"
                     + ("  <- recommended" if r is chosen else ""))
    return "\n".join(lines)


def check_ranks(ranks: Sequence[int]) -> None:
    from megatron_slmoe.lora.config import MAX_LORA_RANK

    if not ranks or len(set(ranks)) != len(ranks):
        raise ValueError("--ranks needs distinct ranks")
    for rank in ranks:
        if not 1 <= rank <= MAX_LORA_RANK:
            raise ValueError(f"--ranks {rank}: a LoRA rank is in 1..{MAX_LORA_RANK}")
