"""Kimi-K2.5 as an image-text model: transformers' MoonViT tower and projector in front of our
Megatron-Core DeepSeek-V3 language model (``model.tower_language.TowerLanguageModel``, built by
``hf.tower_model``).

Why the tower is transformers' module and not a Megatron-Core build: MoonViT takes images at
their own resolution (a variable number of 14x14 patches per image, attention within each image
only), adds a learned 64x64 position table resampled bicubically to each image's patch grid, and
rotates queries and keys by 2D (row, column) rotary positions; Megatron-Core's vision models
(CLIP, SigLIP, InternViT, RADIO ViTs under ``LLaVAModel``) have fixed image sizes, 1D learned
positions and no 2D rotary embedding. A re-implementation would be a second copy of MoonViT to
keep equal to transformers'; the module itself is exact by construction. The tower is ~0.5 B
parameters next to a ~1 T language model, so it is replicated on the first pipeline stage rather
than sharded, and frozen unless the run trains it.

The vision module's tensors are read whole, by transformers 5's names under ``model.``
(``model.vision_tower.*``, ``model.mm_projector.*``; what ``save_pretrained(
save_original_format=False)`` writes) or the published checkpoints' (``KimiK25Vision.hf_sources``).
The language model's tensors are read by the family table (``families.kimi_k25.family``), each rank its
own slices.
"""

from __future__ import annotations

import copy
import re
import torch

from megatron_slmoe.families.vision import ImageModel, VisionSource


# transformers' name in a MoonViT block -> the published checkpoints' (q/k/v: ``wqkv``).
_HUB_BLOCK_NAMES = (("norm1.", "norm0."), ("norm2.", "norm1."), ("attn.proj.", "wo."),
                    ("mlp.fc1.", "mlp.fc0."), ("mlp.fc2.", "mlp.fc1."))
# Outside the blocks: transformers' prefix -> the published names (the patch embedding has been
# written under ``encoder.`` too, by transformers' own original-format writer).
_HUB_NAMES = (
    ("vision_tower.patch_embed.pos_emb.position_embeddings",
     ("vision_tower.patch_embed.pos_emb.weight",)),
    ("vision_tower.patch_embed.", ("vision_tower.patch_embed.",
                                   "vision_tower.encoder.patch_embed.")),
    ("vision_tower.final_layernorm.", ("vision_tower.encoder.final_layernorm.",)),
    ("mm_projector.in_proj.", ("mm_projector.proj.0.",)),
    ("mm_projector.out_proj.", ("mm_projector.proj.2.",)),
    ("mm_projector.pre_norm.", ("mm_projector.pre_norm.",)),
)


class KimiK25Vision(ImageModel):
    """MoonViT and the projector: ``(pixel_values [patches, 3, 14, 14], image_grid_thw
    [images, 3])`` -> one embedding per merged 2x2 patch ``[tokens, text hidden]``, images in
    order, as ``Kimi_K25Model.get_image_features`` computes them."""

    hf_prefix = "model."
    lora_regions = {"vision_tower": "vision", "mm_projector": "projector"}
    lora_attention_linears = tuple(f"vision_tower.layers.*.attn.{name}"
                                   for name in ("q_proj", "k_proj", "v_proj", "proj"))

    def __init__(self, hf_config) -> None:
        from transformers import Kimi_K25VisionModel
        from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25MultimodalProjection

        super().__init__()
        vision_config = copy.deepcopy(hf_config.vision_config)
        vision_config._attn_implementation = "sdpa"
        self.vision_tower = Kimi_K25VisionModel(vision_config)
        self.mm_projector = Kimi_K25MultimodalProjection(hf_config)

    def hf_sources(self, name: str) -> list[VisionSource]:
        """Where the checkpoint stores tensor ``name`` of this module: transformers 5's name
        under ``model.``, else the published checkpoints' (MoonViT's original names, which
        transformers renames on load: ``encoder.blocks.N`` with ``norm0/norm1``, ``wo``,
        ``mlp.fc0/fc1``, q/k/v fused as ``wqkv`` with rotary rows interleaved per head; the
        projector's ``proj.0/proj.2``)."""
        sources = [VisionSource(self.hf_prefix + name)]
        block = re.match(r"vision_tower\.layers\.(\d+)\.(.+)$", name)
        if block:
            layer, rest = block.groups()
            qkv = re.match(r"attn\.([qkv])_proj\.(weight|bias)$", rest)
            base = f"vision_tower.encoder.blocks.{layer}."
            if qkv:
                part = "qkv".index(qkv.group(1))
                heads = self.vision_tower.config.num_attention_heads if part < 2 else None
                sources.append(VisionSource(f"{base}wqkv.{qkv.group(2)}", part, 3, heads))
            else:
                for ours, hub in _HUB_BLOCK_NAMES:
                    if rest.startswith(ours):
                        sources.append(VisionSource(base + hub + rest[len(ours):]))
                        break
            return sources
        for ours, hubs in _HUB_NAMES:
            if name.startswith(ours):
                sources += [VisionSource(hub + name[len(ours):]) for hub in hubs]
                break
        return sources

    def layer_shape(self) -> dict[str, int]:
        """What the memory check prices per tower layer (``hf.tower_model.vision_census``)."""
        config = self.vision_tower.config
        merge_h, merge_w = config.merge_kernel_size
        return {"layers": config.num_hidden_layers, "hidden": config.hidden_size,
                "heads": config.num_attention_heads, "ffn_hidden": config.intermediate_size,
                "patches_per_position": merge_h * merge_w}

    def blank_image(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The smallest input the tower takes (one merged patch of zeros) and its grid."""
        config = self.vision_tower.config
        merge_h, merge_w = config.merge_kernel_size
        patch = config.patch_size
        pixels = torch.zeros(merge_h * merge_w, 3, patch, patch, device=device,
                             dtype=self.mm_projector.in_proj.weight.dtype)
        return pixels, torch.tensor([[1, merge_h, merge_w]], device=device)

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        pooled = self.vision_tower(pixel_values, grid_thw=image_grid_thw).pooler_output
        return self.mm_projector(pooled.to(self.mm_projector.in_proj.weight.dtype)).squeeze(1)
