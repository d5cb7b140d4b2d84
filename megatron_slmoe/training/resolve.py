"""The run as it will execute, settled once the ranks have formed their group: the output
directory (rank 0's choice, so every rank writes into the same one), the precision of this
platform, the tokenizer of the base (``--hf-checkpoint``'s, or the one a ``--base-checkpoint``
was trained with) unless ``--tokenizer`` names one, and a PEFT
``--adapter-init`` converted to our adapter format. ``config.yaml`` records the result, so
feeding it back repeats the run."""

from __future__ import annotations

import os
import shutil
import time
from typing import Optional

import torch

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.data.tokenizer import tokenizer_source
from megatron_slmoe.hf import HFModel
from megatron_slmoe.hf.peft_import import is_peft_adapter, peft_to_adapter
from megatron_slmoe.lora.adapter import read_adapter_config
from megatron_slmoe.lora.config import LoRAConfig
from megatron_slmoe.runtime.model import resolve_precision
from megatron_slmoe.training.config import RunConfig


def resolve_run(run: RunConfig, platform, hf: Optional[HFModel] = None) -> RunConfig:
    """Collective: every rank calls it and gets the same answer. ``hf``: the run's opened
    --hf-checkpoint (a PEFT --adapter-init is converted against it, not a second opening)."""
    output_dir = [run.output.output_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))]
    torch.distributed.broadcast_object_list(output_dir, src=0)
    run = run.replace("output", output_dir=output_dir[0])
    if not run.data.tokenizer:  # the base's, recorded as a flag (the shipped one stays unset)
        source = tokenizer_source(None, run.model.hf_checkpoint, run.model.base_checkpoint)
        if source != tokenizer_source(None):
            run = run.replace("data", tokenizer=source)
    run = _adapter_from_peft(run, hf)
    return run.replace("model", precision=resolve_precision(run.model, platform))


def _adapter_from_peft(run: RunConfig, hf: Optional[HFModel]) -> RunConfig:
    """--adapter-init with a PEFT adapter of the --hf-checkpoint base: rank 0 converts it into
    ``<output dir>/adapter-init`` (megatron_slmoe.hf.peft_import) and the run takes that adapter
    and its LoRA settings (rank, alpha, targets; recorded in config.yaml)."""
    source = run.model.adapter_init
    if not source or not is_peft_adapter(source):
        return run
    converted, error = os.path.join(run.output.output_dir, "adapter-init"), None
    if torch.distributed.get_rank() == 0:
        try:
            if os.path.isdir(converted):  # a rerun converts afresh
                shutil.rmtree(converted)
            peft_to_adapter(source, hf or run.model.hf_checkpoint, converted,
                            dropout=run.lora.dropout)
        except Exception as err:  # noqa: BLE001  (every rank must hear of it, whatever it is)
            error = f"--adapter-init {source}: {' '.join(str(err).split()) or type(err).__name__}"
    status = [error]
    torch.distributed.broadcast_object_list(status, src=0)
    if status[0]:
        raise ConfigError(status[0])
    run = _with_adapter_shape(run, read_adapter_config(converted)[0])
    return run.replace("model", adapter_init=converted)


def _with_adapter_shape(run: RunConfig, lora: LoRAConfig) -> RunConfig:
    """The run's LoRA section with the adapter's ranks (the experts' own too), alpha and
    targets: what the adapter's tensors were made for."""
    return run.replace("lora", rank=lora.rank, alpha=lora.alpha, targets=list(lora.targets),
                       expert_rank=lora.expert_rank, moe_rank_scaling=lora.moe_rank_scaling)
