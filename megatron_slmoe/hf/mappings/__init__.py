"""The model families we map between Hugging Face and Megatron-Core, by ``config.json``'s
``architectures``.

``family_for(config, path)`` picks the family (an unknown architecture is one error line naming
the file and the families we know). The tables live in one module per family; the kinds of
mapping they use in ``kinds``, the on-disk layouts of expert tensors in ``layouts``. The vision
towers of image-text models (CLIP, SigLIP) have theirs in ``megatron_slmoe.model.vision_mappings``.
"""

from __future__ import annotations

from megatron_slmoe.hf.errors import HFCheckpointError
from megatron_slmoe.hf.mappings.deepseek_v3 import DeepseekV3Family
from megatron_slmoe.hf.mappings.family import Family
from megatron_slmoe.hf.mappings.kimi_k25 import KimiK25Family
from megatron_slmoe.hf.mappings.nemotron_h import NemotronHFamily
from megatron_slmoe.hf.mappings.qwen3_moe import Qwen3MoeFamily
from megatron_slmoe.hf.mappings.qwen3_vl_moe import Qwen3VLMoeFamily
from megatron_slmoe.hf.mappings.slmoe import StableLatentMoeFamily

FAMILIES: tuple[Family, ...] = (Qwen3MoeFamily(), DeepseekV3Family(), NemotronHFamily(),
                                StableLatentMoeFamily(), KimiK25Family(), Qwen3VLMoeFamily())
_BY_ARCHITECTURE = {arch: family for family in FAMILIES for arch in family.architectures}


def family_for(config: dict, path: str) -> Family:
    """The family of the model a ``config.json`` describes."""
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not architectures:
        raise HFCheckpointError(f"{path}: no 'architectures' entry; supported: "
                                f"{', '.join(sorted(_BY_ARCHITECTURE))}")
    for arch in architectures:
        if arch in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[arch]
    raise HFCheckpointError(f"{path}: unknown architecture {architectures[0]!r}; supported: "
                            f"{', '.join(sorted(_BY_ARCHITECTURE))}")


__all__ = ["FAMILIES", "Family", "family_for"]
