"""Kimi K3's media processor (families/kimi_k3/processor.py) and how the image-text data path
writes its media (data/image_inputs.py), held to a plain reference written from the release's
processor description (tests/helpers/k3_processor_reference.py): patches, grids and the prompt
with one <|media_pad|> per merged patch, for RGB, RGBA, LA and palette-transparent images, an
image over the patch budget and one over the per-side limit, and a clip cut into 4-frame chunks
at the configured fps."""

import io
import json
import re

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_slmoe.data.errors import DataError
from megatron_slmoe.data.image_inputs import NativeResolutionImages, media_marks
from megatron_slmoe.data.video import decode_clip
from megatron_slmoe.families.kimi_k3.processor import (
    KimiK3ImagePatches,
    KimiK3Media,
    KimiK3VideoPatches,
)
from tests.helpers import k3_processor_reference as ref
from tests.helpers import video_clips

PAD = "<|media_pad|>"
SPECIAL = ("<|media_begin|>", "<|media_content|>", "<|media_end|>", PAD)


def _settings(tmp_path, **changes):
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps({"media_proc_cfg": {**ref.RELEASE, **changes}}))
    return str(path), {**ref.RELEASE, **changes}


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _images():
    gen = np.random.default_rng(0)
    rgb = Image.fromarray(gen.integers(0, 256, (30, 45, 3), dtype=np.uint8))
    rgba = Image.fromarray(gen.integers(0, 256, (33, 20, 4), dtype=np.uint8), "RGBA")
    la = Image.fromarray(gen.integers(0, 256, (17, 29, 2), dtype=np.uint8), "LA")
    palette = Image.fromarray(gen.integers(0, 8, (26, 31), dtype=np.uint8), "P")
    palette.putpalette(list(gen.integers(0, 256, 768)))
    palette.info["transparency"] = 3
    return {"rgb": rgb, "rgba": rgba, "la": la, "palette": palette}


@pytest.mark.parametrize("stage", ["after_resize", "before_resize"])
def test_images_equal_the_reference(tmp_path, stage):
    # in_patch_limit 4: every image here is over the budget, so each is resized (with the
    # transparency filled before or after it) and padded.
    path, cfg = _settings(tmp_path, in_patch_limit=4, transparent_bg_fill_stage=stage)
    patches = KimiK3ImagePatches(KimiK3Media.from_preprocessor_config(path))
    for name, image in _images().items():
        decoded = Image.open(io.BytesIO(_png(image)))
        values, grid = patches.patches(decoded)
        expected, expected_grid, _ = ref.image(Image.open(io.BytesIO(_png(image))), cfg)
        assert grid == expected_grid, name
        torch.testing.assert_close(values, expected, rtol=0, atol=1e-6, msg=name)


def test_transparency_is_the_chessboard_and_limits_resize(tmp_path):
    """An image at its own size (the release's budgets) whose transparent pixels become K3's
    chessboard (white 255 at the top left, grey 180 from x = 8), and images over the patch
    budget and the per-side limit."""
    path, cfg = _settings(tmp_path)
    patches = KimiK3ImagePatches(KimiK3Media.from_preprocessor_config(path))
    clear = Image.new("RGBA", (60, 60), (10, 200, 30, 0))
    values, grid = patches.patches(clear)
    assert grid == (1, 6, 6)  # 60 -> padded to 84 pixels
    assert values[0, :, 0, 0].tolist() == [1.0, 1.0, 1.0]
    assert values[0, 0, 0, 8].item() == pytest.approx(180 / 127.5 - 1)
    assert values[4, 0, 0, 4].item() == -1.0  # x = 60: the zero padding
    for image, wanted in ((Image.new("RGB", (7200, 20), (5, 6, 7)), (1, 2, 512)),
                          (Image.new("RGB", (1000, 1000), (9, 9, 9)), None)):
        values, grid = patches.patches(image)
        expected, expected_grid, _ = ref.image(image, cfg)
        assert grid == expected_grid
        torch.testing.assert_close(values, expected, rtol=0, atol=1e-6)
        if wanted:
            assert grid == wanted  # the per-side limit: 7200 px -> 7168 = 512 patches
    small, _ = _settings(tmp_path, in_patch_limit=400)
    _, grid = KimiK3ImagePatches(KimiK3Media.from_preprocessor_config(small)).patches(
        Image.new("RGB", (1000, 1000)))
    # 71 x 71 patches scaled to 20 x 20 (281 pixels), padded to whole merged patches: 22 x 22
    # (the padding may pass the budget, as the release's processor lets it).
    assert grid == (1, 22, 22) == ref.image(Image.new("RGB", (1000, 1000)),
                                            {**cfg, "in_patch_limit": 400})[1]


