"""LoRA fine-tuning of Megatron-Core models with Stable Latent MoE layers.

* ``targets``: the one registry of LoRA targets (which modules each name adapts, and how);
* ``inject``: :func:`inject_lora` puts adapters into the targeted modules, freezing the rest;
* ``base``, ``linear``, ``router``, ``latent``, ``experts``: the LoRA modules, by what they adapt;
* ``adapter``: layout-independent safetensors adapters (the file layout, save/load) and merging.

The LoRA settings are ``megatron_slmoe.config.run.LoRAConfig`` (re-exported here).
"""

from megatron_slmoe.config.run import LoRAConfig
from megatron_slmoe.lora.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterError,
    adapter_config_json,
    describe_adapter,
    load_adapter,
    lora_config_from_json,
    lora_sharded_state_dict,
    lora_state_dict,
    merge_lora,
    read_adapter_config,
    read_base_info,
    save_adapter,
)
from megatron_slmoe.lora.experts import LoRALatentSwiGLUExperts
from megatron_slmoe.lora.inject import adapters_disabled, inject_lora, lora_modules
from megatron_slmoe.lora.latent import LoRALatentProjection
from megatron_slmoe.lora.linear import LoRAColumnParallelLinear, LoRARowParallelLinear
from megatron_slmoe.lora.router import lora_router_class
from megatron_slmoe.lora.targets import TARGETS, LoRATargetError

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "AdapterError",
    "LoRAColumnParallelLinear",
    "LoRAConfig",
    "LoRALatentProjection",
    "LoRALatentSwiGLUExperts",
    "LoRARowParallelLinear",
    "LoRATargetError",
    "TARGETS",
    "adapter_config_json",
    "adapters_disabled",
    "describe_adapter",
    "inject_lora",
    "load_adapter",
    "lora_config_from_json",
    "lora_modules",
    "lora_router_class",
    "lora_sharded_state_dict",
    "lora_state_dict",
    "merge_lora",
    "read_adapter_config",
    "read_base_info",
    "save_adapter",
]
