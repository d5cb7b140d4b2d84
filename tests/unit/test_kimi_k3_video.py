"""Kimi K3 video on one rank: a clip cut by K3's processor into 4-frame chunks (the last keeps
the rest) goes through the tower as the plain reference cuts and runs it
(tests/helpers/moonvit3d_reference.py ``video``: each chunk its own item, time embedding from its
first frame, pooled over its frames, then 2 x 2 merged), and a K3 checkpoint with its tower gives
the references' video+text logits (the plain K3 text model fed the plain tower's features at the
<|media_pad|> positions)."""

import json

import pytest
import torch

from megatron_slmoe.data.video import decode_clip
from megatron_slmoe.families.kimi_k3.processor import KimiK3Media, KimiK3VideoPatches
from megatron_slmoe.families.kimi_k3.vision import KimiK3Vision
from tests.helpers import hf_models, video_clips
from tests.helpers import k3_processor_reference as processor_ref
from tests.helpers import moonvit3d_reference as ref
from tests.unit.test_kimi_k3_vision import TINY

PAD = 100


def _chunks(tmp_path, frames=9):
    """A clip of ``frames`` frames at 8 fps (all sampled): pixel values, chunk grids, and the
    clip's frames as one video ``(frames, h, w)``."""
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps({"media_proc_cfg": dict(processor_ref.RELEASE)}))
    videos = KimiK3VideoPatches(KimiK3Media.from_preprocessor_config(str(path)))
    clip = video_clips.encode_clip(video_clips.random_frames(frames, 28, 56), fps=8)
    pixels, grids, _ = videos.patches(decode_clip(clip))
    return pixels, torch.tensor(grids)


def test_video_chunks_through_the_tower_equal_the_reference(tmp_path):
    pixels, grids = _chunks(tmp_path)
    assert grids.tolist() == [[4, 2, 4], [4, 2, 4], [1, 2, 4]]
    model = hf_models.randomise_tower(KimiK3Vision(TINY)).double()
    state = model.state_dict()
    with torch.no_grad():
        ours = model(pixels.double(), grids)
        merged = ref.video(state, TINY, pixels.double(), 9, 2, 4)
        torch.testing.assert_close(ours, ref.projector(state, TINY, merged), rtol=1e-5,
                                   atol=1e-6)
        # Chunked as the tower's time embedding spans (4 frames), not as one 9-frame item or
        # chunks of 3.
        other = torch.cat([ref.tower(state, TINY, pixels.double()[i * 24:(i + 1) * 24],
                                     torch.tensor([[3, 2, 4]])) for i in range(3)])
        assert not torch.allclose(merged, other, atol=1e-3)
    assert ours.shape == (3 * 2, TINY.text_hidden_size)  # one frame's tokens per chunk


@pytest.fixture(scope="module")
def k3_video(tmp_path_factory):
    from tests.helpers import kimi_k3_reference as k3ref

    text = k3ref.round_experts_to_mxfp4_(k3ref.build())
    vision, config = hf_models.k3_tower(text)
    directory = hf_models.save_kimi_k3(text, tmp_path_factory.mktemp("k3v") / "release",
                                       vision=vision, vision_config=hf_models.K3_VISION_CONFIG,
                                       image_token_id=PAD)
    return text, vision, config, directory


