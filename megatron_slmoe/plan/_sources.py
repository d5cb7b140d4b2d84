"""The one place where the planner names modules outside ``megatron_slmoe.plan``: the model configs,
the dispatcher's byte accounting and the LoRA target registry (all read, no model is built)."""

from __future__ import annotations

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.lora.targets import TARGETS as LORA_TARGETS
from megatron_slmoe.model.config import ModelConfig, load_model_config
from megatron_slmoe.moe.dispatch.alltoall import (
           flat_traffic_rows,
           hierarchical_traffic_rows,
)

__all__ = ["ConfigError", "LORA_TARGETS", "ModelConfig", "flat_traffic_rows",
           "hierarchical_traffic_rows", "load_model_config"]
