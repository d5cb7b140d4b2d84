"""Python front of the kernels: autograd functions, backend choice, pure-torch references.

Importing this package never fails for want of the native extension; ``native_kernels()`` and
``native_extension_error()`` say what was loaded, and ops without a kernel use their reference.
"""

from megatron_slmoe.ops._native import KERNELS_ENV, choose_backend, native_extension_error, native_kernels
from megatron_slmoe.ops.lora_expert import (
    LoRAGroupedLinear,
    LoRAGroupedWeights,
    expert_activation,
    lora_expert_mlp,
    lora_grouped_linear,
    lora_grouped_linear_reference,
)
from megatron_slmoe.ops.quantized_weights import PackedWeight, QuantizedWeightError

__all__ = [
    "KERNELS_ENV",
    "LoRAGroupedLinear",
    "LoRAGroupedWeights",
    "PackedWeight",
    "QuantizedWeightError",
    "choose_backend",
    "expert_activation",
    "lora_expert_mlp",
    "lora_grouped_linear",
    "lora_grouped_linear_reference",
    "native_extension_error",
    "native_kernels",
]
