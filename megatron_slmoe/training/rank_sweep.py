"""Choosing the LoRA rank: short fine-tunes at several ranks, their held-out curves on one picture,
and the smallest adapter whose final held-out loss is within a stated margin of the best.

Start small (4) and go up (8, 16, 32) only while the held-out loss still gains: a larger rank
costs adapter memory, optimizer state and step time on every expert of every layer, and past the
point where the task is learnt it buys nothing. Each rank's run is an ordinary fine-tuning run in
``<sweep dir>/rank-<r>`` (``alpha = alpha_ratio * r``, so the adapters' scale stays the same); a
run that finished before (its ``summary.json`` exists) is reused, so a sweep can be extended.

On an MoE the routed experts' adapter is most of the adapter: the sweep also takes expert layouts
(``per-expert``, ``shared-outer``) and expert ranks of their own (``--expert-lora-rank``); each
combination is a run (``rank-<r>[-<layout>][-experts-<e>]``), "smallest" is by the trained
adapter's parameters (its ``adapter_model.safetensors``), and a second picture puts each run's
final held-out loss against its adapter size.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence

from megatron_slmoe.lora.config import MAX_LORA_RANK
from megatron_slmoe.training.reporting.plots import RunDataError, read_metrics
from megatron_slmoe.utils.atomic import write_bytes_atomic

_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")


@dataclass(frozen=True)
class Variant:
    """One run of the sweep: the LoRA rank, the routed experts' layout and their own rank (0:
    the LoRA rank)."""

    rank: int
    layout: str = "per-expert"
    expert_rank: int = 0

    @property
    def label(self) -> str:
        parts = [f"rank {self.rank}"]
        if self.layout != "per-expert":
            parts.append(self.layout)
        if self.expert_rank:
            parts.append(f"experts {self.expert_rank}")
        return ", ".join(parts)

    @property
    def flags(self) -> list[str]:
        flags = [] if self.layout == "per-expert" else ["--expert-lora-layout", self.layout]
        return flags + (["--expert-lora-rank", str(self.expert_rank)] if self.expert_rank else [])


def variants(ranks: Sequence[int], layouts: Sequence[str] = ("per-expert",),
             expert_ranks: Sequence[int] = ()) -> list[Variant]:
    return [Variant(rank, layout, expert_rank) for rank in sorted(ranks) for layout in layouts
            for expert_rank in (sorted(expert_ranks) or [0])]


@dataclass
class RankResult:
    variant: Variant
    run_dir: str
    curve: list[tuple[int, float]]  # (step, held-out loss), step 0 = before training
    accuracy_curve: list[tuple[int, float]] = field(default_factory=list)
    adapter_params: Optional[int] = None
    """Parameters of the trained adapter file; None where the run left none."""

    @property
    def rank(self) -> int:
        return self.variant.rank

    @property
    def size(self) -> tuple:
        """What "smallest" orders by: the adapter's parameters, then the ranks."""
        return (self.adapter_params or 0, self.rank, self.variant.expert_rank or self.rank)

    @property
    def final_loss(self) -> float:
        return self.curve[-1][1]

    @property
    def final_accuracy(self) -> Optional[float]:
        return self.accuracy_curve[-1][1] if self.accuracy_curve else None


def run_dir_for(sweep_dir: str, v: Variant) -> str:
    name = f"rank-{v.rank}" + (f"-{v.layout}" if v.layout != "per-expert" else "") + (
        f"-experts-{v.expert_rank}" if v.expert_rank else "")
    return os.path.join(sweep_dir, name)


def finetune_command(v: Variant, run_dir: str, finetune_args: Sequence[str], nproc: int,
                     alpha_ratio: float) -> list[str]:
    """The torchrun command of one run (flags after the user's, so they win)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "-m", "megatron_slmoe.training.finetune",
            *finetune_args, "--lora-rank", str(v.rank), "--lora-alpha",
            f"{alpha_ratio * v.rank:g}", *v.flags, "--output-dir", run_dir, "--no-plots"]


def run_rank(v: Variant, sweep_dir: str, finetune_args: Sequence[str], nproc: int,
             alpha_ratio: float) -> bool:
    """Fine-tune ``v`` unless a finished run is there; False when it was reused."""
    run_dir = run_dir_for(sweep_dir, v)
    if os.path.isfile(os.path.join(run_dir, "summary.json")):
        return False
    os.makedirs(run_dir, exist_ok=True)
    command = finetune_command(v, run_dir, finetune_args, nproc, alpha_ratio)
    with open(os.path.join(run_dir, "sweep.log"), "a", encoding="utf-8") as log:
        proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"the {v.label} run failed (exit {proc.returncode}); its output is "
                           f"in {os.path.join(run_dir, 'sweep.log')}")
    return True


def adapter_parameters(run_dir: str) -> Optional[int]:
    """Parameters in the run's saved adapter (``<run dir>/adapter``), from the file's header."""
    from safetensors import safe_open

    path = os.path.join(run_dir, "adapter", "adapter_model.safetensors")
    if not os.path.isfile(path):
        return None
    with safe_open(path, "pt") as handle:
        return sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys())


def read_result(variant: Variant, run_dir: str) -> RankResult:
    """The held-out curves of a finished run and its adapter's size."""
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
    return RankResult(variant, run_dir, curve, accuracy, adapter_parameters(run_dir))


def recommend(results: Sequence[RankResult], margin: float) -> RankResult:
    """The smallest adapter whose final held-out loss is at most ``(1 + margin)`` times the
    best."""
    best = min(r.final_loss for r in results)
    return min((r for r in results if r.final_loss <= best * (1.0 + margin)),
               key=lambda r: r.size)


