"""A Hugging Face CLIP / SigLIP vision tower imported into Megatron's CLIPViTModel computes what
transformers computes.

Tiny random towers are made by transformers itself (``CLIPVisionModel``, ``SiglipVisionModel``) and
saved as safetensors checkpoints, with their ``last_hidden_state`` for fixed pixels, in a separate
Python process (transformers' modeling modules are imported apart from megatron_slmoe, whose CPU
adaptor on this branch still replaces torch.cuda.Stream by a function). The Megatron tower is
built from the checkpoint's config (``vision_config_from_hf``), filled by
``load_hf_vision_tower`` and compared on 1 rank and on 2 ranks with TP=2 (fused QKV split by heads).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.helpers.ranks import run_ranks

TOL = 1e-5

MAKE_TOWERS = textwrap.dedent("""
    import sys, torch
    from transformers import (CLIPVisionConfig, CLIPVisionModel, SiglipVisionConfig,
                              SiglipVisionModel)
    out = sys.argv[1]
    torch.manual_seed(0)
    pixels = torch.randn(3, 3, 32, 32)
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=32, patch_size=8)
    for name, config, model in [("clip", CLIPVisionConfig, CLIPVisionModel),
                                ("siglip", SiglipVisionConfig, SiglipVisionModel)]:
        tower = model(config(**common)).eval()
        with torch.no_grad():  # random norms and biases too, not their trivial initial values
            for p in tower.parameters():
                p.add_(torch.randn_like(p) * 0.1)
            hidden = tower(pixel_values=pixels).last_hidden_state
        tower.save_pretrained(f"{out}/{name}")
        torch.save({"pixels": pixels, "hidden": hidden}, f"{out}/{name}.pt")
""")


@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-vision")
    subprocess.run([sys.executable, "-c", MAKE_TOWERS, str(root)], check=True, timeout=300)
    return root


def compare_rank(root: str, name: str) -> float:
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from megatron_slmoe.model.hf_vision import load_hf_vision_tower, vision_config_from_hf
    from megatron_slmoe.model.multimodal import vision_layer_spec, vision_transformer_config

    vision = vision_config_from_hf(AutoConfig.from_pretrained(f"{root}/{name}"))
    run = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                            use_cpu_initialization=True, params_dtype=torch.float32)
    tower = CLIPViTModel(vision_transformer_config(vision, run), vision_layer_spec(),
                         add_class_token=vision.class_token_len > 0,
                         class_token_len=vision.class_token_len, patch_dim=vision.patch_dim,
                         img_h=vision.img_h, img_w=vision.img_w, model_subtype=vision.model_type)
    filled = load_hf_vision_tower(tower, f"{root}/{name}", vision)
    assert filled == sorted(n for n, _ in tower.named_parameters())
    reference = torch.load(f"{root}/{name}.pt")
    with torch.no_grad():
        hidden = tower.eval()(reference["pixels"])
    assert hidden.shape == reference["hidden"].shape
    return ((hidden - reference["hidden"]).norm() / reference["hidden"].norm()).item()


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_imported_tower_matches_transformers(towers, name):
    (error,) = run_ranks(compare_rank, 1, root=str(towers), name=name)
    assert error < TOL


def test_imported_tower_matches_transformers_with_tp2(towers):
    errors = run_ranks(compare_rank, 2, tp=2, root=str(towers), name="clip")
    assert max(errors) < TOL


def test_config_mapping_and_refusals(towers):
    from transformers import AutoConfig

    from megatron_slmoe.model.hf_vision import (HFImportError, check_hf_vision_checkpoint,
                                                megatron_vision_tensors, vision_config_from_hf)

    clip = vision_config_from_hf(AutoConfig.from_pretrained(towers / "clip"))
    assert (clip.model_type, clip.activation, clip.patch_dim, clip.num_image_embeddings) == (
        "clip", "quick_gelu", 8, 16)
    siglip = vision_config_from_hf(AutoConfig.from_pretrained(towers / "siglip"))
    assert (siglip.model_type, siglip.activation, siglip.drop_class_token) == (
        "siglip", "gelu_tanh", False)
    with pytest.raises(HFImportError, match="lacks"):
        megatron_vision_tensors({"vision_model.post_layernorm.bias": torch.zeros(32)}, siglip)
    with pytest.raises(HFImportError, match="no vision tower tensors"):
        megatron_vision_tensors({"text_model.x": torch.zeros(1)}, clip)
    # What a run checks before torchrun (--vision-checkpoint against the vision section).
    check_hf_vision_checkpoint(str(towers / "clip"), clip)
    with pytest.raises(HFImportError, match="num_layers 2, the run --vision-num-layers 3"):
        check_hf_vision_checkpoint(str(towers / "clip"), dataclasses.replace(clip, num_layers=3))
