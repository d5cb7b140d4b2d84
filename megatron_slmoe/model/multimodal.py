"""The multimodal model: Megatron-Core's LLaVAModel with a Stable Latent MoE language model.

Every piece is Megatron-Core's own:

* vision tower: ``CLIPViTModel`` (``clip``: class token and ``ln_pre``; ``siglip``: no class token,
  ``ln_post``) from Megatron's local ViT layer spec, made bidirectional (that spec masks ViT attention
  causally; CLIP and SigLIP attend over all patches);
* projector: ``MultimodalProjector`` (``mlp``: fc1 -> GELU -> fc2, or ``affine``) from the vision
  width to the language width;
* language model: ``GPTModel`` with our decoder block (``get_slmoe_decoder_block_spec``), built by
  ``LLaVAModel`` itself.

``LLaVAModel`` replaces each token id equal to ``VisionConfig.image_token_index`` by the projected
embeddings of one image (``num_image_embeddings`` positions; more for a tiled image), so the text
says where images go.

**Parallel layouts.** The vision tower and projector take the language model's tensor-parallel size
(attention heads and MLP columns split, no sequence parallelism: the image sequence need not divide
by TP) and no pipeline or expert parallelism. With pipeline parallelism they live on the first stage
(``add_encoder``), beside the first language-model layers; LLaVAModel then pads every combined
sequence to ``max_sequence_length`` so the stages exchange fixed shapes. Under sequence parallelism
LLaVAModel scatters the combined sequence over the TP ranks, so it must divide by TP.

**Freezing.** Nothing here freezes anything: ``inject_lora`` freezes every non-LoRA weight, the
vision tower and projector included, unless the ``vision_attention`` / ``projector`` LoRA targets
ask for adapters there; a full fine-tune (how the demo's base is made) trains everything.
"""

from __future__ import annotations

import copy
import logging
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType, ModelType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_slmoe.model.config import VisionConfig
from megatron_slmoe.model.model_file import ModelConfig
from megatron_slmoe.moe.specs import get_slmoe_decoder_block_spec
from megatron_slmoe.platform import apply_adaptor



class _LlavaWipFilter(logging.Filter):
    """LLaVAModel warns "LLaVA is work in progress" on every build: not actionable, drop it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "LLaVA is work in progress" not in str(record.msg)


logging.getLogger("megatron.core.models.multimodal.llava_model").addFilter(_LlavaWipFilter())


def _activation(name: str):
    if name == "quick_gelu":
        # Resolved at call time: on CPU the adaptor replaces Megatron's torch.compile'd original.
        from megatron.core import activations

        return activations.quick_gelu
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    return F.gelu


# Run settings a vision or projector config takes from the language model's.
_SHARED_RUN_SETTINGS = ("tensor_model_parallel_size", "params_dtype", "bf16", "fp16",
                        "use_cpu_initialization", "perform_initialization", "deterministic_mode",
                        "init_method_std")


def _tower_config(language: TransformerConfig, **model_fields) -> TransformerConfig:
    shared = {name: getattr(language, name) for name in _SHARED_RUN_SETTINGS}
    return TransformerConfig(
        **shared, **model_fields, pipeline_model_parallel_size=1, sequence_parallel=False,
        expert_model_parallel_size=1, add_bias_linear=True, add_qkv_bias=True,
        normalization="LayerNorm", gated_linear_unit=False, bias_activation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0)


def vision_transformer_config(vision: VisionConfig, language: TransformerConfig) -> TransformerConfig:
    """The ViT's TransformerConfig: the vision fields, the language model's TP size and dtypes."""
    config = _tower_config(
        language, num_layers=vision.num_layers, hidden_size=vision.hidden_size,
        num_attention_heads=vision.num_attention_heads, ffn_hidden_size=vision.ffn_hidden_size,
        kv_channels=vision.hidden_size // vision.num_attention_heads,
        layernorm_epsilon=vision.layernorm_epsilon, activation_func=_activation(vision.activation))
    config.vision_model_type = vision.model_type  # read by LLaVAModel (not a dataclass field)
    return config


def projector_config(vision: VisionConfig, language: TransformerConfig) -> TransformerConfig:
    """The projector's TransformerConfig: vision width in, language width out."""
    return _tower_config(
        language, num_layers=1, hidden_size=language.hidden_size,
        num_attention_heads=language.num_attention_heads,
        ffn_hidden_size=vision.projector_ffn_hidden_size, activation_func=F.gelu)


