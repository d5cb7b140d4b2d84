"""Qwen3-VL-MoE as an image-text model: transformers' Qwen3-VL vision tower, merger and
DeepStack mergers in front of our Megatron-Core Qwen3-MoE language model
(``model.tower_language.TowerLanguageModel``).

The tower is transformers' module, replicated on the first pipeline stage, for the reasons
``families.kimi_k25.vision`` gives (native resolution, a resampled learned position table, 2D rotary
positions). Two things reach the language model besides the image embeddings: DeepStack features
(the merged outputs of some tower layers, added to the outputs of the first decoder layers at the
image positions) and 3D rotary positions for its interleaved M-RoPE (``position_ids``:
transformers' own ``get_rope_index``).
"""

from __future__ import annotations

import copy
from functools import partial
from types import SimpleNamespace

import torch

from megatron_slmoe.families.vision import ImageModel
from megatron_slmoe.model.tower_language import ImageTokenMismatch


class Qwen3VLMoeVision(ImageModel):
    """``(pixel_values [patches, C * T * P * P], image_grid_thw [images, 3])`` -> (one embedding
    per merged 2x2 patch ``[tokens, text hidden]``, a DeepStack feature of the same shape per
    ``deepstack_visual_indexes`` layer), images in order, as transformers'
    ``Qwen3VLMoeModel.get_image_features`` computes them."""

    hf_prefix = "model."
    # The mergers sit inside the tower.
    lora_regions = {"visual": "vision", "visual.merger": "projector",
                    "visual.deepstack_merger_list": "projector"}
    lora_attention_linears = ("visual.blocks.*.attn.qkv", "visual.blocks.*.attn.proj")

    def __init__(self, hf_config) -> None:
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
            Qwen3VLMoeVisionModel,
        )

        super().__init__()
        vision_config = copy.deepcopy(hf_config.vision_config)
        vision_config._attn_implementation = "sdpa"
        self.visual = Qwen3VLMoeVisionModel(vision_config)
        self._hf_config = hf_config

    @property
    def deepstack_layers(self) -> int:
        return len(self.visual.config.deepstack_visual_indexes)

    def layer_shape(self) -> dict[str, int]:
        """What the memory check prices per tower layer (``hf.tower_model.vision_census``; its
        activation rules are MoonViT's, held to autograd there, not yet to this tower)."""
        config = self.visual.config
        return {"layers": config.depth, "hidden": config.hidden_size,
                "heads": config.num_heads, "ffn_hidden": config.intermediate_size,
                "patches_per_position": config.spatial_merge_size ** 2}

    def blank_image(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The smallest input the tower takes (one merged patch of zeros) and its grid."""
        config = self.visual.config
        merge = config.spatial_merge_size
        width = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
        pixels = torch.zeros(merge * merge, width, device=device,
                             dtype=self.visual.patch_embed.proj.weight.dtype)
        return pixels, torch.tensor([[1, merge, merge]], device=device)

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor):
        out = self.visual(pixel_values, grid_thw=image_grid_thw, return_dict=True)
        return out.pooler_output, list(out.deepstack_features)



def rope_positions(hf_config, input_ids: torch.Tensor,
                   image_grid_thw: torch.Tensor | None,
                   video_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
    """[3, B, S] rotary positions (temporal, height, width) of a batch, by transformers'
    ``Qwen3VLMoeModel.get_rope_index`` (it reads only the merge size from its model): a video's
    frames each placed like an image (the timestamps between them are text); every pipeline
    stage computes them from the ids and the grids."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeModel

    model = SimpleNamespace(
        config=hf_config,
        get_vision_position_ids=partial(Qwen3VLMoeModel.get_vision_position_ids, None))
    image = input_ids == hf_config.image_token_id
    video = input_ids == hf_config.video_token_id
    per_token = hf_config.vision_config.spatial_merge_size ** 2
    images = None if image_grid_thw is None or image_grid_thw.shape[0] == 0 else image_grid_thw
    videos = None if video_grid_thw is None or video_grid_thw.shape[0] == 0 else video_grid_thw
    _check_image_runs(image, images, per_token)
    # Each frame of a video is its own run of placeholders (between timestamps).
    frames = None
    if videos is not None:
        frames = torch.repeat_interleave(videos, videos[:, 0], dim=0)
        frames[:, 0] = 1
    _check_image_runs(video, frames, per_token, what="video frame")
    types = image.int() + 2 * video.int()
    positions, _ = Qwen3VLMoeModel.get_rope_index(
        model, input_ids.cpu(), types.cpu(), image_grid_thw=None if images is None else images.cpu(),
        video_grid_thw=None if videos is None else videos.cpu())
    return positions.to(input_ids.device)


def _check_image_runs(image: torch.Tensor, grids, per_token: int, what: str = "image") -> None:
    """Each run of image placeholders (``image`` [B, S], row after row) is one image of
    ``grids`` (or one video frame) with one placeholder per merged patch; else
    ``ImageTokenMismatch`` (one line), on every pipeline stage (later stages never see the
    embeddings)."""
    runs = []
    for row in image.cpu().tolist():
        length = 0
        for is_image in row + [False]:
            if is_image:
                length += 1
            elif length:
                runs.append(length)
                length = 0
    wanted = [] if grids is None else [int(g) // per_token for g in grids.prod(-1).tolist()]
    if runs and not wanted:
        medium = what.split()[0]
        raise ImageTokenMismatch(f"the batch has {sum(runs)} {medium} placeholders and no "
                                 f"{medium}s: text data must not contain the model's {medium} "
                                 f"placeholder (remove it from the text, or give the sample its "
                                 f"{medium})")
    if runs != wanted:
        raise ImageTokenMismatch(f"the batch's {what} placeholders come in runs of {runs}, its "
                                 f"{what}s take {wanted} (one placeholder per merged patch)")
