"""The start-up check of an adapter a run starts from (``--adapter-init``, in our format),
before any process group forms: one ConfigError line naming the flag and the file."""

from __future__ import annotations

import os

from safetensors import safe_open

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.lora.adapter import (
    ADAPTER_WEIGHTS,
    AdapterError,
    base_identity,
    check_base_identity,
    read_adapter_config,
)
from megatron_slmoe.lora.config import LoRAConfig


def check_adapter_init(path: str, lora: LoRAConfig, model_config, tokenizer) -> None:
    """Readable, with the run's LoRA rank, alpha and targets (``lora``), for this model (a
    ``ModelConfig``) and tokenizer."""
    flag = f"--adapter-init {path}"
    try:
        theirs_lora, base = read_adapter_config(path)
    except AdapterError as err:
        raise ConfigError(f"{flag}: {err}") from None
    for field in ("rank", "alpha", "targets"):
        theirs, ours = getattr(theirs_lora, field), getattr(lora, field)
        if (sorted(theirs) if field == "targets" else theirs) != (
                sorted(ours) if field == "targets" else ours):
            shown = " ".join(ours) if field == "targets" else ours
            raise ConfigError(f"{flag} has lora.{field} {theirs!r}, but "
                              f"{lora.flag(field)} is {shown}")
    try:
        check_base_identity(base, base_identity(model_config, tokenizer), flag,
                            tokenizer_name=f"--tokenizer {tokenizer.path}")
    except AdapterError as err:
        raise ConfigError(str(err)) from None
    weights = os.path.join(path, ADAPTER_WEIGHTS)
    try:
        with safe_open(weights, framework="pt", device="cpu") as handle:
            handle.keys()
    except Exception as err:  # noqa: BLE001  (safetensors raises several types)
        reason = " ".join(str(err).split())[:160]
        raise ConfigError(f"{flag}: {weights} is not a readable safetensors file "
                          f"({reason})") from None
