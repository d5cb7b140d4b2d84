"""Where the numbers of a run go: metrics.jsonl and TensorBoard (rank 0 only; the progress line is
``reporting.progress``)."""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

from megatron_slmoe.utils.atomic import write_text_atomic

log = logging.getLogger(__name__)


class NoRecords:
    """The record sink of the ranks that do not write (all but rank 0)."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class MetricsWriter:
    """The run's record sink: appends one JSON object per record to ``metrics.jsonl`` and mirrors
    the scalar fields to TensorBoard. Only the writing rank constructs one.

    A run that starts at ``start_iteration`` (resumed from a checkpoint, or from scratch in a
    directory an earlier attempt wrote to) first drops the records of later iterations, which
    that attempt wrote and this one writes again: the file keeps one record per iteration, in
    order. TensorBoard purges those steps the same way."""

    def __init__(self, output_dir: str, tensorboard: bool = True,
                 start_iteration: int = 0) -> None:
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, "metrics.jsonl")
        _drop_records_after(path, start_iteration)
        self._jsonl = open(path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=os.path.join(output_dir, "tensorboard"),
                                         purge_step=start_iteration + 1)
            except ImportError:
                log.warning("tensorboard is not installed: no event files (pip install tensorboard)")

    def write(self, record: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps(record, sort_keys=True) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            step = record.get("iteration", 0)
            for key, value in _scalars(record):
                self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def _drop_records_after(path: str, iteration: int) -> None:
    """Rewrite ``path`` (atomically) without the records of iterations after ``iteration``, nor a
    last line cut short by a crash."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("iteration", 0) <= iteration:
            kept.append(line if line.endswith("\n") else line + "\n")
    if kept != lines:
        write_text_atomic(path, "".join(kept))


def _scalars(record: dict[str, Any], prefix: str = ""):
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool) or key == "iteration":
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            yield name, value
        elif isinstance(value, dict):
            yield from _scalars(value, prefix=f"{name}/")
