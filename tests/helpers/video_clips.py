"""Tiny video clips made in the tests (PyAV encodes generated frames; nothing is downloaded), and
a torch stand-in for the torchvision functions transformers' video processors call, so that
transformers' own ``Qwen3VLVideoProcessor`` runs here as the reference (this environment has no
torchvision; with it installed the stand-in is not used)."""

from __future__ import annotations

import enum
import io
import json
import types

import numpy as np
import torch

QWEN3_VL_VIDEO_SETTINGS = {
    "video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "fps": 2, "min_frames": 4, "max_frames": 16,
    "size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64 * 8},
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "cap_pixels_per_frame": False}
"""A tiny Qwen3-VL video processor: 2 frames a second, at most 8 frames of 64x64 pixels."""


def random_frames(count: int, height: int, width: int, seed: int = 0) -> list:
    """``count`` smooth random RGB frames (uint8 [height, width, 3]): gradients and a moving
    square, which a lossy codec keeps recognisable."""
    gen = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    frames = []
    for t in range(count):
        base = gen.integers(0, 255, 3)
        frame = ((base + ys[..., None] * 2 + xs[..., None] + 9 * t) % 256).astype(np.uint8)
        y, x = (5 * t) % max(1, height - 8), (7 * t) % max(1, width - 8)
        frame[y:y + 8, x:x + 8] = 255
        frames.append(frame)
    return frames


def encode_clip(frames: list, fps: int = 4, codec: str = "mpeg4", container: str = "mp4") -> bytes:
    """The frames encoded as one clip (yuv420p: even sizes)."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buffer.getvalue()


def save_video_processor(directory, **overrides) -> str:
    path = directory / "video_preprocessor_config.json"
    path.write_text(json.dumps({**QWEN3_VL_VIDEO_SETTINGS, **overrides}))
    return str(path)


class _InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


def _resize(image, size, interpolation=_InterpolationMode.BILINEAR, antialias=True):
    # torchvision's CPU resize of uint8 frames: the native antialiased kernel, uint8 out.
    lead = image.shape[:-3]
    out = torch.nn.functional.interpolate(image.reshape(-1, *image.shape[-3:]), size=list(size),
                                          mode=interpolation.value, align_corners=False,
                                          antialias=antialias)
    return out.reshape(*lead, *out.shape[-3:])


def _normalize(image, mean, std, inplace=False):
    mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    return (image.sub_(mean) if inplace else image.sub(mean)).div_(std)


def without_torchvision(monkeypatch) -> None:
    """transformers' torchvision calls of the video path answered by torch, where torchvision is
    absent."""
    import transformers.image_processing_backends as backends
    import transformers.video_processing_utils as videos
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return
    tvf = types.SimpleNamespace(resize=_resize, normalize=_normalize,
                                grayscale_to_rgb=lambda video: video,
                                InterpolationMode=_InterpolationMode)
    monkeypatch.setattr(backends, "tvF", tvf, raising=False)
    monkeypatch.setattr(videos, "tvF", tvf, raising=False)
    monkeypatch.setattr(backends, "pil_torch_interpolation_mapping",
                        {3: _InterpolationMode.BICUBIC, 2: _InterpolationMode.BILINEAR,
                         0: _InterpolationMode.NEAREST}, raising=False)


VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def save_qwen3_vl_video_checkpoint(hf_dir, seq_length: int, **text):
    """A tiny Qwen3-VL-MoE as users get it in ``hf_dir``: weights, a ChatML tokenizer with
    Qwen's vision tokens (config.json's ids), Qwen2-VL's image and Qwen3-VL's video processor
    settings; ``text`` overrides the language model's settings; returns transformers' model."""
    import tokenizers

    from tests.helpers import hf_models

    hf_dir.mkdir(parents=True)
    hf_models.save_chatml_tokenizer(hf_dir, special_tokens=VISION_TOKENS)
    backend = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    ids = {t: backend.token_to_id(t) for t in VISION_TOKENS}
    text = {"vocab_size": 320, "max_position_embeddings": seq_length, **text}
    model = hf_models.build_qwen3_vl_moe(image_token_id=ids["<|image_pad|>"], **text)
    model.config.video_token_id = ids["<|video_pad|>"]
    model.config.vision_start_token_id = ids["<|vision_start|>"]
    model.config.vision_end_token_id = ids["<|vision_end|>"]
    hf_models.save(model, str(hf_dir), layout="fused")
    (hf_dir / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2,
        "size": {"shortest_edge": 64 * 64, "longest_edge": 128 * 128},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    save_video_processor(hf_dir)
    return model