def vision_layer_spec():
    """Megatron's local ViT layer spec with bidirectional attention."""
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec

    spec = copy.deepcopy(get_vit_layer_with_local_spec())
    spec.submodules.self_attention.params = {
        **spec.submodules.self_attention.params, "attn_mask_type": AttnMaskType.no_mask}
    return spec


def projector_spec():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


def build_multimodal_model(model_config: ModelConfig, language_config: TransformerConfig,
                           vision: VisionConfig, *, seq_length: Optional[int] = None,
                           pre_process: bool = True, post_process: bool = True,
                           add_encoder: Optional[bool] = None, vp_stage: Optional[int] = None):
    """Megatron's LLaVAModel (this rank's pipeline stage) with our MoE language model.

    ``seq_length``: the combined (text + image) sequence length every sample is cut or padded to
    (default and maximum: the model's ``max_sequence_length``). ``add_encoder`` defaults to
    ``pre_process``: the vision tower lives on the first stage.
    """
    from megatron.core.models.multimodal.llava_model import LLaVAModel

    apply_adaptor()
    vision.check_tensor_parallel(language_config.tensor_model_parallel_size)
    gpt = model_config.gpt_kwargs()
    seq_length = seq_length or gpt["max_sequence_length"]
    if not 0 < seq_length <= gpt["max_sequence_length"]:
        raise ValueError(f"--seq-length {seq_length} must be in [1, the model's "
                         f"max_sequence_length {gpt['max_sequence_length']}]")
    language_spec = get_slmoe_decoder_block_spec(language_config, model_config.slmoe,
                                                 vp_stage=vp_stage)
    model = LLaVAModel(
        language_transformer_config=language_config,
        language_transformer_layer_spec=language_spec,
        language_vocab_size=gpt["vocab_size"],
        language_max_sequence_length=seq_length,
        vision_transformer_config=vision_transformer_config(vision, language_config),
        vision_transformer_layer_spec=vision_layer_spec(),
        drop_vision_class_token=vision.drop_class_token,
        vision_projection_config=projector_config(vision, language_config),
        vision_projection_layer_spec=projector_spec(),
        vision_projection_type=vision.projector_type,
        parallel_output=True,
        share_embeddings_and_output_weights=gpt["share_embeddings_and_output_weights"],
        language_position_embedding_type=gpt["position_embedding_type"],
        language_rotary_percent=gpt["rotary_percent"],
        language_rotary_base=gpt["rotary_base"],
        pre_process=pre_process, post_process=post_process,
        add_encoder=pre_process if add_encoder is None else add_encoder, add_decoder=True,
        img_h=vision.img_h, img_w=vision.img_w, patch_dim=vision.patch_dim,
        image_token_index=vision.image_token_index, vp_stage=vp_stage,
    )
    # Megatron's schedules read it; Megatron-LM's get_model sets it on every chunk it builds.
    model.model_type = ModelType.encoder_or_decoder
    if model.vision_model is not None and language_config.perform_initialization:
        _init_embeddings_like_clip(model.vision_model, language_config.init_method_std)
    return model


def _init_embeddings_like_clip(tower, std: float) -> None:
    """CLIP's initialisation of the tower's position embeddings and class token (N(0, std) and
    N(0, width^-1/2)). Megatron leaves torch's N(0, 1) defaults, which drown the patch content
    when a tower is trained from scratch; a pretrained tower's weights replace these anyway.
    Draws from the default generator, which is in the same state on every rank here."""
    with torch.no_grad():
        tower.position_embeddings.weight.normal_(0.0, std)
        if getattr(tower, "class_token", None) is not None:
            tower.class_token.normal_(0.0, tower.visual_hidden_size ** -0.5)
