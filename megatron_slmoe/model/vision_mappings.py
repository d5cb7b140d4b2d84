"""Hugging Face CLIP and SigLIP vision towers <-> Megatron-Core's ``CLIPViTModel``.

Rows are (Hugging Face name, Megatron name under ``vision_model.``, kind); ``*`` is the layer
index, ``{q,k,v}`` names the three tensors fused into one. Kinds: ``copy`` (as is), ``qkv`` (q, k, v
fused in Megatron's per-head layout: for each head its q, k and v rows), ``class_token`` (the class
embedding [h] as [1, 1, h]). ``hf_vision`` applies them.
"""

from __future__ import annotations

# The rows every transformer layer has.
_LAYER = [
    ("encoder.layers.*.layer_norm1.weight", "decoder.layers.*.input_layernorm.weight", "copy"),
    ("encoder.layers.*.layer_norm1.bias", "decoder.layers.*.input_layernorm.bias", "copy"),
    ("encoder.layers.*.self_attn.{q,k,v}_proj.weight",
     "decoder.layers.*.self_attention.linear_qkv.weight", "qkv"),
    ("encoder.layers.*.self_attn.{q,k,v}_proj.bias",
     "decoder.layers.*.self_attention.linear_qkv.bias", "qkv"),
    ("encoder.layers.*.self_attn.out_proj.weight",
     "decoder.layers.*.self_attention.linear_proj.weight", "copy"),
    ("encoder.layers.*.self_attn.out_proj.bias",
     "decoder.layers.*.self_attention.linear_proj.bias", "copy"),
    ("encoder.layers.*.layer_norm2.weight", "decoder.layers.*.pre_mlp_layernorm.weight", "copy"),
    ("encoder.layers.*.layer_norm2.bias", "decoder.layers.*.pre_mlp_layernorm.bias", "copy"),
    ("encoder.layers.*.mlp.fc1.weight", "decoder.layers.*.mlp.linear_fc1.weight", "copy"),
    ("encoder.layers.*.mlp.fc1.bias", "decoder.layers.*.mlp.linear_fc1.bias", "copy"),
    ("encoder.layers.*.mlp.fc2.weight", "decoder.layers.*.mlp.linear_fc2.weight", "copy"),
    ("encoder.layers.*.mlp.fc2.bias", "decoder.layers.*.mlp.linear_fc2.bias", "copy"),
]
CLIP_MAPPINGS = [
    ("embeddings.class_embedding", "class_token", "class_token"),
    ("embeddings.patch_embedding.weight", "conv1.weight", "copy"),
    ("embeddings.position_embedding.weight", "position_embeddings.weight", "copy"),
    ("pre_layrnorm.weight", "ln_pre.weight", "copy"),  # sic: transformers' spelling
    ("pre_layrnorm.bias", "ln_pre.bias", "copy"),
    *_LAYER,
]
SIGLIP_MAPPINGS = [
    ("embeddings.patch_embedding.weight", "conv1.weight", "copy"),
    ("embeddings.patch_embedding.bias", "conv1.bias", "copy"),
    ("embeddings.position_embedding.weight", "position_embeddings.weight", "copy"),
    *_LAYER,
    ("post_layernorm.weight", "ln_post.weight", "copy"),
    ("post_layernorm.bias", "ln_post.bias", "copy"),
]
VISION_MAPPINGS = {"clip": CLIP_MAPPINGS, "siglip": SIGLIP_MAPPINGS}
HF_ACTIVATIONS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_new": "gelu_tanh"}
"""Hugging Face ``hidden_act`` -> our ``--vision-activation``."""
HF_PREFIXES = ("vision_model.", "model.vision_model.", "")
"""Where a checkpoint keeps its tower: a CLIP/SigLIP model, a LLaVA-style model, the tower alone."""
