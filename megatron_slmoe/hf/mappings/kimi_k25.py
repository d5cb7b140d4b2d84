"""Kimi-K2.5 (``Kimi_K25ForConditionalGeneration``): a MoonViT vision tower and projector in front
of a DeepSeek-V3 language model.

The language model is the DeepSeek-V3 family's (``text_config``; its table under the multimodal
checkpoint's prefixes), built and sharded by Megatron-Core like any of our language models. The
published checkpoints hold it as ``language_model.model.*`` / ``language_model.lm_head``;
transformers 5 holds and, with ``save_pretrained(save_original_format=False)``, writes it as
``model.language_model.*`` / ``lm_head``: both are read. Whether the output layer is the
embedding is the top-level ``tie_word_embeddings`` (transformers ties by the top-level config; a
Kimi-K2.5 config without the key ties).

The vision tower and projector are transformers' own modules (``hf.kimi_k25`` builds and loads
them): see there for why.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_slmoe.hf.kimi_k25 import KimiK25Vision
from megatron_slmoe.hf.mappings.deepseek_v3 import DeepseekV3Family
from megatron_slmoe.hf.mappings.family import ConfigReader
from megatron_slmoe.hf.mappings.kinds import Direct, MappingTable, Rule
from megatron_slmoe.hf.mappings.layouts import Layouts, Renamed
from megatron_slmoe.hf.mappings.qwen3_moe import GATED_EXPERTS
from megatron_slmoe.model.model_file import ModelConfig

LANGUAGE_MODEL, HEAD = "language_model.model", "language_model.lm_head"
MEGATRON_LANGUAGE_MODEL = "language_model."
VISION_LINEARS = (*(f"vision_tower.layers.{{layer}}.{m}" for m in (
    "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.proj", "mlp.fc1", "mlp.fc2")),
                  "mm_projector.in_proj", "mm_projector.out_proj")
"""transformers' names of the linears of Kimi-K2.5's tower and projector (under ``model.``)."""


class KimiK25Family(DeepseekV3Family):
    name = "kimi_k25"
    architectures = ("Kimi_K25ForConditionalGeneration",)
    # transformers 5's in-memory names; and its original-format writer's ``blocks`` for the
    # decoder layers (it reverses a rename meant for the tower; it reads them back).
    layouts = Layouts(renames=(Renamed(LANGUAGE_MODEL + ".", "model.language_model."),
                               Renamed(HEAD + ".", "lm_head."),
                               Renamed(LANGUAGE_MODEL + ".layers.", LANGUAGE_MODEL + ".blocks.")),
                      fused=GATED_EXPERTS.fused)
    multimodal = True
    image_token = "<|media_pad|>"
    # transformers' processor writes a video chunk as <|media_begin|>video<|media_content|>
    # ...<|media_end|>; an image the same way.
    image_text = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"

    def model_config(self, config: dict, path: str) -> ModelConfig:
        top = ConfigReader(config, path)
        text = top.get("text_config")
        top.require(isinstance(text, dict), "text_config is missing (a Kimi-K2.5 config holds "
                                            "its language model's settings there)")
        top.require(isinstance(top.get("vision_config"), dict), "vision_config is missing")
        language = super().model_config(text, f"{path} text_config")
        tied = top.bool("tie_word_embeddings", True)
        return dataclasses.replace(language, source=path,
                                   share_embeddings_and_output_weights=tied)

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

    def config_class(self):
        from transformers import Kimi_K25Config

        return Kimi_K25Config

    def hf_model_class(self):
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
