"""LoRA fine-tuning of Megatron-Core models with Stable Latent MoE layers.

* :class:`LoRAConfig` (``config``): rank, alpha, dropout, targets; adapter_config.json.
* :func:`inject_lora` (``inject``): adapters into the targeted modules, everything else frozen.
* ``layers``: the tensor-parallel-aware LoRA modules (linears, router, latent, experts).
* :func:`save_adapter` / :func:`load_adapter` / :func:`lora_state_dict` / :func:`merge_lora`
  (``adapter``): layout-independent safetensors adapters, and folding them into the base.
"""

from megatron_slmoe.lora.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterError,
    describe_adapter,
    load_adapter,
    lora_sharded_state_dict,
    lora_state_dict,
    merge_lora,
    read_adapter_config,
    save_adapter,
)
from megatron_slmoe.lora.config import TARGETS, LoRAConfig, read_base_info
from megatron_slmoe.lora.inject import LoRATargetError, inject_lora, lora_modules
from megatron_slmoe.lora.layers import (
    LoRAColumnParallelLinear,
    LoRALatentProjection,
    LoRALatentSwiGLUExperts,
    LoRARowParallelLinear,
    lora_router_class,
)

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
    "describe_adapter",
    "inject_lora",
    "load_adapter",
    "lora_modules",
    "lora_router_class",
    "lora_sharded_state_dict",
    "lora_state_dict",
    "merge_lora",
    "read_adapter_config",
    "read_base_info",
    "save_adapter",
]