def _batch(pixels, grids, seed=3):
    """One row: text, one <|media_pad|> per token of each chunk (the chunks' texts between
    them stand as plain ids), text."""
    gen = torch.Generator().manual_seed(seed)
    row = [torch.randint(0, PAD, (3,), generator=gen)]
    for _, h, w in grids.tolist():
        row += [torch.randint(0, PAD, (2,), generator=gen), torch.full((h * w // 4,), PAD)]
    row.append(torch.randint(0, PAD, (3,), generator=gen))
    return {"input_ids": torch.cat(row)[None], "pixel_values": pixels, "image_grid_thw": grids}


def _reference_logits(text, vision, config, inputs, dtype, frames, h, w):
    import copy

    state = {k: v.to(dtype) for k, v in vision.state_dict().items()}
    with torch.no_grad():
        features = ref.projector(state, config, ref.video(
            state, config, inputs["pixel_values"].to(dtype), frames, h, w))
        reference = copy.deepcopy(text).to(dtype)
        media = inputs["input_ids"] == PAD
        embeds = reference.language_model.model.embed_tokens(
            inputs["input_ids"].masked_fill(media, 0))
        embeds[media] = features
        return reference(inputs_embeds=embeds).double()


@pytest.mark.usefixtures("megatron_single_rank")
def test_k3_video_text_logits_equal_the_references(k3_video, tmp_path):
    """fp32 logits against the references in fp64: within 1e-5, or within twice the references'
    own fp32 distance from their fp64 run (13 layers after a tower over 24 video tokens: the two
    fp32 runs differ by the order of their sums; the tower alone is held in fp64 above)."""
    text, vision, config, directory = k3_video
    pixels, grids = _chunks(tmp_path)
    inputs = _batch(pixels, grids)
    model, _ = hf_models.load_kimi(directory)

    def ours(pixel_values):
        return hf_models.megatron_logits(model, inputs["input_ids"], pixel_values=pixel_values,
                                         image_grid_thw=grids)

    logits = ours(pixels)
    expected = _reference_logits(text, vision, config, inputs, torch.float64, 9, 2, 4)
    own = (_reference_logits(text, vision, config, inputs, torch.float32, 9, 2, 4)
           - expected).abs().max().item()
    error = (logits.double() - expected).abs().max().item()
    assert error <= max(1e-5, 2 * own), (error, own)
    # The order of the frames matters (the time embedding): the clip reversed differs.
    frames = pixels.unflatten(0, (9, 8)).flip(0).flatten(0, 1)
    assert not torch.allclose(ours(frames), logits, atol=1e-4)


MEDIA_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")


def test_prepared_clips_and_images_read_as_the_reference_writes_them(tmp_path):
    """A K3 checkpoint's image-text data path (tools/prepare_image_text.py's JSONL with
    ``videos`` and ``images``, energon shards, ImageTextDataset): the sample's ids are the chat
    template of the conversation as the reference writes its media (each image with its size,
    each video as timestamped 4-frame chunks, one <|media_pad|> per merged patch), its pixels
    the reference's media in text order."""
    from transformers import AutoTokenizer

    from megatron_slmoe.data.image_text import ImageTextDataset
    from megatron_slmoe.data.image_text_prepare import prepare_from_llava_json
    from megatron_slmoe.data.tokenizer import load_tokenizer
    from tests.helpers import kimi_k3_reference as k3ref
    from tests.unit.test_kimi_k3_processor import _decoded_frames, _images, _png

    hf_dir = tmp_path / "k3"
    hf_models.save_chatml_tokenizer(hf_dir, special_tokens=MEDIA_TOKENS)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    pad = hf_tokenizer.convert_tokens_to_ids("<|media_pad|>")
    text = k3ref.build()
    tower, _ = hf_models.k3_tower(text, seed=None)
    hf_models.save_kimi_k3(text, hf_dir, vision=tower,
                           vision_config=hf_models.K3_VISION_CONFIG, image_token_id=pad)
    cfg = {**processor_ref.RELEASE, "in_patch_limit_each_frame": 6}
    (hf_dir / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": cfg}))

    media = tmp_path / "media"
    media.mkdir()
    clip = video_clips.encode_clip(video_clips.random_frames(6, 28, 56), fps=8)
    (media / "c.mp4").write_bytes(clip)
    picture = _images()["rgba"]
    (media / "p.png").write_bytes(_png(picture))
    record = {"messages": [{"role": "user", "content": "<video>Which way?<image>"},
                           {"role": "assistant", "content": "up"}],
              "videos": ["c.mp4"], "images": ["p.png"]}
    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text((json.dumps(record) + "\n") * 2)
    prepare_from_llava_json(str(tmp_path / "ds"), str(jsonl), str(media))

    tokenizer = load_tokenizer(str(hf_dir))
    dataset = ImageTextDataset(str(tmp_path / "ds"), tokenizer, 160,
                               images=hf_models.kimi_image_input(str(hf_dir), tokenizer),
                               split="train", shuffle=False)
    sample = dataset[0]
    chunks, grids, video_text = processor_ref.video(*_decoded_frames(clip), cfg)
    values, grid, image_text = processor_ref.image(picture, cfg)
    written = [{**m, "content": m["content"].replace("<video>", video_text)
                .replace("<image>", image_text)} for m in record["messages"]]
    ids = hf_tokenizer(hf_tokenizer.apply_chat_template(written, tokenize=False),
                       add_special_tokens=False)["input_ids"]
    assert sample["tokens"][:len(ids) - 1].tolist() == ids[:-1]
    assert ids.count(pad) == sum(h * w // 4 for _, h, w in [*grids, grid])
    assert sample["image_grid_thw"].tolist() == [list(g) for g in [*grids, grid]]
    torch.testing.assert_close(sample["pixel_values"], torch.cat([chunks, values]), rtol=0,
                               atol=1e-6)
    assert set(sample) == {"tokens", "labels", "loss_mask", "pixel_values", "image_grid_thw"}
