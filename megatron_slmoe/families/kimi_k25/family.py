"""Kimi-K2.5 (``Kimi_K25ForConditionalGeneration``): a MoonViT vision tower and projector in front
of a DeepSeek-V3 language model.

The language model is the DeepSeek-V3 family's (``text_config``; its table under the multimodal
checkpoint's prefixes), built and sharded by Megatron-Core like any of our language models. The
published checkpoints hold it as ``language_model.model.*`` / ``language_model.lm_head``;
transformers 5 holds and, with ``save_pretrained(save_original_format=False)``, writes it as
``model.language_model.*`` / ``lm_head``: both are read. Whether the output layer is the
embedding is the top-level ``tie_word_embeddings`` (transformers ties by the top-level config; a
Kimi-K2.5 config without the key ties).

The vision tower and projector are transformers' own modules (``families.kimi_k25.vision``): see there for why.
"""

from __future__ import annotations

import os

import torch

from megatron_slmoe.families.kimi_k25.vision import KimiK25Vision
from megatron_slmoe.families.deepseek_v3.family import DeepseekV3Family
from megatron_slmoe.data.native_resolution import NativeResolutionConfig, check_fits_tower
from megatron_slmoe.families.base import MultimodalFamily
from megatron_slmoe.families.kinds import Direct, MappingTable, Rule
from megatron_slmoe.families.layouts import Layouts, Renamed
from megatron_slmoe.families.qwen3_moe.family import GATED_EXPERTS

LANGUAGE_MODEL, HEAD = "language_model.model", "language_model.lm_head"
MEGATRON_LANGUAGE_MODEL = "language_model."
VISION_LINEARS = (*(f"vision_tower.layers.{{layer}}.{m}" for m in (
    "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.proj", "mlp.fc1", "mlp.fc2")),
                  "mm_projector.in_proj", "mm_projector.out_proj")
"""transformers' names of the linears of Kimi-K2.5's tower and projector (under ``model.``)."""


class KimiK25Family(MultimodalFamily, DeepseekV3Family):
    name = "kimi_k25"
    architectures = ("Kimi_K25ForConditionalGeneration",)
    # transformers 5's in-memory names; and its original-format writer's ``blocks`` for the
    # decoder layers (it reverses a rename meant for the tower; it reads them back).
    layouts = Layouts(renames=(Renamed(LANGUAGE_MODEL + ".", "model.language_model."),
                               Renamed(HEAD + ".", "lm_head."),
                               Renamed(LANGUAGE_MODEL + ".layers.", LANGUAGE_MODEL + ".blocks.")),
                      fused=GATED_EXPERTS.fused)
    image_token = "<|media_pad|>"
    tied_by_default = True  # a Kimi-K2.5 config without the key ties
    # transformers' processor writes a video chunk as <|media_begin|>video<|media_content|>
    # ...<|media_end|>; an image the same way.
    image_text = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"

    def table(self, model_config, model: str = LANGUAGE_MODEL, head: str = HEAD):
        """DeepSeek-V3's table for the language model, which the image-text model
        (``TowerLanguageModel``) holds as ``language_model``; and the tower's and projector's
        linears (their module is transformers' own, ``vision``, read by its own names: these
        rules name the HF weight of a LoRA on them)."""
        language = super().table(model_config, model=model, head=head)
        return MappingTable(language.under(MEGATRON_LANGUAGE_MODEL).rules + [
            Rule(f"vision.{name}.weight", Direct(f"model.{name}.weight"))
            for name in VISION_LINEARS])

    def vision_module(self, hf_config, device: str = "cpu"):
        with torch.device(device):
            return KimiK25Vision(hf_config)

    def image_patches(self, processor_path: str):
        patches = NativeResolutionConfig.from_preprocessor_config(processor_path)
        tower = self.hf_config(os.path.join(os.path.dirname(processor_path), "config.json"))
        check_fits_tower(processor_path, patch_size=(patches.patch_size,
                                                     tower.vision_config.patch_size),
                         merge_size=(patches.merge_size, tower.vision_config.merge_kernel_size[0]))
        return patches

    def config_class(self):
        from transformers import Kimi_K25Config

        return Kimi_K25Config

    def hf_model_class(self):
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