def plot_sweep(results: Sequence[RankResult], chosen: RankResult, margin: float,
               path: str) -> str:
    """Held-out loss (and exact match) curves per run; with adapter sizes, a last panel of each
    run's final held-out loss against its adapter's parameters, one marker per expert layout."""
    import io

    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    ordered = sorted(results, key=lambda r: r.size)
    with_accuracy = any(r.accuracy_curve for r in results)
    with_sizes = any(r.adapter_params for r in results)
    panels = 1 + with_accuracy + with_sizes
    figure, axes = plt.subplots(panels, 1, figsize=(8.0, 3.5 * panels + 0.7), squeeze=False)
    loss_ax = axes[0][0]
    colours = dict(zip([r.variant for r in ordered], _COLOURS * (len(ordered) // 7 + 1)))
    for result in ordered:
        colour, width = colours[result.variant], 2.4 if result is chosen else 1.2
        steps, losses = zip(*result.curve)
        label = f"{result.variant.label}: {result.final_loss:.3f}"
        if result is chosen:
            label += "  (recommended)"
        loss_ax.plot(steps, losses, "o-", color=colour, markersize=3, linewidth=width,
                     label=label)
        if with_accuracy and result.accuracy_curve:
            a_steps, values = zip(*result.accuracy_curve)
            axes[1][0].plot(a_steps, [100 * v for v in values], "o-", color=colour,
                            markersize=3, linewidth=width, label=f"{result.variant.label}: "
                            f"{100 * result.final_accuracy:.1f}%")
    best = min(r.final_loss for r in results)
    loss_ax.axhline(best * (1 + margin), color="grey", linestyle="--", linewidth=0.8,
                    label=f"best + {margin:.0%}")
    finals = [r.final_loss for r in results]
    spread = max(finals) - min(finals)
    loss_ax.set_ylim(min(finals) - spread - 0.05, max(max(finals) + 3 * spread, best * 1.5) + 0.05)
    loss_ax.set_ylabel("held-out loss")
    loss_ax.set_xlabel("step")
    loss_ax.legend(fontsize=8, loc="upper right")
    loss_ax.grid(True, alpha=0.3)
    if with_accuracy:
        axes[1][0].set_ylabel("exact match (%)")
        axes[1][0].set_xlabel("step")
        axes[1][0].set_ylim(-2, 105)
        axes[1][0].legend(fontsize=8, loc="lower right")
        axes[1][0].grid(True, alpha=0.3)
    if with_sizes:
        size_ax = axes[-1][0]
        for result in (r for r in ordered if r.adapter_params):
            marker = "s" if result.variant.layout == "shared-outer" else "o"
            size_ax.scatter(result.adapter_params, result.final_loss, marker=marker, s=60 if
                            result is chosen else 30, color=colours[result.variant])
            size_ax.annotate(result.variant.label, (result.adapter_params, result.final_loss),
                             fontsize=7, xytext=(4, 3), textcoords="offset points")
        size_ax.axhline(best * (1 + margin), color="grey", linestyle="--", linewidth=0.8)
        size_ax.set_xscale("log")
        size_ax.set_xlabel("adapter parameters (o per-expert, [] shared-outer experts)")
        size_ax.set_ylabel("final held-out loss")
        size_ax.grid(True, alpha=0.3)
    figure.suptitle(f"LoRA sweep: {chosen.variant.label} is the smallest within {margin:.0%} "
                    f"of the best held-out loss", fontsize=11)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    plt.close(figure)
    write_bytes_atomic(path, buffer.getvalue())
    return path


def summarize(results: Sequence[RankResult], chosen: RankResult, margin: float) -> dict:
    best = min(x.final_loss for x in results)
    return {
        "margin": margin, "recommended_rank": chosen.rank,
        "recommended": {"rank": chosen.rank, "expert_layout": chosen.variant.layout,
                        "expert_rank": chosen.variant.expert_rank},
        "ranks": [{"rank": r.rank, "expert_layout": r.variant.layout,
                   "expert_rank": r.variant.expert_rank, "adapter_params": r.adapter_params,
                   "run_dir": r.run_dir, "final_eval_loss": r.final_loss,
                   "final_accuracy": r.final_accuracy,
                   "within_margin": r.final_loss <= best * (1 + margin)}
                  for r in sorted(results, key=lambda r: r.size)],
    }


def table(results: Sequence[RankResult], chosen: RankResult) -> str:
    width = max(len(r.variant.label) for r in results)
    lines = [f"{'run':<{width}}  {'adapter params':>14}  {'held-out loss':>13}  {'accuracy':>8}"]
    for r in sorted(results, key=lambda r: r.size):
        accuracy = "n/a" if r.final_accuracy is None else f"{r.final_accuracy:.1%}"
        params = "n/a" if r.adapter_params is None else f"{r.adapter_params:,}"
        lines.append(f"{r.variant.label:<{width}}  {params:>14}  {r.final_loss:>13.4f}  "
                     f"{accuracy:>8}" + ("  <- recommended" if r is chosen else ""))
    return "\n".join(lines)


def check_ranks(ranks: Sequence[int], flag: str = "--ranks") -> None:
    if not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"{flag} needs distinct ranks")
    for rank in ranks:
        if not 1 <= rank <= MAX_LORA_RANK:
            raise ValueError(f"{flag} {rank}: a LoRA rank is in 1..{MAX_LORA_RANK}")
