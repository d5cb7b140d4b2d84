"""PEFT's private names that megatron_slmoe uses."""

from __future__ import annotations

from typing import Optional

from peft.utils import transformers_weight_conversion as _conversion

from megatron_slmoe.compat import moved

TESTED = "0.21.2"


def moe_target_module_mapping(model_type: str) -> Optional[dict[str, str]]:
    """The module renames PEFT applies when it loads a per-expert adapter of ``model_type`` on
    transformers' fused experts (``gate_proj`` -> ``gate_up_proj``, ``gate`` -> ``gate.weight``,
    ...), or None where it converts nothing for that type. PEFT keeps these tables privately."""
    names = ("_MODEL_TO_CONVERSION_PATTERN", "_MOE_TARGET_MODULE_MAPPING")
    missing = [n for n in names if not hasattr(_conversion, n)]
    if missing:
        raise moved("peft", f"{_conversion.__name__}.{missing[0]}", TESTED)
    return _conversion._MOE_TARGET_MODULE_MAPPING.get(
        _conversion._MODEL_TO_CONVERSION_PATTERN.get(model_type))


__all__ = ["moe_target_module_mapping"]
