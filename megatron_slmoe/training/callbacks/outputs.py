"""What a run leaves behind besides its checkpoints: the LoRA adapter (and, with
``--export-hf``, its PEFT form for the Hugging Face base), or with ``--save-base`` the whole
fine-tuned model as a base for LoRA runs."""

from __future__ import annotations

import os
from typing import Optional

import torch

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.hf.peft_export import export_peft_adapter
from megatron_slmoe.lora.adapter import base_identity, save_adapter
from megatron_slmoe.lora.config import LoRAConfig
from megatron_slmoe.model.config import ModelSection
from megatron_slmoe.storage.urls import is_object_url
from megatron_slmoe.training.callbacks.base import Callback
from megatron_slmoe.training.checkpointing import save_base_checkpoint
from megatron_slmoe.training.context import RunContext


class AdapterExport(Callback):
    """``<output dir>/adapter`` (layout independent: any layout can load it), recording the base
    it adapts and the tokenizer; ``export_hf``: also a PEFT adapter of ``model.hf_checkpoint``."""

    name = "adapter"

    def __init__(self, lora: LoRAConfig, model: ModelSection, export_hf: Optional[str] = None,
                 export_hf_layout: str = "per-expert") -> None:
        self.lora, self.model = lora, model
        self.export_hf, self.export_hf_layout = export_hf, export_hf_layout

    def finish(self, ctx: RunContext, summary: dict) -> None:
        where = {flag: path if path is None or is_object_url(path) else os.path.abspath(path)
                 for flag, path in (("base_checkpoint", self.model.base_checkpoint),
                                    ("hf_checkpoint", self.model.hf_checkpoint))}
        base = {**base_identity(ctx.model_config, ctx.tokenizer), **where}
        adapter_dir = save_adapter([ctx.model], os.path.join(ctx.output_dir, "adapter"),
                                   self.lora, base)
        summary["adapter_dir"] = adapter_dir
        if self.export_hf:
            self.export_peft(ctx, adapter_dir)
        ctx.info(f"[finetune] adapter: {adapter_dir}")

    def export_peft(self, ctx: RunContext, adapter_dir: str) -> None:
        """Rank 0 writes the saved adapter as a PEFT adapter of the HF base (no collective
        inside: the adapter file is layout independent); every rank raises its error."""

        error = None
        if ctx.rank == 0:
            try:
                # the checkpoint the run opened, not a second opening
                export_peft_adapter(adapter_dir, ctx.hf or self.model.hf_checkpoint,
                                    self.export_hf, layout=self.export_hf_layout)
                ctx.info(f"[finetune] PEFT adapter: {self.export_hf}")
            except Exception as err:  # noqa: BLE001  (every rank must hear of it)
                error = f"--export-hf {self.export_hf}: {err}"
        status = [error]
        torch.distributed.broadcast_object_list(status, src=0)
        if status[0]:
            raise ConfigError(status[0])


class BaseExport(Callback):
    """``--save-base DIR``: the whole model as a Megatron dist checkpoint with its model config
    and tokenizer (``checkpointing.save_base_checkpoint``)."""

    name = "save_base"

    def __init__(self, directory: str, model_file: Optional[str]) -> None:
        self.directory, self.model_file = directory, model_file

    def finish(self, ctx: RunContext, summary: dict) -> None:
        model_file = self.model_file if self.model_file and os.path.isfile(self.model_file) \
            else None
        save_base_checkpoint(ctx.model, self.directory, ctx.model_config.name, ctx.tokenizer,
                             model_file)
