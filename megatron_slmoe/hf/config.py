"""The run settings of a Hugging Face import, for the fine-tuning entry point's configuration tree.

The entry point builds the model from ``open_hf_checkpoint(hf_checkpoint).model_config`` (before
any process group forms: the checks there are the bad-input lines), calls
``load_hf_weights(model_chunks, hf_checkpoint, hf, unmap_after_bytes=...)`` after building it, and
takes the checkpoint directory as the default ``--tokenizer``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class HFImportConfig:
    hf_checkpoint: Optional[str] = None
    """``--hf-checkpoint``: a Hugging Face checkpoint directory (config.json, safetensors shards)
    to build the model from and load rank-locally; also the default tokenizer."""
    hf_shape_check: bool = True
    """``--hf-shape-check``: check every tensor against config.json before starting."""
    hf_unmap_mib: int = 64
    """``--hf-unmap-mib``: MiB of shard file pages a rank may have mapped while loading (its peak
    memory is its shard, one source tensor and this window)."""

    @property
    def unmap_after_bytes(self) -> int:
        return self.hf_unmap_mib * 2**20

    def validate(self) -> None:
        if self.hf_checkpoint is not None:
            if not os.path.isdir(self.hf_checkpoint):
                raise ValueError(f"--hf-checkpoint {self.hf_checkpoint}: no such directory")
            if not os.path.isfile(os.path.join(self.hf_checkpoint, "config.json")):
                raise ValueError(f"--hf-checkpoint {self.hf_checkpoint}: no config.json in it")
        if not isinstance(self.hf_unmap_mib, int) or self.hf_unmap_mib < 1:
            raise ValueError(f"--hf-unmap-mib must be a positive integer, got {self.hf_unmap_mib!r}")
