"""The model of a multimodal Hugging Face checkpoint: Megatron-Core's GPTModel for its language
model, with the family's vision module (``Family.vision_module``) in front on the first pipeline
stage (``model.tower_language.TowerLanguageModel``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

from megatron_slmoe.lora.targets import kind_of, regions
from megatron_slmoe.model.build import build_gpt_model
from megatron_slmoe.model.mrope import InterleavedMRoPE
from megatron_slmoe.model.tower_language import TowerLanguageModel


def build_tower_language_model(model_config, transformer_config, pre_process: bool = True,
                               post_process: bool = True, *, family,
                               hf_config) -> TowerLanguageModel:
    """This rank's pipeline stage: the language model from ``model_config`` (the family's reading
    of the text config) under the run's ``transformer_config``, the vision module from
    ``hf_config`` (the checkpoint's transformers config) on the first stage. The image
    embeddings are written over the placeholder tokens before the sequence-parallel scatter, so
    the embedding is built without it."""
    language = build_gpt_model(model_config, transformer_config, pre_process=pre_process,
                               post_process=post_process,
                               scatter_embedding_sequence_parallel=False)
    mrope_section = family.mrope_section(hf_config)
    if mrope_section is not None:  # interleaved M-RoPE in place of the 1D RoPE
        language.rotary_pos_emb = InterleavedMRoPE(transformer_config.kv_channels,
                                                   rotary_base=model_config.rotary_base)
        language.position_embedding_type = "mrope"
        language.mrope_section = mrope_section
    vision = family.vision_module(hf_config) if pre_process else None
    if vision is not None:
        vision.to(transformer_config.params_dtype)
    return TowerLanguageModel(language, vision, image_token_id=hf_config.image_token_id,
                              positions=family.rope_positions(hf_config),
                              deepstack_layers=vision.deepstack_layers if vision else 0,
                              video_token_id=(hf_config.video_token_id if family.video_token
                                              else None))


def hf_model_builder(hf) -> Optional[Callable]:
    """How a run builds the model of an opened checkpoint (``hf.HFModel``): the image-text
    model's builder for a family that has a vision side (a text task then trains its language
    model with the tower present and unused, so adapters keep the checkpoint's names), None for
    a language model (the task builds it)."""
    if hf is None or not hf.multimodal:
        return None
    return partial(build_tower_language_model, family=hf.family,
                   hf_config=hf.family.hf_config(hf.checkpoint.config_path))


@dataclass(frozen=True)
class VisionCensus:
    """What the memory check needs of a checkpoint's vision module (``plan.vision.
    ReplicatedTower``)."""

    parameters: int
    lora_parameters: int
    """Of ``lora_targets`` at ``lora_rank``: A [r, in] and B [out, r] per adapted linear."""
    layers: int
    hidden: int
    heads: int
    ffn_hidden: int
    patches_per_position: int


def vision_census(hf, lora_targets, lora_rank: int) -> Optional[VisionCensus]:
    """The counts of an opened checkpoint's vision module, built on the meta device (no memory,
    no weights read); None for a language model."""
    if hf is None or not hf.multimodal:
        return None
    vision = hf.family.vision_module(hf.family.hf_config(hf.checkpoint.config_path),
                                     device="meta")
    wanted, adapted = set(lora_targets), 0
    where = regions(vision)
    for parent in vision.modules():
        for attr, child in parent.named_children():
            kind = kind_of(parent, attr, child, where)
            if kind is not None and wanted & set(kind.targets):
                adapted += lora_rank * (child.in_features + child.out_features)
    return VisionCensus(parameters=sum(p.numel() for p in vision.parameters()),
                        lora_parameters=adapted, **vision.layer_shape())
