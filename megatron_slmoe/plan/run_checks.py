"""The planner's start-up checks of a fine-tuning run, before any process group forms: its layout
against the device memory (``--memory-check``) and its checkpoints against the free space of
``--output-dir``. The training side describes the run (``plan.settings.RunSettings``); these
price it. Each refusal is one ConfigError line naming the flag."""

from __future__ import annotations

import logging
import shutil
from typing import Optional

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.plan._sources import ModelConfig
from megatron_slmoe.plan.check import LayoutCheck
from megatron_slmoe.plan.devices import generic_device
from megatron_slmoe.plan.memory import estimate_memory
from megatron_slmoe.plan.model_shape import ModelShape, census
from megatron_slmoe.plan.settings import RunSettings
from megatron_slmoe.storage.checks import nearest_existing
from megatron_slmoe.utils.sizes import format_bytes

log = logging.getLogger(__name__)

CHECKPOINT_BYTES_PER_TRAINABLE = 4 + 8
"""A checkpoint holds each trainable parameter in fp32 and Adam's two fp32 moments."""


def apply_memory_verdict(check: Optional[LayoutCheck], mode: str) -> None:
    """``--memory-check`` ``mode`` (refuse, warn) applied to the planner's verdict on the layout
    (``plan.check.check_layout``; None: no device memory to plan against)."""
    if check is None or check.fits:
        return
    if mode == "refuse":
        raise ConfigError(f"{check.message} (run anyway: --memory-check warn)")
    log.warning("memory check: %s", check.message)


def check_checkpoint_space(output_dir: Optional[str], model_config: ModelConfig,
                           settings: RunSettings, full: bool, keep_last: int,
                           save_base: bool) -> None:
    """The file system of ``output_dir`` (``--output-dir``; None: ``runs``) has room for the
    ``keep_last`` + 1 checkpoints the run keeps of its trainable parameters (all of them when
    ``full``, else the LoRA ones ``settings`` gives) and the base it writes with ``save_base``:
    a full disk is found now, not in the middle of a save."""
    out = output_dir or "runs"
    shape = ModelShape.from_config(model_config)
    whole = settings.replace(tp=1, pp=1, ep=1, dp=1, vision=None)
    if full:
        trainable = census(shape)["total_params"]
    else:
        trainable = estimate_memory(shape, whole, generic_device(2**50)).stages[0].trainable_params
    needed = trainable * CHECKPOINT_BYTES_PER_TRAINABLE * (keep_last + 1)
    if save_base:
        needed += census(shape)["total_params"] * 4
    free = shutil.disk_usage(nearest_existing(out)).free
    if needed > free:
        raise ConfigError(
            f"--output-dir {out}: its file system has {format_bytes(free)} free; the run's "
            f"checkpoints need about {format_bytes(needed)} ({trainable:,} trainable parameters, "
            f"--keep-last {keep_last}{' and --save-base' if save_base else ''}"
            f"): free space, lower --keep-last, or write elsewhere")
