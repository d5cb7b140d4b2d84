"""The start-up check of a run already in ``--output-dir``: it is resumed only with the settings it
was started with, never with fewer steps than it has trained, and not redone once finished
(``RunFinished``). One ConfigError line naming the flag otherwise."""

from __future__ import annotations

import json
import os

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.data.tokenizer import tokenizer_source
from megatron_slmoe.runtime.model import resolve_precision
from megatron_slmoe.training.cli import build_run_config, read_yaml
from megatron_slmoe.training.config import RunConfig, RunFinished
from megatron_slmoe.utils.manifest import verify

# Settings a run must keep to be resumed: what it trains, on which data, with which optimizer.
# The layout (parallel sizes), intervals, --train-iters (a larger one extends the schedule) and
# the output options may change.
RESUME_MUST_MATCH = (
    ("model", ("config", "base_checkpoint", "finetune_mode", "precision")),
    ("lora", ("rank", "alpha", "targets", "dropout")),
    ("data", ("format", "train_data", "valid_data", "tokenizer", "seq_length")),
    ("optimizer", ("lr", "min_lr", "lr_warmup_iters", "lr_decay_style", "weight_decay",
                   "adam_beta1", "adam_beta2", "clip_grad")),
    ("schedule", ("global_batch_size", "seed")),
)
_PATHS = {"base_checkpoint", "train_data", "valid_data", "tokenizer"}


def check_resume(run: RunConfig, platform) -> None:
    """A run already in --output-dir is resumed: with the settings it was started with, and not
    redone once finished."""
    out = run.output.output_dir
    root = os.path.join(out or "", "checkpoints")
    if not out or not run.output.resume or not os.path.isdir(root):
        return
    iterations = sorted(int(n[len("iter_"):]) for n in os.listdir(root)
                        if n.startswith("iter_") and n[len("iter_"):].isdigit())
    if not iterations:
        return
    earlier_path = os.path.join(out, "config.yaml")
    if os.path.isfile(earlier_path):
        _check_same_settings(run, earlier_path, platform)
    trained = next((i for i in reversed(iterations)
                    if verify(os.path.join(root, f"iter_{i:07d}"), checksums=False) is None), 0)
    if trained > run.schedule.train_iters:
        raise ConfigError(f"--train-iters {run.schedule.train_iters} is below the {trained} steps "
                          f"the run in {out} has trained (resume it with at least {trained})")
    if trained == run.schedule.train_iters and _summary_steps(out) == trained:
        raise RunFinished(f"the run in {out} has finished all {trained} steps (summary.json); "
                          f"nothing to do: a larger --train-iters continues it, another "
                          f"--output-dir starts a new one")


def _summary_steps(out: str):
    """The steps summary.json reports (written when a run finishes), or None."""
    try:
        with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
            return json.load(f).get("steps")
    except (OSError, ValueError, AttributeError):
        return None


def _check_same_settings(run: RunConfig, earlier_path: str, platform) -> None:
    try:
        earlier = build_run_config(read_yaml(earlier_path))
    except ConfigError as err:
        raise ConfigError(f"{earlier_path}, the configuration of the run this would resume, is "
                          f"unreadable: {err}") from None
    for section, names in RESUME_MUST_MATCH:
        for name in names:
            ours, theirs = (getattr(getattr(c, section), name) for c in (run, earlier))
            if name == "precision":
                ours, theirs = (resolve_precision(c.model, platform) for c in (run, earlier))
            elif name == "tokenizer":  # as resolved: the flag, else the base's, ...
                ours, theirs = (os.path.abspath(tokenizer_source(
                    c.data.tokenizer, c.model.hf_checkpoint, c.model.base_checkpoint))
                    for c in (run, earlier))
            elif name in _PATHS:
                ours, theirs = (os.path.abspath(p) if p else p for p in (ours, theirs))
            elif name == "targets":
                ours, theirs = sorted(ours), sorted(theirs)
            if ours != theirs:
                flag = getattr(run, section).flag(name)
                raise ConfigError(
                    f"{flag} {_shown(ours)} differs from {_shown(theirs)} in {earlier_path}, the "
                    f"run this would resume (resume it unchanged, or start over there with "
                    f"--no-resume, or use another --output-dir)")


def _shown(value) -> str:
    if value is None:
        return "(unset)"
    return " ".join(value) if isinstance(value, list) else str(value)
