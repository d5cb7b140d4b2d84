"""The model section (which model, its starting weights, what is trained, the precision) and the
vision tower's section. Torch-free: the model files themselves are read by
``megatron_slmoe.model.model_file``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.config.schema import Section, setting
from megatron_slmoe.storage.config import check_locations


@dataclass(frozen=True)
class ModelSection(Section):
    """The model, its starting weights, what is trained, and the precision."""

    section_name = "model"

    config: str = setting("tiny", flag="--model-config",
                          help="packaged model config name (tiny, small, flagship_2p8t) or a YAML "
                               "file of TransformerConfig fields")
    base_checkpoint: Optional[str] = setting(
        None, flag="--base-checkpoint",
        help="Megatron dist checkpoint with the base weights, a directory or an s3:// / msc:// "
             "prefix (default: random initialisation)")
    hf_checkpoint: Optional[str] = setting(
        None, flag="--hf-checkpoint",
        help="Hugging Face checkpoint directory (config.json, safetensors shards): the model is "
             "built from its config.json and each rank reads only its own slices of the weights; "
             "also the default --tokenizer (instead of --model-config and --base-checkpoint)")
    hf_shape_check: bool = setting(
        True, flag="--hf-shape-check",
        help="with --hf-checkpoint: check every tensor's presence and shape against config.json "
             "before starting (--no-hf-shape-check: only when a rank reads it)")
    hf_unmap_mib: int = setting(
        64, flag="--hf-unmap-mib",
        help="with --hf-checkpoint: MiB of shard file pages a rank keeps mapped while loading (its "
             "peak host memory is its shard, one source tensor and this window)")
    expert_weights: Literal["auto", "packed", "dequantize"] = setting(
        "auto", flag="--expert-weights",
        help="with --hf-checkpoint: 'packed' holds the routed experts as the checkpoint stores "
             "them (MXFP4, INT4 pack-quantized: about 1/4 of their bf16 bytes; block FP8: about "
             "1/2), decoded one "
             "expert tile at a time; 'dequantize' holds them in the run's dtype; auto: packed "
             "where the checkpoint's experts are packed and frozen")
    adapter_init: Optional[str] = setting(
        None, flag="--adapter-init",
        help="start from this adapter (a directory or an s3:// / msc:// prefix) instead of fresh "
             "LoRA weights: one a run saved, "
             "or a PEFT adapter of the --hf-checkpoint base (its rank, alpha and targets are taken)")
    finetune_mode: Literal["lora", "full"] = setting(
        "lora", flag="--finetune-mode",
        help="'lora' trains adapters on a frozen base; 'full' trains every weight (how the "
             "demo's tiny base is made)")
    precision: Literal["auto", "bf16", "fp32"] = setting(
        "auto", flag="--precision", switches={"--bf16": "bf16", "--fp32": "fp32"},
        help="parameter and compute dtype; auto: bf16 on GPUs/NPUs, fp32 on CPU "
             "(--bf16 / --fp32 are shorthands)")

    def validate(self) -> None:
        self.check(bool(self.config), "config", "must name a model config")
        check_locations(self, "base_checkpoint", "adapter_init")
        if self.finetune_mode == "full" and self.adapter_init:
            raise ConfigError("--adapter-init needs --finetune-mode lora")
        self.check_positive("hf_unmap_mib")
        if self.expert_weights == "packed":
            self.check(bool(self.hf_checkpoint), "expert_weights",
                       "packed needs --hf-checkpoint (packed experts are read from its shards)")
            self.check(self.finetune_mode == "lora", "expert_weights",
                       "packed holds the experts frozen: --finetune-mode full trains them (use "
                       "--expert-weights dequantize)")
        if self.hf_checkpoint is not None:
            self.check(bool(self.hf_checkpoint), "hf_checkpoint", "must be a directory")
            self.check(not self.base_checkpoint, "hf_checkpoint",
                       "and --base-checkpoint are exclusive: the base weights come from one of them")
            self.check(self.config == type(self).config, "hf_checkpoint",
                       "and --model-config are exclusive: the model is the checkpoint's config.json")


@dataclass(frozen=True)
class VisionConfig(Section):
    """The vision tower and projector of --task image-text (the defaults: the CPU demo's)."""

    section_name = "vision"

    model_type: Literal["clip", "siglip"] = setting(
        "clip", flag="--vision-model-type",
        help="clip (class token, ln_pre) or siglip (no class token, ln_post)")
    img_h: int = setting(32, flag="--img-h",
                         help="image (tile) height in pixels; a multiple of --patch-dim")
    img_w: int = setting(32, flag="--img-w",
                         help="image (tile) width in pixels; a multiple of --patch-dim")
    patch_dim: int = setting(16, flag="--patch-dim",
                             help="side of the square patches the tower embeds")
    num_layers: int = setting(2, flag="--vision-num-layers", help="ViT transformer layers")
    hidden_size: int = setting(64, flag="--vision-hidden-size", help="ViT width")
    num_attention_heads: int = setting(4, flag="--vision-num-attention-heads",
                                       help="ViT attention heads (divisible by TP)")
    ffn_hidden_size: int = setting(128, flag="--vision-ffn-hidden-size",
                                   help="ViT MLP width (divisible by TP)")
    activation: Literal["quick_gelu", "gelu", "gelu_tanh"] = setting(
        "quick_gelu", flag="--vision-activation",
        help="ViT MLP activation: quick_gelu (OpenAI CLIP), gelu, gelu_tanh (SigLIP)")
    layernorm_epsilon: float = setting(1e-5, flag="--vision-layernorm-epsilon",
                                       help="epsilon of the ViT LayerNorms")
    drop_class_token: bool = setting(
        True, flag="--vision-drop-class-token",
        help="drop the class token before the projector (LLaVA's choice; clip only)")
    projector_type: Literal["mlp", "affine"] = setting(
        "mlp", flag="--vision-projection-type",
        help="mlp (fc1 -> GELU -> fc2) or affine (one linear)")
    projector_ffn_hidden_size: int = setting(
        128, flag="--vision-projection-ffn-hidden-size",
        help="inner width of the mlp projector (divisible by TP)")
    image_token_index: int = setting(
        -200, flag="--image-token-index",
        help="token id that marks where an image goes (negative: outside every vocabulary)")
    checkpoint: Optional[str] = setting(
        None, flag="--vision-checkpoint",
        help="Hugging Face CLIP/SigLIP folder (config.json + safetensors) whose vision tower "
             "weights replace the model's (after --base-checkpoint, if any); its architecture "
             "must match this section")

    def validate(self) -> None:
        self.check_positive("img_h", "img_w", "patch_dim", "num_layers", "hidden_size",
                            "num_attention_heads", "ffn_hidden_size",
                            "projector_ffn_hidden_size", "layernorm_epsilon")
        for name in ("img_h", "img_w"):
            self.check(getattr(self, name) % self.patch_dim == 0, name,
                       f"must be a multiple of --patch-dim {self.patch_dim}, got "
                       f"{getattr(self, name)}")
        self.check(self.hidden_size % self.num_attention_heads == 0, "num_attention_heads",
                   f"must divide --vision-hidden-size {self.hidden_size}, got "
                   f"{self.num_attention_heads}")
        self.check(not (self.model_type == "siglip" and self.drop_class_token), "drop_class_token",
                   "must be off for siglip (it has no class token): --no-vision-drop-class-token")
        self.check(self.image_token_index < 0, "image_token_index",
                   f"must be negative (outside every vocabulary), got {self.image_token_index}")
        self.check(self.checkpoint is None or bool(self.checkpoint), "checkpoint",
                   "must be a non-empty path")

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        """The tower and projector split heads and MLP columns over the TP ranks."""
        for name in ("num_attention_heads", "ffn_hidden_size", "projector_ffn_hidden_size"):
            self.check(getattr(self, name) % tensor_parallel == 0, name,
                       f"must be divisible by --tensor-model-parallel-size {tensor_parallel}, "
                       f"got {getattr(self, name)}")

    @property
    def class_token_len(self) -> int:
        return 1 if self.model_type == "clip" else 0

    @property
    def num_image_embeddings(self) -> int:
        """Language-model positions one image tile occupies."""
        patches = (self.img_h // self.patch_dim) * (self.img_w // self.patch_dim)
        return patches + (0 if self.drop_class_token else self.class_token_len)
