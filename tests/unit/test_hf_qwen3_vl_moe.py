"""Qwen3-VL-MoE (work in progress): a tiny random Qwen3VLMoeForConditionalGeneration saved by
transformers imports as its Qwen3-MoE language model, whose logits on text equal transformers'
(fp32, 1e-5): with text only, the interleaved M-RoPE is 1D RoPE and DeepStack adds nothing."""

import math

import pytest
import torch

from tests.helpers import hf_models

pytestmark = pytest.mark.usefixtures("megatron_single_rank")


def build_qwen3_vl_moe(seed: int = 0, **text):
    import transformers

    text_config = dict(
        vocab_size=hf_models.VOCAB, hidden_size=hf_models.HIDDEN, intermediate_size=48,
        moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=hf_models.HEADS,
        num_key_value_heads=hf_models.KV_HEADS, head_dim=16, num_experts=hf_models.EXPERTS,
        num_experts_per_tok=hf_models.TOPK, mlp_only_layers=[0], max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": [2, 3, 3], "mrope_interleaved": True}, **text)
    vision_config = dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2,
                         out_hidden_size=hf_models.HIDDEN, patch_size=16, spatial_merge_size=2,
                         temporal_patch_size=2, deepstack_visual_indexes=[0])
    config = transformers.Qwen3VLMoeConfig(text_config=text_config, vision_config=vision_config,
                                           image_token_id=60, video_token_id=61,
                                           vision_start_token_id=62, vision_end_token_id=63,
                                           tie_word_embeddings=False)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Qwen3VLMoeForConditionalGeneration(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            noise = torch.randn(tensor.shape, generator=gen)
            if "norm" in name:
                tensor.copy_(1.0 + 0.2 * noise)
            elif tensor.dim() == 1:
                tensor.copy_(0.2 * noise)
            else:
                tensor.copy_(noise / math.sqrt(tensor.shape[-1]))
    return model


def test_text_logits_match_transformers(tmp_path):
    model = build_qwen3_vl_moe()
    hf_models.save(model, str(tmp_path / "qwen3vl"), layout="fused")
    input_ids = hf_models.tokens()
    ours = hf_models.megatron_logits(hf_models.load_kimi(str(tmp_path / "qwen3vl"))[0],
                                     input_ids)
    with torch.no_grad():
        theirs = model(input_ids=input_ids).logits.float()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


IMAGE_TOKEN = 60


def qwen_inputs(seed: int = 7) -> dict:
    """Two rows, each text, one image's placeholders (one per merged 2x2 patch), text; pixels
    as Qwen's processor flattens them [patches, 3 * 2 * 16 * 16]."""
    gen = torch.Generator().manual_seed(seed)
    grids = [(1, 4, 6), (1, 6, 4)]
    patches = sum(t * h * w for t, h, w in grids)
    rows = []
    for _, h, w in grids:
        text = torch.randint(0, IMAGE_TOKEN, (6,), generator=gen)
        rows.append(torch.cat([text[:2], torch.full((h * w // 4,), IMAGE_TOKEN), text[2:]]))
    return dict(input_ids=torch.stack(rows), image_grid_thw=torch.tensor(grids),
                pixel_values=torch.randn(patches, 3 * 2 * 16 * 16, generator=gen))


def test_image_text_logits_match_transformers(tmp_path):
    model = build_qwen3_vl_moe()
    hf_models.save(model, str(tmp_path / "qwen3vl"), layout="fused")
    inputs = qwen_inputs()
    ours, _ = hf_models.kimi_import_and_run(str(tmp_path / "qwen3vl"), inputs)
    mm_types = (inputs["input_ids"] == IMAGE_TOKEN).int()
    with torch.no_grad():
        theirs = model(**inputs, mm_token_type_ids=mm_types).logits.float()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # DeepStack matters: without its features the logits differ.
    with torch.no_grad():
        for merger in model.model.visual.deepstack_merger_list:
            merger.linear_fc2.weight.zero_()
            merger.linear_fc2.bias.zero_()
        assert not torch.allclose(model(**inputs, mm_token_type_ids=mm_types).logits, theirs,
                                  atol=1e-3)
