"""Checks of the files a run configuration names, made before any process group forms: by the
launcher (``--validate-only``, before torchrun) and by every run at start-up. Each problem is one
ConfigError line naming the flag and the file."""

from __future__ import annotations

import os

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.config.run import RunConfig


def check_inputs(run: RunConfig) -> None:
    model, data = run.model, run.data
    for flag, path in (("--base-checkpoint", model.base_checkpoint),
                       ("--adapter-init", model.adapter_init), ("--tokenizer", data.tokenizer)):
        if path and not os.path.exists(path):
            raise ConfigError(f"{flag} {path}: no such file or directory")
    if data.format == "instruction":
        for flag, path in (("--train-data", data.train_data), ("--valid-data", data.valid_data)):
            if path and not os.path.isfile(path):
                raise ConfigError(f"{flag} {path}: no such file")
