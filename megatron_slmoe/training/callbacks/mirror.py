"""``--output-url``: the run's outputs mirrored to object storage. Rank 0 uploads each checkpoint
once it is promoted (the newest ``--keep-last`` kept there too), and at the end the adapter, its
``--export-hf`` PEFT form, the pictures, ``config.yaml``, ``metrics.jsonl`` and, last,
``summary.json`` (its presence on the store means the run is complete there). A resumed run
fetches the newest stored checkpoint when it is newer than the local ones
(``megatron_slmoe.storage.transfer.OutputMirror``)."""

from __future__ import annotations

import os
from typing import Optional

import torch

from megatron_slmoe.training.callbacks.base import Callback
from megatron_slmoe.training.context import RunContext
class OutputMirror(Callback):
    name = "output_mirror"

    def __init__(self, output_url: str, keep_last: int, export_hf: Optional[str]) -> None:
        self.output_url, self.keep_last, self.export_hf = output_url, keep_last, export_hf
        self.mirror = None

    def setup(self, ctx: RunContext) -> None:
        if ctx.rank == 0:
            self.mirror = ctx.storage.output_mirror(self.output_url, self.keep_last)

    def newer_checkpoint(self, ctx: RunContext, local: Optional[str]) -> Optional[str]:
        """The newest complete stored checkpoint when it is newer than ``local`` (the newest
        intact local one), fetched into the run's checkpoint folder; collective."""
        restored = [None]
        if self.mirror is not None:
            restored[0] = self.mirror.restore_checkpoint(
                os.path.join(ctx.output_dir, "checkpoints"),
                os.path.basename(local) if local else None)
        torch.distributed.broadcast_object_list(restored, src=0)
        return restored[0]

    def checkpoint_promoting(self) -> None:
        if self.mirror is not None:  # the previous upload reads what pruning may remove
            self.mirror.wait()

    def checkpoint_promoted(self, path: str) -> None:
        if self.mirror is not None:
            self.mirror.submit_checkpoint(path)

    def finish(self, ctx: RunContext, summary: dict) -> None:
        if self.mirror is None:
            return
        self.mirror.wait()  # the last checkpoint first
        if summary.get("adapter_dir"):
            self.mirror.upload_directory(summary["adapter_dir"], "adapter")
        if self.export_hf:
            self.mirror.upload_directory(self.export_hf, "export-hf")
        if summary.get("plots"):
            self.mirror.upload_directory(os.path.dirname(summary["plots"][0]), "plots")
        for name in ("config.yaml", "metrics.jsonl", "summary.json"):
            self.mirror.upload_file(os.path.join(ctx.output_dir, name), name)
        ctx.info(f"[finetune] outputs on the store: {self.output_url}")
