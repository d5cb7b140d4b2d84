"""Kimi K3's vision side (families/kimi_k3/vision.py): MoonViT3D and its projector equal a plain
reference of the official code's description (tests/helpers/moonvit3d_reference.py) on images
and a 2-frame video chunk; the same tower in Kimi-K2.5's published form (layer norms, biases,
bicubic grid) equals transformers' Kimi-K2.5 tower on the same weights, so the pieces the two
share (2-D RoPE, the resampled grid, the time embedding, the temporal pooling and 2 x 2 merge)
are held to transformers."""

import pytest
import torch

from megatron_slmoe.families.kimi_k3.vision import KimiK3Vision, MoonViT3D, MoonViT3DConfig
from tests.helpers import hf_models
from tests.helpers import moonvit3d_reference as ref

TINY = MoonViT3DConfig(hidden_size=16, num_layers=2, num_heads=2, qkv_hidden_size=24,
                       intermediate_size=32, pos_grid=8, pos_frames=4, text_hidden_size=40)
GRIDS = torch.tensor([[1, 4, 6], [2, 4, 4], [1, 6, 2]])  # images and a 2-frame chunk


def _pixels(grids, seed=1):
    patches = int(sum(t * h * w for t, h, w in grids.tolist()))
    return torch.randn(patches, 3, 14, 14, generator=torch.Generator().manual_seed(seed))


def test_k3_tower_and_projector_equal_the_plain_reference():
    model = hf_models.randomise_tower(KimiK3Vision(TINY)).double()
    state = model.state_dict()
    assert "vision_tower.encoder.blocks.1.wqkv.weight" in state
    assert state["vision_tower.patch_embed.pos_emb.weight"].shape == (8, 8, 16)
    pixels = _pixels(GRIDS).double()
    with torch.no_grad():
        merged = ref.tower(state, TINY, pixels, GRIDS)
        expected = ref.projector(state, TINY, merged)
        # (The rotary angles are fp32 in the tower, as the release computes them: 1e-7 apart.)
        torch.testing.assert_close(model.vision_tower(pixels, GRIDS).flatten(1), merged,
                                   rtol=1e-5, atol=1e-6)
        out = model(pixels, GRIDS)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert out.shape == (6 + 4 + 3, 40)  # one token per merged 2x2 patch of each item
    # The frames of a chunk matter (pooled after the tower, not before): reordering them does
    # not change it, replacing one does.
    chunk = slice(24, 24 + 32)
    swapped = pixels.clone()
    swapped[chunk] = torch.cat([pixels[24 + 16:24 + 32], pixels[24:24 + 16]])
    with torch.no_grad():
        assert not torch.allclose(model(swapped, GRIDS)[6:10], out[6:10])


def _k25_form(vision_config) -> MoonViT3DConfig:
    return MoonViT3DConfig(
        hidden_size=vision_config.hidden_size, num_layers=vision_config.num_hidden_layers,
        num_heads=vision_config.num_attention_heads, qkv_hidden_size=vision_config.hidden_size,
        intermediate_size=vision_config.intermediate_size, pos_grid=vision_config.pos_emb_height,
        pos_frames=vision_config.pos_emb_time, norm="layernorm", bias=True,
        interpolation="bicubic", rope_theta=vision_config.rope_parameters["rope_theta"])


