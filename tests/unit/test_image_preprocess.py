"""Image decoding and preprocessing (pillow + torch): pixels against a numpy computation of the
same resize and normalisation, tiling grids and tile contents, and every kind of bad image bytes
refused with one line (truncated PNG and JPEG even with pillow's LOAD_TRUNCATED_IMAGES on)."""

import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from megatron_slmoe.data.image import (
    CLIP_MEAN,
    CLIP_STD,
    ImageDecodeError,
    ImagePreprocessConfig,
    decode_image,
    preprocess_image,
    tile_grid,
)


def _encoded(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


@pytest.fixture(scope="module")
def picture():
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (30, 50, 3), dtype=np.uint8), "RGB")


def _reference(image: Image.Image, size, mean=CLIP_MEAN, std=CLIP_STD) -> np.ndarray:
    pixels = np.asarray(image.resize(size, Image.BICUBIC), dtype=np.float64) / 255.0
    return ((pixels - np.array(mean)) / np.array(std)).transpose(2, 0, 1)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "BMP"])
def test_decode_formats_to_rgb(picture, fmt):
    decoded = decode_image(_encoded(picture, fmt))
    assert decoded.mode == "RGB" and decoded.size == picture.size
    if fmt in ("PNG", "BMP"):  # lossless
        assert np.array_equal(np.asarray(decoded), np.asarray(picture))


def test_decode_grey_and_alpha_become_rgb():
    grey = Image.new("L", (4, 4), 77)
    assert np.asarray(decode_image(_encoded(grey, "PNG")))[0, 0].tolist() == [77, 77, 77]
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 128))
    assert decode_image(_encoded(rgba, "PNG")).mode == "RGB"


def test_preprocess_matches_numpy_reference(picture):
    config = ImagePreprocessConfig(img_h=16, img_w=24)
    pixels = preprocess_image(picture, config)
    assert pixels.shape == (1, 3, 16, 24) and pixels.dtype == torch.float32
    np.testing.assert_allclose(pixels[0].numpy(), _reference(picture, (24, 16)), atol=1e-5)


def test_custom_normalisation(picture):
    config = ImagePreprocessConfig(img_h=8, img_w=8, mean=(0.5, 0.5, 0.5), std=(0.5, 0.25, 1.0))
    np.testing.assert_allclose(preprocess_image(picture, config)[0].numpy(),
                               _reference(picture, (8, 8), config.mean, config.std), atol=1e-5)


@pytest.mark.parametrize("size, max_tiles, grid", [
    ((100, 100), 4, (2, 2)), ((200, 100), 4, (2, 1)), ((100, 300), 6, (1, 3)),
    ((100, 100), 1, (1, 1)), ((160, 90), 12, (4, 2)), ((90, 160), 12, (2, 4)),
])
def test_tile_grid_follows_aspect_ratio(size, max_tiles, grid):
    assert tile_grid(*size, max_tiles) == grid


def test_tiles_are_crops_of_the_resized_image_and_thumbnail_last(picture):
    config = ImagePreprocessConfig(img_h=10, img_w=10, max_tiles=4, thumbnail=True)
    tiles = preprocess_image(picture, config)  # 50 x 30 -> grid (2, 1)
    assert tiles.shape == (3, 3, 10, 10)
    grid = picture.resize((20, 10), Image.BICUBIC)
    for column in range(2):
        crop = grid.crop((column * 10, 0, column * 10 + 10, 10))
        np.testing.assert_allclose(tiles[column].numpy(), _reference(crop, (10, 10)), atol=1e-5)
    np.testing.assert_allclose(tiles[2].numpy(), _reference(picture, (10, 10)), atol=1e-5)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
@pytest.mark.parametrize("load_truncated", [False, True])
def test_truncated_images_are_refused(picture, fmt, load_truncated, monkeypatch):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", load_truncated)
    data = _encoded(picture, fmt)
    with pytest.raises(ImageDecodeError) as err:
        decode_image(data[: len(data) * 2 // 3])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("data, words", [
    (b"", "empty"), (b"definitely not an image", "undecodable"),
    (b"\x89PNG\r\n\x1a\n" + bytes(40), "undecodable"),
])
def test_garbage_is_refused(data, words):
    with pytest.raises(ImageDecodeError, match=words):
        decode_image(data)


def test_corrupt_png_checksum_is_refused(picture):
    data = bytearray(_encoded(picture, "PNG"))
    data[60] ^= 0xFF  # inside the IDAT chunk: its CRC no longer matches
    with pytest.raises(ImageDecodeError):
        decode_image(bytes(data))


@pytest.mark.parametrize("flags, named", [
    (["--img-h", "0"], "--img-h"), (["--max-num-tiles", "0"], "--max-num-tiles"),
    (["--use-thumbnail"], "--use-thumbnail"), (["--image-std", "1", "0", "1"], "--image-std"),
    (["--image-mean", "0.5", "0.5"], "--image-mean"),
])
def test_bad_image_settings_are_refused_naming_the_flag(flags, named):
    """The image settings live in the run configuration's sections (vision, image_text), which
    check them; the preprocessing takes them from there."""
    from megatron_slmoe.config.errors import ConfigError
    from megatron_slmoe.training.cli import parse_command_line

    with pytest.raises(ConfigError, match=named):
        parse_command_line(["--task", "image-text", *flags], prog="t", description="t",
                           world_size=0)


def test_a_runs_preprocessing_is_its_sections():
    from megatron_slmoe.training.cli import parse_command_line

    run = parse_command_line(["--task", "image-text", "--img-h", "48", "--img-w", "64",
                              "--max-num-tiles", "4", "--use-thumbnail", "--image-mean", "0.1",
                              "0.2", "0.3"], prog="t", description="t",
                             world_size=0).run
    config = ImagePreprocessConfig.from_sections(run.vision, run.image_text)
    assert config == ImagePreprocessConfig(img_h=48, img_w=64, max_tiles=4, thumbnail=True,
                                           mean=(0.1, 0.2, 0.3), std=tuple(run.image_text.image_std))
