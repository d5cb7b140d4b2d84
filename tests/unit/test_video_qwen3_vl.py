"""Video for Qwen3-VL-MoE, against transformers: clips made here (PyAV encodes generated
frames), decoded with PyAV (``data.video``); the family's video processor gives transformers'
``Qwen3VLVideoProcessor``'s ``pixel_values_videos`` and ``video_grid_thw`` (frames sampled at its
fps, resized within its budget, the last frame repeated to fill a temporal patch) and
``Qwen3VLProcessor``'s text (a timestamp per temporal patch); clips that cannot be used are one
line each."""

import io

import numpy as np
import pytest
import torch

from tests.helpers import hf_models, video_clips


def _reference(clip, monkeypatch, **overrides):
    """transformers' video processor on every decoded frame with the clip's metadata."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    video_clips.without_torchvision(monkeypatch)
    settings = {**video_clips.QWEN3_VL_VIDEO_SETTINGS, **overrides}
    del settings["video_processor_type"]
    processor = Qwen3VLVideoProcessor(**settings)
    metadata = VideoMetadata(total_num_frames=len(clip.frames), fps=clip.fps)
    return processor, processor(videos=[clip.pixels(range(len(clip.frames)))],
                                video_metadata=[metadata], return_metadata=True,
                                return_tensors="pt")


@pytest.mark.parametrize("frames,fps,height,width,overrides", [
    (10, 4, 72, 100, {}),  # 5 sampled frames (the last repeated), resized to 64x96
    (9, 3, 64, 64, {"fps": 1, "min_frames": 2}),  # 3 frames sampled at 1 fps, no resize
    (40, 8, 96, 160, {"max_frames": 8, "cap_pixels_per_frame": True}),  # the per-frame cap
])
def test_video_patches_equal_transformers_video_processor(tmp_path, monkeypatch, frames, fps,
                                                          height, width, overrides):
    from megatron_slmoe.data.video import decode_clip
    from megatron_slmoe.families.qwen3_vl_moe.processor import Qwen3VLVideoPatches

    data = video_clips.encode_clip(video_clips.random_frames(frames, height, width), fps=fps)
    clip = decode_clip(data)
    assert (len(clip.frames), clip.fps) == (frames, fps)
    ours = Qwen3VLVideoPatches.from_preprocessor_config(
        video_clips.save_video_processor(tmp_path, **overrides))
    values, grid, timestamps = ours.patches(clip)
    processor, theirs = _reference(clip, monkeypatch, **overrides)
    assert list(grid) == theirs["video_grid_thw"][0].tolist()
    torch.testing.assert_close(values, theirs["pixel_values_videos"], rtol=0, atol=0)
    assert ours.sample(len(clip.frames), clip.fps) == \
        theirs["video_metadata"][0].frames_indices.tolist()
    assert ours.text(grid, timestamps) == _processor_text(processor, theirs)


def _processor_text(processor, video_inputs) -> str:
    """What transformers' Qwen3VLProcessor writes for the video in a prompt (its own method;
    the processor itself cannot be built here: its auto classes want torchvision)."""
    from functools import partial
    from types import SimpleNamespace

    from transformers import Qwen3VLProcessor

    this = SimpleNamespace(video_processor=processor, video_token="<|video_pad|>",
                           vision_start_token="<|vision_start|>",
                           vision_end_token="<|vision_end|>")
    this._calculate_timestamps = partial(Qwen3VLProcessor._calculate_timestamps, this)
    return Qwen3VLProcessor.replace_video_token(this, video_inputs, 0)


def _mjpeg(sizes) -> bytes:
    """A motion-JPEG stream: one JPEG per frame, each of its own size."""
    from PIL import Image

    out = b""
    for height, width in sizes:
        buffer = io.BytesIO()
        Image.fromarray(np.full((height, width, 3), 90, np.uint8)).save(buffer, "JPEG")
        out += buffer.getvalue()
    return out


def test_clips_that_cannot_be_used_are_one_line(tmp_path):
    from megatron_slmoe.data.video import VideoDecodeError, decode_clip
    from megatron_slmoe.families.qwen3_vl_moe.processor import Qwen3VLVideoPatches

    good = video_clips.encode_clip(video_clips.random_frames(12, 32, 32), fps=4)
    cases = {
        "zero-length clip": b"",
        "not a decodable video": b"not a video at all" * 20,
        "not a decodable video ": good[:len(good) // 2],  # truncated: no index to read
        "frames have different sizes (32x32, 32x40)": _mjpeg([(32, 32), (40, 32)]),
        "longer than the limit of 2 s": good,
        # A Matroska clip whose codec id no decoder knows.
        "unsupported codec": video_clips.encode_clip(
            video_clips.random_frames(4, 32, 32), container="matroska").replace(
                b"V_MPEG4/ISO/ASP", b"V_XXXXX/XXX/XXX"),
    }
    for expected, data in cases.items():
        with pytest.raises(VideoDecodeError) as err:
            decode_clip(data, max_seconds=2.0 if "limit" in expected else 600.0)
        assert expected.strip() in str(err.value) and len(str(err.value).splitlines()) == 1
    # One frame: fewer than a temporal patch of the processor's.
    ours = Qwen3VLVideoPatches.from_preprocessor_config(video_clips.save_video_processor(tmp_path))
    with pytest.raises(VideoDecodeError, match="refuses the 32x32 clip of 1 sampled frame"):
        ours.patches(decode_clip(_mjpeg([(32, 32)])))


# --- the model: videos through the tower, DeepStack and M-RoPE per frame ------------------------

VIDEO_TOKEN, VISION_START, VISION_END = 61, 62, 63


def _video_ids(gen, grid) -> list:
    """A video as Qwen3VLProcessor writes it: per temporal patch a timestamp (text), then
    vision start, one placeholder per merged patch, vision end."""
    t, h, w = grid
    ids = []
    for _ in range(t):
        ids += torch.randint(0, 60, (2,), generator=gen).tolist()
        ids += [VISION_START] + [VIDEO_TOKEN] * (h * w // 4) + [VISION_END]
    return ids


def video_inputs(seed: int = 3) -> dict:
    """Two rows: text, a video of 2 temporal patches, text; text, an image, text, a video of 3
    temporal patches of another grid, text (padded to one length with text)."""
    gen = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(0, 60, (n,), generator=gen).tolist()  # noqa: E731
    video_grids, image_grids = [(2, 4, 4), (3, 4, 6)], [(1, 6, 4)]
    rows = [text(3) + _video_ids(gen, video_grids[0]) + text(2),
            text(2) + [hf_models.QWEN3_VL_IMAGE_TOKEN] * 6 + text(1)
            + _video_ids(gen, video_grids[1]) + text(2)]
    length = max(len(r) for r in rows)
    rows = [r + text(length - len(r)) for r in rows]
    width = 3 * 2 * 16 * 16
    return dict(input_ids=torch.tensor(rows),
                pixel_values=torch.randn(24, width, generator=gen),
                image_grid_thw=torch.tensor(image_grids),
                pixel_values_videos=torch.randn(2 * 16 + 3 * 24, width, generator=gen),
                video_grid_thw=torch.tensor(video_grids))


def _transformers_logits(model, inputs) -> torch.Tensor:
    ids = inputs["input_ids"]
    types = (ids == hf_models.QWEN3_VL_IMAGE_TOKEN).int() + 2 * (ids == VIDEO_TOKEN).int()
    with torch.no_grad():
        return model(**inputs, mm_token_type_ids=types).logits.float()


@pytest.mark.usefixtures("megatron_single_rank")
def test_video_text_logits_match_transformers(tmp_path):
    """Videos and an image in one batch: our logits are transformers' (fp32, 1e-5): the tower
    on each video's frames, DeepStack at the video positions, M-RoPE positions per frame; the
    video's DeepStack features and its frames' positions both change the logits."""
    model = hf_models.build_qwen3_vl_moe()
    hf_dir = hf_models.save(model, str(tmp_path / "qwen3vl"), layout="fused")
    inputs = video_inputs()
    ours_model, _ = hf_models.load_kimi(hf_dir)
    assert ours_model.video_token_id == VIDEO_TOKEN
    extra = {k: v for k, v in inputs.items() if k != "input_ids"}
    ours = hf_models.megatron_logits(ours_model, inputs["input_ids"], **extra)
    theirs = _transformers_logits(model, inputs)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # DeepStack matters (two of the three media are videos): without its features they differ.
    with torch.no_grad():
        for merger in model.model.visual.deepstack_merger_list:
            merger.linear_fc2.weight.zero_()
            merger.linear_fc2.bias.zero_()
        assert not torch.allclose(_transformers_logits(model, inputs), theirs, atol=1e-3)


@pytest.mark.usefixtures("megatron_single_rank")
def test_video_placeholders_that_do_not_match_the_videos_are_one_line(tmp_path):
    from megatron_slmoe.model.tower_language import ImageTokenMismatch

    hf_dir = hf_models.save(hf_models.build_qwen3_vl_moe(), str(tmp_path / "q"), layout="fused")
    model, _ = hf_models.load_kimi(hf_dir)
    inputs = video_inputs()
    ids, images, videos = inputs["input_ids"], inputs["image_grid_thw"], inputs["video_grid_thw"]
    for bad_videos, message in ((None, "video placeholders and no videos"),
                                (videos[:1], "video frame placeholders come in runs of"),
                                (videos.flip(0), "video frame placeholders come in runs of")):
        with pytest.raises(ImageTokenMismatch, match=message) as err:
            model.positions(ids, images, bad_videos)
        assert len(str(err.value).splitlines()) == 1
    with pytest.raises(ImageTokenMismatch, match="video tokens .id 61. and no videos") as err:
        model.embed(ids, torch.arange(ids.shape[1]).expand_as(ids), inputs["pixel_values"],
                    images)
    assert len(str(err.value).splitlines()) == 1


@pytest.mark.usefixtures("megatron_single_rank")
def test_greedy_answers_with_videos_equal_transformers_generate(tmp_path):
    """The package's generator (the videos enter the KV cache with the prefill, M-RoPE
    positions per frame, generated tokens after the prompt's largest position) gives
    transformers' greedy ``generate``: a prompt with a video, one with an image and a video."""
    from megatron_slmoe.data.image_text import GenerationPrompt
    from megatron_slmoe.inference.generator import TextGenerator

    model = hf_models.build_qwen3_vl_moe()
    hf_dir = hf_models.save(model, str(tmp_path / "qwen3vl"), layout="fused")
    inputs = video_inputs()
    ids = inputs["input_ids"]
    videos = inputs["pixel_values_videos"].split([2 * 16, 3 * 24])
    grids = inputs["video_grid_thw"]
    empty = torch.zeros(0, inputs["pixel_values"].shape[1])
    prompts = [GenerationPrompt(tokens=ids[0, :21].tolist(), images=empty,
                                image_grid_thw=torch.zeros(0, 3, dtype=torch.long),
                                videos=videos[0], video_grid_thw=grids[:1]),
               GenerationPrompt(tokens=ids[1, :41].tolist(), images=inputs["pixel_values"],
                                image_grid_thw=inputs["image_grid_thw"], videos=videos[1],
                                video_grid_thw=grids[1:])]
    assert ids[0, 20] != VIDEO_TOKEN and ids[0, 18] == VISION_END
    ours_model, _ = hf_models.load_kimi(hf_dir)
    eos = hf_models.VOCAB - 1
    answers = TextGenerator(ours_model, eos, hf_models.VOCAB).generate(prompts, 6)
    assert sum(len(a) for a in answers) > 4
    for prompt, answer in zip(prompts, answers):
        prompt_ids = torch.tensor([prompt.tokens])
        types = ((prompt_ids == hf_models.QWEN3_VL_IMAGE_TOKEN).int()
                 + 2 * (prompt_ids == VIDEO_TOKEN).int())
        images = ({"pixel_values": prompt.images, "image_grid_thw": prompt.image_grid_thw}
                  if prompt.images.shape[0] else {})
        with torch.no_grad():
            out = model.generate(input_ids=prompt_ids, pixel_values_videos=prompt.videos,
                                 video_grid_thw=prompt.video_grid_thw, mm_token_type_ids=types,
                                 max_new_tokens=6, do_sample=False, eos_token_id=eos,
                                 pad_token_id=eos, **images)
        theirs = out[0, prompt_ids.shape[1]:].tolist()
        theirs = theirs[:theirs.index(eos)] if eos in theirs else theirs
        assert answer == theirs
