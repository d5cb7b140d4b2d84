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
from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType, ModelType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_slmoe.moe.model_config import ModelConfig

VISION_MODEL_TYPES = ("clip", "siglip")
PROJECTOR_TYPES = ("mlp", "affine")
ACTIVATIONS = ("quick_gelu", "gelu", "gelu_tanh")

DEFAULT_IMAGE_TOKEN_INDEX = -200
"""Megatron's placeholder id for ``<image>`` in token ids (outside every vocabulary)."""


class _LlavaWipFilter(logging.Filter):
    """LLaVAModel warns "LLaVA is work in progress" on every build: not actionable, drop it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "LLaVA is work in progress" not in str(record.msg)


logging.getLogger("megatron.core.models.multimodal.llava_model").addFilter(_LlavaWipFilter())


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower and projector of a multimodal model (the defaults: the CPU demo's)."""

    model_type: str = "clip"
    """Vision tower flavour: 'clip' (class token, ln_pre) or 'siglip' (no class token, ln_post)."""
    img_h: int = 32
    """Input image (tile) height in pixels; a multiple of patch_dim."""
    img_w: int = 32
    """Input image (tile) width in pixels; a multiple of patch_dim."""
    patch_dim: int = 16
    """Side of the square patches the tower embeds (the demo's 32 x 32 images: one patch per
    quadrant)."""
    num_layers: int = 2
    """ViT transformer layers."""
    hidden_size: int = 64
    """ViT width."""
    num_attention_heads: int = 4
    """ViT attention heads (divisible by the tensor-parallel size)."""
    ffn_hidden_size: int = 128
    """ViT MLP width (divisible by the tensor-parallel size)."""
    activation: str = "quick_gelu"
    """ViT MLP activation: 'quick_gelu' (OpenAI CLIP), 'gelu', 'gelu_tanh' (SigLIP)."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of the ViT LayerNorms."""
    drop_class_token: bool = True
    """Drop the class token before the projector (LLaVA's choice; clip only)."""
    projector_type: str = "mlp"
    """'mlp' (fc1 -> GELU -> fc2) or 'affine' (one linear)."""
    projector_ffn_hidden_size: int = 128
    """Inner width of the mlp projector (divisible by the tensor-parallel size)."""
    image_token_index: int = DEFAULT_IMAGE_TOKEN_INDEX
    """Token id that marks where an image goes in the input ids."""

    _FLAGS = {
        "model_type": "--vision-model-type", "img_h": "--img-h", "img_w": "--img-w",
        "patch_dim": "--patch-dim", "num_layers": "--vision-num-layers",
        "hidden_size": "--vision-hidden-size",
        "num_attention_heads": "--vision-num-attention-heads",
        "ffn_hidden_size": "--vision-ffn-hidden-size", "activation": "--vision-activation",
        "layernorm_epsilon": "--vision-layernorm-epsilon",
        "drop_class_token": "--disable-vision-class-token",
        "projector_type": "--vision-projection-type",
        "projector_ffn_hidden_size": "--vision-projection-ffn-hidden-size",
        "image_token_index": "--image-token-index",
    }

    def __post_init__(self) -> None:
        self.validate()

    def _bad(self, name: str, why: str) -> ValueError:
        return ValueError(f"vision.{name} ({self._FLAGS[name]}) {why}, got {getattr(self, name)!r}")

    def validate(self, tensor_parallel: int = 1) -> None:
        """One ValueError line naming the first bad field (and its flag)."""
        if self.model_type not in VISION_MODEL_TYPES:
            raise self._bad("model_type", f"must be one of {', '.join(VISION_MODEL_TYPES)}")
        for name in ("img_h", "img_w", "patch_dim", "num_layers", "hidden_size",
                     "num_attention_heads", "ffn_hidden_size", "projector_ffn_hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise self._bad(name, "must be a positive integer")
        for name in ("img_h", "img_w"):
            if getattr(self, name) % self.patch_dim:
                raise self._bad(name, f"must be a multiple of the patch size {self.patch_dim}")
        if self.hidden_size % self.num_attention_heads:
            raise self._bad("num_attention_heads", f"must divide the vision width "
                                                   f"{self.hidden_size}")
        if self.activation not in ACTIVATIONS:
            raise self._bad("activation", f"must be one of {', '.join(ACTIVATIONS)}")
        if not self.layernorm_epsilon > 0:
            raise self._bad("layernorm_epsilon", "must be positive")
        if self.projector_type not in PROJECTOR_TYPES:
            raise self._bad("projector_type", f"must be one of {', '.join(PROJECTOR_TYPES)}")
        if self.model_type == "siglip" and self.drop_class_token:
            raise self._bad("drop_class_token", "must be false for siglip (it has no class token)")
        if not isinstance(self.image_token_index, int) or self.image_token_index >= 0:
            raise self._bad("image_token_index", "must be a negative integer (outside every "
                                                 "vocabulary)")
        for name in ("num_attention_heads", "ffn_hidden_size", "projector_ffn_hidden_size"):
            if getattr(self, name) % tensor_parallel:
                raise self._bad(name, f"must be divisible by the tensor-parallel size "
                                      f"{tensor_parallel}")

    @classmethod
    def from_dict(cls, values: dict) -> "VisionConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown vision setting {unknown[0]!r} (known: "
                             f"{', '.join(sorted(known))})")
        return cls(**values)

    @property
    def class_token_len(self) -> int:
        return 1 if self.model_type == "clip" else 0

    @property
    def num_image_embeddings(self) -> int:
        """Language-model positions one image tile occupies."""
        patches = (self.img_h // self.patch_dim) * (self.img_w // self.patch_dim)
        return patches + (0 if self.drop_class_token else self.class_token_len)


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

    from megatron_slmoe.moe.specs import get_slmoe_decoder_block_spec

    vision.validate(tensor_parallel=language_config.tensor_model_parallel_size)
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
