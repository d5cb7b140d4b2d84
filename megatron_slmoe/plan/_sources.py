"""The one place where the planner names modules outside ``megatron_slmoe.plan``: the model configs
(and Megatron's defaults of the multi-latent attention widths they may leave out), the dispatcher's
byte accounting, the LoRA target registry and what the packed expert kernels decode at once (all
read, no model is built)."""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.lora.config import TARGET_NAMES as LORA_TARGETS
from megatron_slmoe.model.model_file import ModelConfig, load_model_config
from megatron_slmoe.moe.dispatch.traffic import (
    expected_rows_per_destination,
    flat_traffic_rows,
    hierarchical_traffic_rows,
)
from megatron_slmoe.ops.lora_expert import PACKED_SCRATCH_BYTES
from megatron_slmoe.ops.quantized_weights import decode_chunk_bytes

# The CPU packed kernel's scratch tiles are per thread of this process's intra-op pool
# (at::get_num_threads()).
cpu_threads = torch.get_num_threads

MLA_DEFAULTS = {f.name: f.default for f in dataclasses.fields(MLATransformerConfig)
                if f.name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                              "v_head_dim")}

__all__ = ["ConfigError", "LORA_TARGETS", "MLA_DEFAULTS", "ModelConfig", "PACKED_SCRATCH_BYTES",
           "cpu_threads", "decode_chunk_bytes", "expected_rows_per_destination", "flat_traffic_rows",
           "hierarchical_traffic_rows", "load_model_config"]