def _clip(frames=11, fps=10, size=(36, 50)):
    return video_clips.encode_clip(video_clips.random_frames(frames, *size), fps=fps)


def _decoded_frames(data):
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        return [f.to_ndarray(format="rgb24") for f in container.decode(stream)], \
            float(stream.average_rate)


@pytest.mark.parametrize("frames,fps,chunks", [(11, 10, [4, 4, 1]), (5, 4, [4, 1]),
                                               (3, 30, [1])])
def test_video_chunks_equal_the_reference(tmp_path, frames, fps, chunks):
    path, cfg = _settings(tmp_path, in_patch_limit_each_frame=6)
    videos = KimiK3VideoPatches(KimiK3Media.from_preprocessor_config(path))
    data = _clip(frames, fps)
    values, grids, starts = videos.patches(decode_clip(data))
    expected, expected_grids, text = ref.video(*_decoded_frames(data), cfg)
    assert [g[0] for g in grids] == chunks
    assert [tuple(g) for g in grids] == [tuple(g) for g in expected_grids]
    torch.testing.assert_close(values, expected, rtol=0, atol=1e-6)
    pads = [g[1] * g[2] // 4 for g in grids]
    written = videos.text(starts)
    assert _expanded(written, pads) == text


def _expanded(text: str, pads) -> str:
    counts = iter(pads)
    return re.sub(re.escape(PAD), lambda _: PAD * next(counts), text)


class _Tokens:
    """Ids of text: the media tokens 2, 3, 4 and the pad 1; other characters their code point
    plus 10."""

    ids = {"<|media_begin|>": 2, "<|media_content|>": 3, "<|media_end|>": 4, PAD: 1}

    def encode(self, text):
        out = []
        for piece in re.split("(" + "|".join(map(re.escape, SPECIAL)) + ")", text):
            out += [self.ids[piece]] if piece in self.ids else [ord(c) + 10 for c in piece]
        return out


def test_the_prompt_holds_each_image_and_chunk_in_text_order(tmp_path):
    """A sample with an image, a clip and an RGBA image: one stream of media items in the order
    the text names them, the prompt as the reference writes it (size of each image, a timestamp
    per chunk, one <|media_pad|> per merged patch)."""
    path, cfg = _settings(tmp_path, in_patch_limit_each_frame=6)
    media = KimiK3Media.from_preprocessor_config(path)
    images = NativeResolutionImages(KimiK3ImagePatches(media), PAD, 1,
                                    "<|media_begin|>image<|media_content|>" + PAD
                                    + "<|media_end|>", videos=KimiK3VideoPatches(media))
    pictures = _images()
    clip = _clip(6, 8)
    messages = [{"role": "user", "content": "<image>a<video>b<image>c"}]
    pixels = images.pixels([_png(pictures["rgb"]), _png(pictures["rgba"])], [clip],
                           media_marks(messages))
    rendered = images.messages(messages, pixels)[0]["content"]
    first, g1, t1 = ref.image(pictures["rgb"], cfg)
    chunks, grids, tv = ref.video(*_decoded_frames(clip), cfg)
    second, g2, t2 = ref.image(Image.open(io.BytesIO(_png(pictures["rgba"]))), cfg)
    assert pixels["image_grid_thw"].tolist() == [list(g1), *map(list, grids), list(g2)]
    torch.testing.assert_close(pixels["pixel_values"], torch.cat([first, chunks, second]),
                               rtol=0, atol=1e-6)
    tokens = _Tokens()
    ids = tokens.encode(rendered)
    out, targets = images.expand(ids, [1] * len(ids), pixels)
    assert out == tokens.encode(f"{t1}a{tv}b{t2}c")
    assert sum(t == 0 for t in targets) == out.count(1)  # the placeholders are no targets


def test_bad_settings_are_one_line(tmp_path):
    for changes, match in (({"fixed_output_tokens": 64}, "fixed_output_tokens"),
                           ({"transparent_bg_fill_stage": "later"}, "transparent_bg_fill_stage"),
                           ({"sample_fps": -1}, "sample_fps"),
                           ({"transparent_bg_config": {"pattern": "plaid"}}, "plaid")):
        path, _ = _settings(tmp_path, **changes)
        with pytest.raises(DataError, match=match):
            KimiK3Media.from_preprocessor_config(path)
    other = tmp_path / "transformers.json"
    other.write_text(json.dumps({"patch_size": 14, "merge_size": 2, "max_patches": 16384}))
    with pytest.raises(DataError, match="max_patches, merge_size are another processor's"):
        KimiK3Media.from_preprocessor_config(str(other))
