"""Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``): a Qwen3-MoE language model with
interleaved multimodal rotary positions (``model.mrope``) and DeepStack, behind transformers'
Qwen3-VL tower and mergers (``families.qwen3_vl_moe.vision``).

The language model is Qwen3-MoE's table under ``model.language_model.``; its router always
renormalises the chosen experts' weights (there is no ``norm_topk_prob``). Whether the output
layer is the embedding is the top-level ``tie_word_embeddings`` (default false), not the text
config's. The experts are read in transformers 5's fused layout or the published checkpoints'
transposed one; merged checkpoints are written fused, which transformers reads for this family
(it reads no per-expert keys).
"""

from __future__ import annotations

import os
from functools import partial

import torch

from megatron_slmoe.data.native_resolution import check_fits_tower
from megatron_slmoe.families.base import ConfigReader, MultimodalFamily
from megatron_slmoe.families.kinds import Direct, MappingTable, Rule
from megatron_slmoe.families.qwen3_vl_moe.processor import Qwen2VLPatches, Qwen3VLVideoPatches
from megatron_slmoe.families.qwen3_vl_moe.vision import Qwen3VLMoeVision, rope_positions
from megatron_slmoe.families.layouts import FusedExperts, Layouts
from megatron_slmoe.families.qwen3_moe.family import GATED_EXPERTS, Qwen3MoeFamily

LANGUAGE_MODEL, HEAD = "model.language_model", "lm_head"
VISION_LINEARS = ("visual.blocks.{layer}.attn.qkv", "visual.blocks.{layer}.attn.proj",
                  "visual.blocks.{layer}.mlp.linear_fc1", "visual.blocks.{layer}.mlp.linear_fc2",
                  "visual.merger.linear_fc1", "visual.merger.linear_fc2",
                  "visual.deepstack_merger_list.{layer}.linear_fc1",
                  "visual.deepstack_merger_list.{layer}.linear_fc2")
"""transformers' names of the linears of Qwen3-VL's tower and mergers (under ``model.``)."""


# transformers 5 holds (and writes) the experts as Qwen3-MoE's fused tensors; the published
# checkpoints store each expert's tensors transposed: gate_up_proj [E, H, 2I], down_proj [E, I, H].
PUBLISHED_EXPERTS = (
    FusedExperts("{p}.experts.gate_up_proj",
                 ("{p}.experts.{e}.gate_proj.weight", "{p}.experts.{e}.up_proj.weight"),
                 transposed=True),
    FusedExperts("{p}.experts.down_proj", ("{p}.experts.{e}.down_proj.weight",),
                 transposed=True),
)


class Qwen3VLMoeFamily(MultimodalFamily, Qwen3MoeFamily):
    name = "qwen3_vl_moe"
    architectures = ("Qwen3VLMoeForConditionalGeneration",)
    layouts = Layouts(fused=GATED_EXPERTS.fused + PUBLISHED_EXPERTS)
    merged_experts_fused = True  # transformers reads no per-expert keys for this family
    image_token = "<|image_pad|>"
    image_text = "<|vision_start|><|image_pad|><|vision_end|>"
    video_token = Qwen3VLVideoPatches.video_token

    def transformer_fields(self, c: ConfigReader):
        rope = c.rope()
        c.require(rope.get("mrope_interleaved", True) is True,
                  "mrope_interleaved false is not supported (Qwen3-VL interleaves)")
        transformer, gpt = super().transformer_fields(c)
        transformer["moe_router_pre_softmax"] = False  # softmax over the chosen experts
        return transformer, gpt

    def table(self, model_config, model: str = LANGUAGE_MODEL, head: str = HEAD):
        """Qwen3-MoE's table for the language model, which the image-text model
        (``TowerLanguageModel``) holds as ``language_model``."""
        language = super().table(model_config, model=model, head=head)
        return MappingTable(language.under("language_model.").rules + [
            Rule(f"vision.{name}.weight", Direct(f"model.{name}.weight"))
            for name in VISION_LINEARS])

    def vision_module(self, hf_config, device: str = "cpu"):
        with torch.device(device):
            return Qwen3VLMoeVision(hf_config)

    def image_patches(self, processor_path: str):
        return self._fitting_tower(Qwen2VLPatches.from_preprocessor_config(processor_path),
                                   processor_path)

    def video_patches(self, processor_path: str):
        return self._fitting_tower(Qwen3VLVideoPatches.from_preprocessor_config(processor_path),
                                   processor_path)

    def _fitting_tower(self, patches, processor_path: str):
        """``patches`` once its processor's patch, merge and temporal sizes are the tower's."""
        tower = self.hf_config(os.path.join(os.path.dirname(processor_path), "config.json"))
        settings = ("patch_size", "merge_size", "temporal_patch_size")
        check_fits_tower(processor_path, **{name: (getattr(patches.processor, name), getattr(
            tower.vision_config, "spatial_merge_size" if name == "merge_size" else name))
            for name in settings})
        return patches

    def deepstack_layers(self, hf_config) -> int:
        return len(hf_config.vision_config.deepstack_visual_indexes)

    def rope_positions(self, hf_config):
        """[3, B, S] positions (temporal, height, width) by transformers' get_rope_index."""
        return partial(rope_positions, hf_config)

    def mrope_section(self, hf_config) -> list:
        return list(hf_config.text_config.rope_parameters["mrope_section"])

    def config_class(self):
        from transformers import Qwen3VLMoeConfig

        return Qwen3VLMoeConfig

    def hf_model_class(self):
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
