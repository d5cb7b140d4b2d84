"""Pictures of a run, drawn from what it wrote (``metrics.jsonl`` and ``summary.json``) with
matplotlib's Agg backend, as PNG files in ``<run>/plots``:

=====================  ======================================================================
``loss.png``           training loss per step (and its moving average), held-out loss
``accuracy.png``       held-out exact-match accuracy by generation
``learning_rate.png``  the learning-rate schedule
``grad_norm.png``      gradient norm before clipping
``throughput.png``     training tokens per second
``expert_load.png``    per MoE layer, each expert's share of the routed tokens per step, as a
                       multiple of the fair share 1/E (a heatmap: dark rows are starving experts)
``routing_balance.png`` per MoE layer, load imbalance (max / mean tokens per expert) per step
``routing_drift.png``  per MoE layer, drift of the routing from the base model's on the probe batch
                       (KL divergence, top-k overlap, load change)
=====================  ======================================================================

A picture whose numbers the run does not have (no held-out accuracy for pretraining data, no
drift without LoRA) is not drawn. The held-out values before training come from ``summary.json``.
"""

from __future__ import annotations

import io
import json
import math
import os
from typing import Any, Optional

from megatron_slmoe.utils.atomic import write_bytes_atomic
from megatron_slmoe.utils.jsonl import numbered_records

PLOTS_DIR = "plots"
_WIDTH, _HEIGHT, _DPI = 8.0, 4.2, 110
_TRAIN, _HELD_OUT = "#1f77b4", "#d62728"


class RunDataError(ValueError):
    """A run directory without readable metrics (one line)."""


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/metrics.jsonl`` in file order; a resumed run's repeated
    iterations keep their last record."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise RunDataError(f"{run_dir}: no metrics.jsonl (is it the output directory of a run?)")
    by_iteration: dict[int, dict] = {}
    for _, record in numbered_records(path):
        try:
            by_iteration[int(record["iteration"])] = record
        except (ValueError, KeyError, TypeError):
            # A run killed mid-write can leave a torn last line: skip it, not the run.
            continue
    if not by_iteration:
        raise RunDataError(f"{path}: no records")
    return [by_iteration[i] for i in sorted(by_iteration)]


def _read_summary(run_dir: str) -> dict[str, Any]:
    try:
        with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return {}


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            steps.append(record["iteration"])
            values.append(float(value))
    return steps, values


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _layers(records: list[dict]) -> list[str]:
    names = {name for r in records for name in r.get("moe", {}).get("layers", {})}
    return sorted(names, key=int)


class _Figure:
    """One PNG: a matplotlib figure written atomically on ``save``."""

    def __init__(self, rows: int = 1, cols: int = 1, height: Optional[float] = None,
                 sharex: bool = True):
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt

        self.plt = plt
        self.figure, axes = plt.subplots(rows, cols, figsize=(_WIDTH, height or _HEIGHT),
                                         sharex=sharex, squeeze=False)
        self.axes = [ax for row in axes for ax in row]
        for ax in self.axes:
            ax.grid(True, alpha=0.3)

    def save(self, path: str, title: str) -> str:
        self.figure.suptitle(title, fontsize=11)
        self.figure.tight_layout()
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png", dpi=_DPI)
        self.plt.close(self.figure)
        write_bytes_atomic(path, buffer.getvalue())
        return path


def plot_run(run_dir: str, out_dir: Optional[str] = None) -> list[str]:
    """Draw every picture the run's numbers allow; returns the paths written (in ``out_dir``,
    default ``<run_dir>/plots``)."""
    records = read_metrics(run_dir)
    summary = _read_summary(run_dir)
    out_dir = out_dir or os.path.join(run_dir, PLOTS_DIR)
    name = os.path.basename(os.path.normpath(run_dir))
    written = []
    for draw in (_loss, _accuracy, _learning_rate, _grad_norm, _throughput, _expert_load,
                 _routing_balance, _routing_drift):
        path = draw(records, summary, out_dir, name)
        if path:
            written.append(path)
    return written


def _loss(records, summary, out_dir, name):
    steps, losses = _series(records, "loss")
    if not steps:
        return None
    fig = _Figure()
    ax = fig.axes[0]
    ax.plot(steps, losses, color=_TRAIN, alpha=0.3, linewidth=0.8, label="training (per step)")
    window = max(1, len(steps) // 25)
    if window > 1:
        ax.plot(steps, _moving_average(losses, window), color=_TRAIN, linewidth=1.6,
                label=f"training ({window}-step average)")
    eval_steps, eval_losses = _series(records, "eval_loss")
    before = summary.get("eval_loss_before")
    if isinstance(before, (int, float)):
        eval_steps, eval_losses = [0] + eval_steps, [float(before)] + eval_losses
    if eval_steps:
        ax.plot(eval_steps, eval_losses, "o-", color=_HELD_OUT, linewidth=1.6, markersize=4,
                label="held-out")
        ax.annotate(f"{eval_losses[-1]:.3f}", (eval_steps[-1], eval_losses[-1]),
                    textcoords="offset points", xytext=(-4, 6), ha="right", fontsize=8,
                    color=_HELD_OUT)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / target token)")
    ax.legend(loc="upper right", fontsize=8)
    return fig.save(os.path.join(out_dir, "loss.png"), f"{name}: loss")


