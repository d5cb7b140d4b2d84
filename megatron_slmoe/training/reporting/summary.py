"""``summary.json`` (what a user or a script wants to know of a finished run: held-out loss and
accuracy before and after, the expert load, where the adapter and the pictures are) and the
pictures of the run (``reporting.plots``), with the closing lines of the log."""

from __future__ import annotations

import os

from megatron_slmoe.training.callbacks.base import Callback
from megatron_slmoe.training.context import RunContext
from megatron_slmoe.training.reporting.plots import plot_run
from megatron_slmoe.utils.atomic import write_json_atomic
from megatron_slmoe.utils.redact import redact_mapping


class RunSummary(Callback):
    """Comes after the callbacks that fill the summary in; paths in it are absolute."""

    name = "summary"

    def __init__(self, plots: bool) -> None:
        self.plots = plots

    def finish(self, ctx: RunContext, summary: dict) -> None:
        summary.setdefault("plots", [])
        if ctx.rank != 0:
            return
        path = os.path.join(ctx.output_dir, "summary.json")
        write_json_atomic(path, redact_mapping(summary))
        if self.plots:  # the pictures read metrics.jsonl and summary.json
            summary["plots"] = [os.path.abspath(p) for p in plot_run(ctx.output_dir)]
            write_json_atomic(path, redact_mapping(summary))
        before, after = summary["eval_loss_before"], summary["eval_loss_after"]
        accuracy = ""
        if summary.get("accuracy_before") is not None and summary.get("accuracy_after") is not None:
            accuracy = (f"; exact-match accuracy {summary['accuracy_before']:.1%} -> "
                        f"{summary['accuracy_after']:.1%}")
        ctx.info(f"[finetune] held-out loss {before:.4f} -> {after:.4f}{accuracy}; summary in "
                 f"{path}")
        if summary["plots"]:
            plots = summary["plots"]
            ctx.info(f"[finetune] pictures: {os.path.dirname(plots[0])} "
                     f"({', '.join(os.path.basename(p) for p in plots)})")
