"""Base models, as every command finds them: what a base checkpoint records (its model config and
the tokenizer it was trained with), which model config and tokenizer a command uses, and whether
an adapter belongs to the base.

A base is a Megatron dist checkpoint (``--base-checkpoint``: a full fine-tune's ``--save-base``,
or ``slmoe-convert-hf import``'s output) or a Hugging Face checkpoint (``--hf-checkpoint``). Both
say what they are: a base checkpoint records its model config (``model_config.yaml``, the model
file, or ``model_config.txt``, the name of a packaged config) and its tokenizer (``tokenizer.json``,
with ``tokenizer_config.json`` for an imported HF checkpoint); an HF checkpoint has its
``config.json`` and tokenizer files. A flag that names them too must agree (one line otherwise).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.data.checks import check_same_tokenizer
from megatron_slmoe.data.tokenizer import BASE_TOKENIZER, tokenizer_source
from megatron_slmoe.lora.adapter import (
    AdapterError,
    base_identity,
    check_base_identity,
    read_adapter_config,
)
from megatron_slmoe.model.config import ModelSection
from megatron_slmoe.model.model_file import ModelConfig, load_model_config
from megatron_slmoe.runtime.model import open_model
from megatron_slmoe.storage.urls import is_object_url
from megatron_slmoe.utils.manifest import verify

BASE_MODEL_NAME = "model_config.txt"
"""The name of the packaged model config a base checkpoint was built from."""

BASE_MODEL_FILE = "model_config.yaml"
"""The model file a base checkpoint was built from (an import's, or a run's own file)."""


def recorded_model_config(directory: str) -> Optional[str]:
    """The model config a base checkpoint records, as ``--model-config`` takes it: its model file,
    else the name of the config it was saved from; None when it records neither."""
    model_file = os.path.join(directory, BASE_MODEL_FILE)
    if os.path.isfile(model_file):
        return model_file
    try:
        with open(os.path.join(directory, BASE_MODEL_NAME), encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def check_base_model(path: str, model_config: ModelConfig, flag: str) -> None:
    """Refuse a base checkpoint that records another model than ``model_config`` (compared by
    architecture; by name where the recorded config is not at hand). ``flag`` names it."""
    recorded = recorded_model_config(path)
    if recorded is None:
        return
    try:
        recorded_config = load_model_config(recorded)
    except ConfigError:  # a name of a config file that is not here: compare names
        recorded_config = None
    if recorded_config is not None:
        same = (dataclasses.replace(recorded_config, name="", source="")
                == dataclasses.replace(model_config, name="", source=""))
    else:
        same = recorded == model_config.name
    if not same:
        raise ConfigError(f"{flag} holds model {recorded!r} (recorded in the checkpoint), not "
                          f"{model_config.name!r} ({model_config.source})")


def check_base_checkpoint(path: Optional[str], model_config: ModelConfig, tokenizer) -> None:
    """A run's ``--base-checkpoint``: present and complete (the manifest's sizes, else the dist
    checkpoint's own files), made from this model config, trained with this tokenizer. A stored
    one is not inspected before the run (that would mean downloading it first)."""
    if not path or is_object_url(path):
        return
    flag = f"--base-checkpoint {path}"
    if not os.path.isdir(path):
        raise ConfigError(f"{flag} is not a directory")
    names = os.listdir(path)
    if not names:
        raise ConfigError(f"{flag} is an empty directory")
    if "MANIFEST.json" in names:
        problem = verify(path, checksums=False)
        if problem:
            raise ConfigError(f"{flag} is damaged: {problem} (an incomplete copy?)")
    else:  # written by another tool: at least Megatron's own files, none of them empty
        for required in ("metadata.json", ".metadata"):
            if required not in names:
                raise ConfigError(f"{flag} has no {required}: not a Megatron dist checkpoint, or "
                                  f"its save did not finish")
        for name in sorted(names):
            if name.endswith(".distcp") and os.path.getsize(os.path.join(path, name)) == 0:
                raise ConfigError(f"{flag}: {name} is empty (an incomplete copy?)")
    check_base_model(path, model_config, flag)
    recorded = os.path.join(path, BASE_TOKENIZER)
    if os.path.isfile(recorded):
        check_same_tokenizer(tokenizer, recorded, f"the tokenizer {flag} was trained with "
                                                  f"({recorded})")


def check_base_given(model: ModelSection) -> None:
    """LoRA adapts a trained model: on random weights it trains adapters for nothing."""
    if model.finetune_mode == "lora" and not (model.base_checkpoint or model.hf_checkpoint):
        raise ConfigError(
            "LoRA needs a trained base model: name one with --base-checkpoint DIR (a Megatron "
            "dist checkpoint, e.g. from --finetune-mode full --save-base DIR) or --hf-checkpoint "
            "DIR, run `bash scripts/pretrain_lora.sh` with no flags for the demo (it pretrains a "
            "tiny base first), or train every weight from scratch with --finetune-mode full")


@dataclass(frozen=True)
class Base:
    """The base model a command runs: its model config, its opened HF checkpoint (None for a
    Megatron base), the tokenizer to use, and the model section that loads its weights."""

    model_config: ModelConfig
    hf: object
    tokenizer: str
    section: object  # model.config.ModelSection


def open_base(*, base_checkpoint: Optional[str] = None, hf_checkpoint: Optional[str] = None,
              model_config: Optional[str] = None, tokenizer: Optional[str] = None,
              adapter: Optional[str] = None, check_shapes: bool = False) -> Base:
    """The base of ``slmoe-generate`` / ``slmoe-merge-lora``: exactly one of ``base_checkpoint``
    and ``hf_checkpoint``. The model config is ``model_config`` (which must agree with what the
    base records), else the base's record, else the adapter's; the tokenizer ``tokenizer``, else
    the base's (``data.tokenizer.tokenizer_source``). Needs no process group; ConfigError lines."""
    if bool(base_checkpoint) == bool(hf_checkpoint):
        raise ConfigError("name the base model with one of --base-checkpoint DIR and "
                          "--hf-checkpoint DIR")
    if hf_checkpoint:
        if model_config:
            raise ConfigError("--hf-checkpoint is the model (its config.json): drop --model-config")
        section = ModelSection(hf_checkpoint=hf_checkpoint, hf_shape_check=check_shapes)
        config, hf = open_model(section, check_shapes=check_shapes)
        return Base(config, hf, tokenizer_source(tokenizer, hf_checkpoint), section)
    flag = f"--base-checkpoint {base_checkpoint}"
    if not os.path.isdir(base_checkpoint):
        raise ConfigError(f"{flag}: no such directory")
    chosen = model_config or recorded_model_config(base_checkpoint)
    if chosen is None and adapter:
        try:
            chosen = read_adapter_config(adapter)[1].get("model_config")
        except AdapterError as err:
            raise ConfigError(str(err)) from None
    if chosen is None:
        raise ConfigError(f"{flag} records no model config: pass --model-config")
    config = load_model_config(chosen)
    if model_config:
        check_base_model(base_checkpoint, config, flag)
    section = ModelSection(config=chosen, base_checkpoint=base_checkpoint)
    return Base(config, None, tokenizer_source(tokenizer, base_checkpoint=base_checkpoint),
                section)


def check_adapter(adapter: str, model_config: ModelConfig, tokenizer) -> None:
    """Refuse, before anything loads, an adapter trained on another model or with another
    tokenizer than these (ConfigError naming both)."""
    try:
        _, recorded = read_adapter_config(adapter)
        check_base_identity(recorded, base_identity(model_config, tokenizer),
                            f"--adapter {adapter}", tokenizer_name=f"the tokenizer {tokenizer.path}"
                            f" (pass --tokenizer with the one the adapter was trained with)")
    except AdapterError as err:
        raise ConfigError(" ".join(str(err).split())) from None