def _accuracy(records, summary, out_dir, name):
    steps, values = _series(records, "eval_accuracy")
    before = summary.get("accuracy_before")
    if isinstance(before, (int, float)):
        steps, values = [0] + steps, [float(before)] + values
    if not steps:
        return None
    fig = _Figure()
    ax = fig.axes[0]
    percent = [100.0 * v for v in values]
    ax.plot(steps, percent, "o-", color=_HELD_OUT, linewidth=1.6, markersize=4)
    for x, y in ((steps[0], percent[0]), (steps[-1], percent[-1])):
        ax.annotate(f"{y:.1f}%", (x, y), textcoords="offset points", xytext=(0, 7),
                    ha="center", fontsize=8)
    ax.set_ylim(-2, 105)
    ax.set_xlabel("step")
    ax.set_ylabel("exact match (%)")
    return fig.save(os.path.join(out_dir, "accuracy.png"),
                    f"{name}: held-out exact-match accuracy (greedy generation)")


def _simple(records, key, out_dir, file_name, title, ylabel, name, log_scale=False):
    steps, values = _series(records, key)
    if not steps:
        return None
    fig = _Figure()
    ax = fig.axes[0]
    ax.plot(steps, values, "-" if len(steps) > 20 else "o-", color=_TRAIN, linewidth=1.4,
            markersize=3)
    if log_scale and min(values) > 0:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    return fig.save(os.path.join(out_dir, file_name), f"{name}: {title}")


def _learning_rate(records, summary, out_dir, name):
    return _simple(records, "lr", out_dir, "learning_rate.png", "learning rate", "learning rate",
                   name)


def _grad_norm(records, summary, out_dir, name):
    return _simple(records, "grad_norm", out_dir, "grad_norm.png",
                   "gradient norm (before clipping)", "L2 norm", name, log_scale=True)


def _throughput(records, summary, out_dir, name):
    return _simple(records, "tokens_per_s", out_dir, "throughput.png",
                   "training throughput (evaluation excluded)", "tokens / s", name)


def _expert_load(records, summary, out_dir, name):
    import numpy as np

    layers = _layers(records)
    if not layers:
        return None
    fig = _Figure(rows=len(layers), height=1.0 + 1.6 * len(layers))
    image = None
    for ax, layer in zip(fig.axes, layers):
        steps, columns = [], []
        for record in records:
            counts = record.get("moe", {}).get("layers", {}).get(layer, {}).get("tokens_per_expert")
            if counts and sum(counts) > 0:
                steps.append(record["iteration"])
                columns.append([c * len(counts) / sum(counts) for c in counts])
        if not columns:
            continue
        load_ES = np.array(columns).T  # experts x steps, as multiples of the fair share
        image = ax.imshow(load_ES, aspect="auto", origin="lower", cmap="magma", vmin=0.0,
                          vmax=3.0, interpolation="nearest",
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, load_ES.shape[0] - 0.5))
        ax.set_ylabel(f"layer {layer}\nexpert")
        ax.grid(False)
        if load_ES.shape[0] <= 16:
            ax.set_yticks(range(load_ES.shape[0]))
            ax.tick_params(axis="y", labelsize=7)
    fig.axes[-1].set_xlabel("step")
    if image is not None:
        bar = fig.figure.colorbar(image, ax=fig.axes, fraction=0.025, pad=0.02)
        bar.set_label("share x E (1 = fair)")
    fig.figure.set_layout_engine("constrained")
    fig.figure.suptitle(f"{name}: expert load per step (share of routed tokens / fair share)",
                        fontsize=11)
    buffer = io.BytesIO()
    fig.figure.savefig(buffer, format="png", dpi=_DPI)
    fig.plt.close(fig.figure)
    path = os.path.join(out_dir, "expert_load.png")
    write_bytes_atomic(path, buffer.getvalue())
    return path


def _routing_balance(records, summary, out_dir, name):
    layers = _layers(records)
    if not layers:
        return None
    fig = _Figure()
    ax = fig.axes[0]
    for layer in layers:
        steps = [r["iteration"] for r in records
                 if r.get("moe", {}).get("layers", {}).get(layer, {}).get("imbalance")]
        values = [r["moe"]["layers"][layer]["imbalance"] for r in records
                  if r.get("moe", {}).get("layers", {}).get(layer, {}).get("imbalance")]
        ax.plot(steps, values, linewidth=1.2, label=f"layer {layer}")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean tokens per expert")
    ax.legend(loc="upper right", fontsize=8)
    return fig.save(os.path.join(out_dir, "routing_balance.png"),
                    f"{name}: load imbalance per MoE layer (1 = balanced)")


def _routing_drift(records, summary, out_dir, name):
    layers = _layers(records)
    panels = (("drift_kl", "KL(base || now)\nper token"),
              ("drift_topk_overlap", "top-k overlap\nwith base"),
              ("drift_load_change", "load change\n(total variation)"))
    have = any(r.get("moe", {}).get("layers", {}).get(layer, {}).get("drift_kl") is not None
               for r in records for layer in layers)
    if not have:
        return None
    fig = _Figure(rows=3, height=7.0)
    for ax, (key, label) in zip(fig.axes, panels):
        for layer in layers:
            points = [(r["iteration"], r["moe"]["layers"][layer][key]) for r in records
                      if isinstance(r.get("moe", {}).get("layers", {}).get(layer, {}).get(key),
                                    (int, float))]
            if points:
                steps, values = zip(*([(0, 1.0 if key == "drift_topk_overlap" else 0.0)]
                                      + points))
                ax.plot(steps, values, "o-", linewidth=1.2, markersize=3, label=f"layer {layer}")
        ax.set_ylabel(label, fontsize=9)
    fig.axes[1].set_ylim(-0.02, 1.02)
    fig.axes[0].legend(loc="upper left", fontsize=8)
    fig.axes[-1].set_xlabel("step")
    return fig.save(os.path.join(out_dir, "routing_drift.png"),
                    f"{name}: routing drift from the base model (held-out probe batch)")
