"""The checkpoint families we map between Hugging Face and Megatron-Core, one folder each, found
by ``config.json``'s ``architectures``.

A family folder holds everything true of one checkpoint family: its config reading and tensor
table (``family``), and for a multimodal one its tower and projector, image patches and position
ids. The protocol every family follows, with a default for each capability, is ``base.Family``
(``base.MultimodalFamily``); the vocabulary of its tables is ``kinds`` (mapping kinds) and
``layouts`` (on-disk expert layouts, renames); a vision side is a ``vision.ImageModel``.
``family_for(config, path)`` picks the family (an unknown architecture is one error line naming
the file and the families we know). The towers of our own image-text model (CLIP, SigLIP) map in
``megatron_slmoe.model.vision_mappings``.
"""

from __future__ import annotations

from megatron_slmoe.families.base import Family, MultimodalFamily
from megatron_slmoe.families.deepseek_v3.family import DeepseekV3Family
from megatron_slmoe.families.errors import HFCheckpointError
from megatron_slmoe.families.kimi_k25.family import KimiK25Family
from megatron_slmoe.families.kimi_k3.family import KimiK3Family
from megatron_slmoe.families.nemotron_h.family import NemotronHFamily
from megatron_slmoe.families.qwen3_moe.family import Qwen3MoeFamily
from megatron_slmoe.families.qwen3_vl_moe.family import Qwen3VLMoeFamily
from megatron_slmoe.families.slmoe.family import StableLatentMoeFamily

# The registry: adding a family is its folder and one line here.
FAMILIES: tuple[Family, ...] = (
    Qwen3MoeFamily(),
    DeepseekV3Family(),
    NemotronHFamily(),
    StableLatentMoeFamily(),
    KimiK25Family(),
    Qwen3VLMoeFamily(),
    KimiK3Family(),
)
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


__all__ = ["FAMILIES", "Family", "MultimodalFamily", "family_for"]
