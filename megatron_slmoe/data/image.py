"""Image decoding and preprocessing for the vision tower, with pillow and torch only.

``decode_image(data)`` turns encoded bytes (PNG, JPEG, WebP, ... whatever pillow reads) into an
RGB image (transparency composited onto white, as transformers' image processors do), or raises
:class:`ImageDecodeError` with one line saying why: not an image, truncated, corrupt, too large
(pillow's decompression-bomb limit), or empty. Truncated data is always an
error, whatever ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES`` says (pillow would otherwise fill the
missing rows with grey: a silently wrong sample).

``preprocess_image(image, config)`` makes the tower's input, float32 [tiles, 3, img_h, img_w]:

* ``max_tiles == 1``: the whole image resized (bicubic) to img_h x img_w;
* ``max_tiles > 1``: the image cut into a cols x rows grid of tiles (the grid with at most
  ``max_tiles`` tiles whose aspect ratio is nearest the image's; ties go to more tiles), the image
  first resized to exactly fill it, each tile img_h x img_w; with ``thumbnail`` the whole image
  resized to one tile is appended (the layout of Megatron's multimodal examples);

then scaled to [0, 1] and normalised per channel with ``mean`` / ``std`` (CLIP's by default).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Tuple

import torch

from megatron_slmoe.data.config import CLIP_MEAN, CLIP_STD

if TYPE_CHECKING:
    from megatron_slmoe.data.config import ImageTextConfig
    from megatron_slmoe.model.config import VisionConfig


class ImageDecodeError(ValueError):
    """Bytes that do not decode to a complete image; the message is one line."""


@dataclass(frozen=True)
class ImagePreprocessConfig:
    """How images become vision-tower input. A run's comes from its ``vision`` and
    ``image_text`` sections (``from_sections``), which check the values and name the flags."""

    img_h: int = 32
    """Tile height in pixels (the vision tower's)."""
    img_w: int = 32
    """Tile width in pixels (the vision tower's)."""
    max_tiles: int = 1
    """1: no tiling; more: cut each image into up to this many tiles."""
    thumbnail: bool = False
    """With tiling: append the whole image as one more tile."""
    mean: Tuple[float, float, float] = CLIP_MEAN
    """Per-channel mean subtracted after scaling to [0, 1]."""
    std: Tuple[float, float, float] = CLIP_STD
    """Per-channel standard deviation divided by after subtracting the mean."""

    @classmethod
    def from_sections(cls, vision: VisionConfig, image_text: ImageTextConfig
                      ) -> "ImagePreprocessConfig":
        """A run's: the tower's tile size (``vision``), tiling and normalisation
        (``image_text``)."""
        return cls(img_h=vision.img_h, img_w=vision.img_w, max_tiles=image_text.max_tiles,
                   thumbnail=image_text.thumbnail, mean=tuple(image_text.image_mean),
                   std=tuple(image_text.image_std))

    @property
    def tiles_per_image(self) -> int:
        """Upper bound of the tiles one image becomes."""
        return self.max_tiles + (1 if self.thumbnail else 0)


def decode_image(data: bytes, rgb: bool = True):
    """An RGB ``PIL.Image`` of complete, decodable image bytes, else :class:`ImageDecodeError`
    (``rgb`` False: in its own mode, its transparency kept, for a processor that composites it
    itself)."""
    from PIL import Image, ImageFile

    if not data:
        raise ImageDecodeError("empty image data")
    try:
        with Image.open(io.BytesIO(data)) as probe:
            probe.verify()  # checks structure and checksums (PNG) without decoding pixels
        image = Image.open(io.BytesIO(data))
        if ImageFile.LOAD_TRUNCATED_IMAGES:  # someone switched it on: decode strictly anyway
            ImageFile.LOAD_TRUNCATED_IMAGES = False
            try:
                image.load()
            finally:
                ImageFile.LOAD_TRUNCATED_IMAGES = True
        else:
            image.load()
        return _rgb(image) if rgb else image
    except Image.DecompressionBombError as err:
        raise ImageDecodeError(f"image too large ({err})") from None
    except Exception as err:  # pillow raises OSError, SyntaxError, ValueError, EOFError, ...
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ImageDecodeError(f"undecodable image: {reason}") from None


def _rgb(image):
    """The image as RGB; a transparent one composited onto white (dropping the alpha would
    bring back whatever colour the transparent pixels happen to hold)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)),
                                     rgba).convert("RGB")
    return image.convert("RGB")


def tile_grid(width: int, height: int, max_tiles: int) -> Tuple[int, int]:
    """(cols, rows) with cols * rows <= max_tiles whose aspect ratio is nearest width / height
    (compared in log space); ties go to more tiles, then to more columns."""
    target = math.log(width / height)
    best, best_key = (1, 1), None
    for cols in range(1, max_tiles + 1):
        for rows in range(1, max_tiles // cols + 1):
            key = (round(abs(math.log(cols / rows) - target), 9), -(cols * rows), -cols)
            if best_key is None or key < best_key:
                best, best_key = (cols, rows), key
    return best


def _tiles(image, cols: int, rows: int) -> torch.Tensor:
    """uint8 [rows * cols, 3, h, w]: the image cut into a rows x cols grid of equal tiles, in
    reading order (one copy of the pixels, no per-tile images)."""
    import numpy as np

    width, height = image.size
    h, w = height // rows, width // cols
    pixels = torch.from_numpy(np.array(image, dtype=np.uint8))  # [H, W, 3], writable copy
    tiles = pixels.view(rows, h, cols, w, 3).permute(0, 2, 4, 1, 3)
    return tiles.reshape(rows * cols, 3, h, w)


def preprocess_image(image, config: ImagePreprocessConfig) -> torch.Tensor:
    """float32 [tiles, 3, img_h, img_w], normalised (see the module doc)."""
    from PIL import Image

    size = (config.img_w, config.img_h)
    if config.max_tiles == 1:
        pixels = _tiles(image.resize(size, Image.BICUBIC), 1, 1)
    else:
        cols, rows = tile_grid(image.width, image.height, config.max_tiles)
        grid = image.resize((cols * config.img_w, rows * config.img_h), Image.BICUBIC)
        pixels = _tiles(grid, cols, rows)
        if config.thumbnail:
            pixels = torch.cat([pixels, _tiles(image.resize(size, Image.BICUBIC), 1, 1)])
    # (x / 255 - mean) / std as one multiply-add in place: x * scale - shift.
    std = torch.tensor(config.std, dtype=torch.float64)
    scale = (1.0 / (255.0 * std)).to(torch.float32).view(1, 3, 1, 1)
    shift = (torch.tensor(config.mean, dtype=torch.float64) / std).to(torch.float32).view(1, 3, 1, 1)
    return pixels.float().mul_(scale).sub_(shift)