def _interleaved(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' half-split q/k rows per head -> the published adjacent-pair order."""
    d = rows.shape[0] // heads
    return rows.reshape(heads, 2, d // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def test_k25_form_equals_transformers_kimi_k25_tower():
    hf = hf_models.build_kimi().model.vision_tower
    config = _k25_form(hf.config)
    ours = MoonViT3D(config)
    theirs = hf.state_dict()
    heads = config.num_heads
    mapped = {"patch_embed.proj.weight": theirs["patch_embed.proj.weight"],
              "patch_embed.proj.bias": theirs["patch_embed.proj.bias"],
              "patch_embed.pos_emb.weight": theirs["patch_embed.pos_emb.position_embeddings"],
              "encoder.final_layernorm.weight": theirs["final_layernorm.weight"],
              "encoder.final_layernorm.bias": theirs["final_layernorm.bias"]}
    for i in range(config.num_layers):
        t, o = f"layers.{i}.", f"encoder.blocks.{i}."
        for kind in ("weight", "bias"):
            q, k, v = (theirs[f"{t}attn.{n}_proj.{kind}"] for n in "qkv")
            mapped[f"{o}wqkv.{kind}"] = torch.cat([_interleaved(q, heads),
                                                   _interleaved(k, heads), v])
            for ours_name, their_name in (("wo", "attn.proj"), ("norm0", "norm1"),
                                          ("norm1", "norm2"), ("mlp.fc0", "mlp.fc1"),
                                          ("mlp.fc1", "mlp.fc2")):
                mapped[f"{o}{ours_name}.{kind}"] = theirs[f"{t}{their_name}.{kind}"]
    ours.load_state_dict(mapped)
    grids = torch.tensor([[1, 4, 6], [2, 6, 4]])  # pos_emb_time 2: chunks of 2 frames
    pixels = _pixels(grids)
    with torch.no_grad():
        expected = hf(pixels, grid_thw=grids).pooler_output
        torch.testing.assert_close(ours(pixels, grids), expected, rtol=1e-5, atol=1e-5)


def test_more_frames_than_the_time_embedding_is_refused():
    model = KimiK3Vision(TINY)
    grids = torch.tensor([[5, 2, 2]])
    with pytest.raises(ValueError, match="an item of 5 frames; the tower embeds at most 4"):
        model(_pixels(grids), grids)


# --- the image-text model of a K3 checkpoint with its vision side --------------------------------

IMAGE_TOKEN = 100


def _image_text_batch(grids, vocab, seed=3):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for t, h, w in grids.tolist():
        text = torch.randint(0, IMAGE_TOKEN, (6,), generator=gen)
        rows.append(torch.cat([text[:2], torch.full((h * w // 4,), IMAGE_TOKEN), text[2:]]))
    length = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([r, torch.randint(0, IMAGE_TOKEN, (length - len(r),),
                                                   generator=gen)]) for r in rows])
    return {"input_ids": ids, "pixel_values": _pixels(grids, seed),
            "image_grid_thw": grids}


@pytest.fixture(scope="module")
def k3_vl(tmp_path_factory):
    from tests.helpers import kimi_k3_reference as k3ref

    text = k3ref.round_experts_to_mxfp4_(k3ref.build())
    vision, config = hf_models.k3_tower(text)
    directory = hf_models.save_kimi_k3(text, tmp_path_factory.mktemp("k3vl") / "release",
                                       vision=vision, vision_config=hf_models.K3_VISION_CONFIG,
                                       image_token_id=IMAGE_TOKEN)
    return text, vision, config, directory


def _reference_logits(text, vision, config, inputs, dtype):
    """The plain text reference fed the plain tower's features at the image positions."""
    import copy

    state = {k: v.to(dtype) for k, v in vision.state_dict().items()}
    grids = inputs["image_grid_thw"]
    with torch.no_grad():
        features = ref.projector(state, config, ref.tower(
            state, config, inputs["pixel_values"].to(dtype), grids))
        reference = copy.deepcopy(text).to(dtype)
        image = inputs["input_ids"] == IMAGE_TOKEN
        embeds = reference.language_model.model.embed_tokens(
            inputs["input_ids"].masked_fill(image, 0))
        embeds[image] = features
        return reference(inputs_embeds=embeds).double()


@pytest.mark.usefixtures("megatron_single_rank")
def test_k3_image_text_logits_equal_the_references(k3_vl):
    """Our fp32 logits against the references run in fp64: within 1e-5, or (13 layers after a
    tower) about as close as the references' own fp32 run is to their fp64 one (the two
    differ by the order of fp32 sums, so within a quarter of that distance more)."""
    text, vision, config, directory = k3_vl
    inputs = _image_text_batch(torch.tensor([[1, 4, 6], [1, 6, 4]]), text.config.vocab_size)
    logits, report = hf_models.kimi_import_and_run(directory, inputs)
    expected = _reference_logits(text, vision, config, inputs, torch.float64)
    own_error = (_reference_logits(text, vision, config, inputs, torch.float32)
                 - expected).abs().max().item()
    error = (logits.double() - expected).abs().max().item()
    assert error <= max(1e-5, 1.25 * own_error), (error, own_error)
    # The pixels matter.
    other = dict(inputs, pixel_values=inputs["pixel_values"].flip(0))
    assert not torch.allclose(hf_models.kimi_import_and_run(directory, other)[0], logits,
                              atol=1e-3)
