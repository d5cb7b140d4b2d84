"""Kimi-K2.5 as an image-text model: transformers' MoonViT tower and projector in front of our
Megatron-Core DeepSeek-V3 language model (``model.tower_language.TowerLanguageModel``).

Why the tower is transformers' module and not a Megatron-Core build: MoonViT takes images at
their own resolution (a variable number of 14x14 patches per image, attention within each image
only), adds a learned 64x64 position table resampled bicubically to each image's patch grid, and
rotates queries and keys by 2D (row, column) rotary positions; Megatron-Core's vision models
(CLIP, SigLIP, InternViT, RADIO ViTs under ``LLaVAModel``) have fixed image sizes, 1D learned
positions and no 2D rotary embedding. A re-implementation would be a second copy of MoonViT to
keep equal to transformers'; the module itself is exact by construction. The tower is ~0.4 B
parameters next to a ~1 T language model, so it is replicated on the first pipeline stage rather
than sharded, and frozen unless the run trains it.

The vision module's parameter names are the checkpoint's under ``model.`` in transformers 5's
layout (``model.vision_tower.*``, ``model.mm_projector.*``; what ``save_pretrained(
save_original_format=False)`` writes). The language model's tensors are read by the family table
(``mappings.kimi_k25``), each rank its own slices.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Callable, Optional

import torch

from megatron_slmoe.model.build import build_gpt_model
from megatron_slmoe.model.tower_language import TowerLanguageModel


class KimiK25Vision(torch.nn.Module):
    """MoonViT and the projector: ``(pixel_values [patches, 3, 14, 14], image_grid_thw
    [images, 3])`` -> one embedding per merged 2x2 patch ``[tokens, text hidden]``, images in
    order, as ``Kimi_K25Model.get_image_features`` computes them."""

    hf_prefix = "model."

    def __init__(self, hf_config) -> None:
        from transformers import Kimi_K25VisionModel
        from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25MultimodalProjection

        super().__init__()
        vision_config = copy.deepcopy(hf_config.vision_config)
        vision_config._attn_implementation = "sdpa"
        self.vision_tower = Kimi_K25VisionModel(vision_config)
        self.mm_projector = Kimi_K25MultimodalProjection(hf_config)

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        pooled = self.vision_tower(pixel_values, grid_thw=image_grid_thw).pooler_output
        return self.mm_projector(pooled.to(self.mm_projector.in_proj.weight.dtype)).squeeze(1)


def build_kimi_k25(model_config, transformer_config, pre_process: bool = True,
                   post_process: bool = True, *, hf_config) -> TowerLanguageModel:
    """This rank's pipeline stage of Kimi-K2.5: the language model from ``model_config`` (the
    family's reading of ``text_config``) under the run's ``transformer_config``, the vision
    module from ``hf_config`` (transformers' ``Kimi_K25Config``) on the first stage."""
    language = build_gpt_model(model_config, transformer_config, pre_process=pre_process,
                               post_process=post_process,
                               scatter_embedding_sequence_parallel=False)
    vision = KimiK25Vision(hf_config) if pre_process else None
    if vision is not None:
        vision.to(transformer_config.params_dtype)
    return TowerLanguageModel(language, vision, image_token_id=hf_config.image_token_id)


def hf_model_builder(hf) -> Optional[Callable]:
    """How a run builds the model of an opened checkpoint (``hf.HFModel``): the image-text
    model's builder for a family that has a vision side (a text task then trains its language
    model with the tower present and unused, so adapters keep the checkpoint's names), None for
    a language model (the task builds it)."""
    if hf is None or not hf.family.multimodal:
        return None
    return partial(build_kimi_k25, hf_config=hf.family.hf_config(hf.checkpoint.config_path))
