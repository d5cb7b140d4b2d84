"""Kimi K3's media processor: images and videos as the release's ``preprocessor_config.json``
(``media_proc_cfg``) describes them, for the tower of ``families/kimi_k3/vision.py``.

Images (the release's ``KimiK3VisionProcessor``, PIL and numpy):

1. the size within the budgets: scaled down (never up) so that the image has at most
   ``in_patch_limit`` patches (65536) and at most ``patch_limit_on_one_side`` (512) a side,
   sizes truncated to whole pixels; resized with PIL's bicubic filter;
2. transparency (an alpha band, or a palette / grey image with a transparent colour) composited
   onto ``transparent_bg_config``'s background (K3's: a chessboard of 8-pixel squares, white 255
   at the top left, grey 180), after the resize (``transparent_bg_fill_stage``) or before it;
   without a background config the alpha is dropped;
3. padded with zeros on the bottom and right to whole merged patches (28 pixels), scaled to
   [0, 1], normalised by mean and std (0.5), cut into 14 x 14 patches in raster order: grid
   ``(1, h, w)``.

In the prompt an image is ``<|media_begin|>image WxH<|media_content|><|media_pad|><|media_end|>``
(W x H the image's own size), its placeholder then repeated to one per merged 2 x 2 patch.

Videos (K3's settings, ``sample_fps`` 8 and ``temporal_merge_kernel_size`` 4, in the video path of
the Kimi-K2.5 processor whose media tokens K3 keeps; K3's own processor code takes images only):
``round(frames * min(sample_fps, fps) / fps)`` frames (at least one) at evenly spaced indices
(``linspace(0, frames - 1)`` rounded), in chunks of 4; the last chunk keeps what is left (1 to 4
frames, not padded, as that code does). Every frame of a chunk is resized as an image with the
per-frame budget ``in_patch_limit_each_frame`` (16384 patches); a chunk is one tower item of grid
``(frames, h, w)``, which the tower pools over time into ``h/2 * w/2`` tokens. A video is written
as its chunks, each ``HH:MM:SS.fff<|media_begin|>video<|media_content|><|media_pad|><|media_end|>``
(the time of the chunk's first frame). Video chunks and images share the one placeholder and are
media items of one stream, in the order the text names them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch

from megatron_slmoe.data.errors import DataError
from megatron_slmoe.data.native_resolution import read_processor_settings

FILL_STAGES = ("before_resize", "after_resize")
PATTERNS = {"white": 255, "black": 0, "gray": 128}
TIMESTAMP_MODES = ("hh:mm:ss.fff", "mm:ss.fff", "mm:ss")


@dataclass(frozen=True)
class Background:
    """What transparent pixels are composited onto (``transparent_bg_config``)."""

    pattern: str = "chessboard"
    square: int = 8
    white_top_left: bool = True
    white: int = 255
    gray: int = 180

    def pixels(self, height: int, width: int) -> np.ndarray:
        """uint8 [height, width, 3]."""
        if self.pattern != "chessboard":
            return np.full((height, width, 3), PATTERNS[self.pattern], dtype=np.uint8)
        rows = np.arange(height)[:, None] // self.square
        cols = np.arange(width)[None, :] // self.square
        gray = (rows + cols) % 2 == (1 if self.white_top_left else 0)
        out = np.full((height, width, 3), self.white, dtype=np.uint8)
        out[gray] = self.gray
        return out


@dataclass(frozen=True)
class KimiK3Media:
    """The release's ``media_proc_cfg`` (the defaults are its values)."""

    patch_size: int = 14
    merge_size: int = 2
    in_patch_limit: int = 65536
    side_limit: int = 512
    mean: Tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: Tuple[float, float, float] = (0.5, 0.5, 0.5)
    background: Optional[Background] = Background()
    fill_stage: str = "after_resize"
    frame_patch_limit: int = 16384
    video_patch_limit: Optional[int] = None
    max_frames: Optional[int] = None
    sample_fps: Optional[float] = 8.0
    chunk_frames: int = 4
    timestamp_mode: str = "hh:mm:ss.fff"

    @classmethod
    def from_preprocessor_config(cls, path: str) -> "KimiK3Media":
        """The settings of a checkpoint's ``preprocessor_config.json`` (``media_proc_cfg``, or
        the same keys at the top level); one DataError line naming the file and the field."""
        raw = read_processor_settings(path)
        foreign = sorted({"max_patches", "merge_size", "size"} & raw.keys())
        if "media_proc_cfg" not in raw and foreign:
            raise DataError(f"{path}: {', '.join(foreign)} are another processor's settings "
                            f"(Kimi K3's are media_proc_cfg's, as the release ships them)")
        cfg = raw.get("media_proc_cfg", raw)
        if not isinstance(cfg, dict):
            raise DataError(f"{path}: media_proc_cfg must be an object, got {cfg!r}")

        def fail(name, value, wanted):
            return DataError(f"{path}: media_proc_cfg.{name} must be {wanted}, got {value!r}")

        def integer(name, default, optional=False):
            value = cfg.get(name, default)
            if optional and value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise fail(name, value, "a positive integer" + (" or null" if optional else ""))
            return value

        if cfg.get("fixed_output_tokens") is not None:
            raise fail("fixed_output_tokens", cfg["fixed_output_tokens"],
                       "null (images are sized by the patch budgets)")
        merge = cfg.get("merge_kernel_size", 2)
        if isinstance(merge, (list, tuple)):
            if len(merge) != 2 or merge[0] != merge[1]:
                raise fail("merge_kernel_size", merge, "square")
            merge = merge[0]
        values = {}
        for ours, name in (("mean", "image_mean"), ("std", "image_std")):
            value = cfg.get(name, [0.5, 0.5, 0.5])
            if (not isinstance(value, (list, tuple)) or len(value) != 3
                    or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                               for v in value) or (ours == "std" and min(value) <= 0)):
                raise fail(name, value, "three numbers (std above 0)")
            values[ours] = tuple(float(v) for v in value)
        stage = cfg.get("transparent_bg_fill_stage", cls.fill_stage)
        if stage not in FILL_STAGES:
            raise fail("transparent_bg_fill_stage", stage, " or ".join(FILL_STAGES))
        fps = cfg.get("sample_fps")
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float))
                                or fps <= 0):
            raise fail("sample_fps", fps, "a number above 0 or absent (no videos)")
        mode = cfg.get("timestamp_mode", cls.timestamp_mode)
        if mode not in TIMESTAMP_MODES:
            raise fail("timestamp_mode", mode, " or ".join(TIMESTAMP_MODES))
        return cls(patch_size=integer("patch_size", 14), merge_size=integer("merge_kernel_size",
                                                                            merge),
                   in_patch_limit=integer("in_patch_limit", 65536),
                   side_limit=integer("patch_limit_on_one_side", 512),
                   background=_background(cfg.get("transparent_bg_config"), path),
                   fill_stage=stage,
                   frame_patch_limit=integer("in_patch_limit_each_frame", 16384, optional=True)
                   or integer("in_patch_limit", 65536),
                   video_patch_limit=integer("in_patch_limit_video", None, optional=True),
                   max_frames=integer("max_num_frames_each_video", None, optional=True),
                   sample_fps=None if fps is None else float(fps),
                   chunk_frames=integer("temporal_merge_kernel_size", 4),
                   timestamp_mode=mode, **values)


def _background(cfg, path: str) -> Optional[Background]:
    if cfg is None:
        return None
    if not isinstance(cfg, dict):
        raise DataError(f"{path}: media_proc_cfg.transparent_bg_config must be an object or "
                        f"null, got {cfg!r}")
    pattern = cfg.get("pattern", "black")
    if pattern not in (*PATTERNS, "chessboard"):
        raise DataError(f"{path}: transparent_bg_config.pattern {pattern!r} is not one of "
                        f"white, black, gray, chessboard")
    values = dict(square=cfg.get("chessboard_square_size", 16),
                  white=cfg.get("chessboard_white_value", 255),
                  gray=cfg.get("chessboard_gray_value", 200))
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or not (
                1 <= value if name == "square" else 0 <= value <= 255):
            raise DataError(f"{path}: transparent_bg_config has an unusable {name} value "
                            f"{value!r}")
    top_left = cfg.get("chessboard_square_on_top_left", True)
    if not isinstance(top_left, bool):
        raise DataError(f"{path}: transparent_bg_config.chessboard_square_on_top_left must be "
                        f"true or false")
    return Background(pattern=pattern, white_top_left=top_left, **values)


def fitted_size(width: int, height: int, patch_limit: int, media: KimiK3Media
                ) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """((new width, height), (padded width, height)) in pixels: scaled down only, to the patch
    budget and the per-side limit, padded to whole merged patches."""
    p, side = media.patch_size, media.side_limit * media.patch_size
    scale = min(1.0, math.sqrt(patch_limit / (max(1.0, width // p) * max(1.0, height // p))),
                side / width, side / height)
    new_w = min(max(1, int(width * scale)), side)
    new_h = min(max(1, int(height * scale)), side)
    factor = media.merge_size * p
    return (new_w, new_h), (-(-new_w // factor) * factor, -(-new_h // factor) * factor)


def _composited(image, background: Optional[Background]):
    """An RGB image: a transparent one composited onto the background (the alpha dropped
    without one)."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if background is None or ("A" not in image.getbands()
                              and "transparency" not in image.info):
        return image.convert("RGB")
    rgba = np.asarray(image.convert("RGBA"))
    alpha = rgba[..., 3:].astype(np.float32) / 255.0
    mixed = alpha * rgba[..., :3] + (1.0 - alpha) * background.pixels(*rgba.shape[:2])
    return Image.fromarray(mixed.astype(np.uint8))


def _patches(frames: np.ndarray, media: KimiK3Media) -> torch.Tensor:
    """[t * h * w, 3, p, p] float32 of uint8 frames [t, H, W, 3]: normalised, patched."""
    values = frames.astype(np.float32) / 255.0
    values = (values - np.asarray(media.mean, dtype=np.float32)) / np.asarray(media.std,
                                                                              dtype=np.float32)
    t, height, width, _ = values.shape
    p = media.patch_size
    values = values.reshape(t, height // p, p, width // p, p, 3).transpose(0, 1, 3, 5, 2, 4)
    return torch.from_numpy(np.ascontiguousarray(values.reshape(-1, 3, p, p)))


class KimiK3ImagePatches:
    """Images as K3's processor makes them (see the module doc); ``decodes_transparency``: the
    data path hands it the image as decoded (its alpha kept), not already made RGB."""

    decodes_transparency = True

    def __init__(self, media: KimiK3Media) -> None:
        self.media = media

    @property
    def tokens_per_merge(self) -> int:
        return self.media.merge_size ** 2

    def frame(self, image, patch_limit: int) -> np.ndarray:
        """uint8 [H, W, 3]: one image (or video frame) resized, composited and padded."""
        m = self.media
        (new_w, new_h), (pad_w, pad_h) = fitted_size(image.width, image.height, patch_limit, m)
        if m.fill_stage == "before_resize":
            image = _composited(image, m.background)
        from PIL import Image

        image = image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
        pixels = np.asarray(_composited(image, m.background))
        return np.pad(pixels, ((0, pad_h - new_h), (0, pad_w - new_w), (0, 0)))

    def patches(self, image) -> Tuple[torch.Tensor, Tuple[int, int, int]]:
        frame = self.frame(image, self.media.in_patch_limit)
        p = self.media.patch_size
        return _patches(frame[None], self.media), (1, frame.shape[0] // p, frame.shape[1] // p)

    @staticmethod
    def image_text(width: int, height: int) -> str:
        """How the prompt writes one image of ``width`` x ``height`` pixels (its own size)."""
        return (f"<|media_begin|>image {width}x{height}<|media_content|><|media_pad|>"
                f"<|media_end|>")

    def empty(self) -> torch.Tensor:
        return torch.zeros(0, 3, self.media.patch_size, self.media.patch_size)


def timestamp_text(seconds: float, mode: str) -> str:
    """A chunk's start time as the processor writes it (milliseconds truncated)."""
    whole = int(seconds)
    hours, minutes, secs = whole // 3600 % 24, whole // 60 % 60, whole % 60
    millis = f".{int((seconds % 1) * 1000):03d}"
    if mode == "hh:mm:ss.fff":
        return f"{hours:02d}:{minutes:02d}:{secs:02d}{millis}"
    return f"{minutes:02d}:{secs:02d}" + (millis if mode == "mm:ss.fff" else "")


class KimiK3VideoPatches:
    """Videos as K3's settings describe them (see the module doc). ``shares_image_placeholder``:
    the chunks are media items of the image stream (the same placeholder), in text order; each
    chunk's text holds the placeholder once, repeated to its tokens as an image's is."""

    shares_image_placeholder = True

    def __init__(self, media: KimiK3Media) -> None:
        self.media = media
        self.images = KimiK3ImagePatches(media)

    @property
    def tokens_per_merge(self) -> int:
        return self.media.merge_size ** 2

    def sample(self, total_frames: int, fps: float) -> list:
        """Indices of the frames sampled of a clip of ``total_frames`` at ``fps``."""
        rate = min(self.media.sample_fps, fps)
        count = max(round(total_frames * rate / fps), 1)
        if self.media.max_frames is not None:
            count = min(count, self.media.max_frames)
        return np.linspace(0, total_frames - 1, count).round().astype(int).tolist()

    def patches(self, clip) -> Tuple[torch.Tensor, list, list]:
        """(``pixel_values`` of every chunk [patches, 3, p, p], the chunks' grids
        ``[(frames, h, w), ...]``, each chunk's start in seconds) of a decoded clip
        (``data.video.Clip``)."""
        from PIL import Image

        m = self.media
        indices = self.sample(len(clip.frames), clip.fps)
        frames = clip.pixels(indices).permute(0, 2, 3, 1).numpy()
        limit = m.frame_patch_limit
        if m.video_patch_limit is not None:
            limit = min(round(m.video_patch_limit / len(indices)), limit)
        values, grids, starts = [], [], []
        p = m.patch_size
        for first in range(0, len(indices), m.chunk_frames):
            chunk = np.stack([self.images.frame(Image.fromarray(f), limit)
                              for f in frames[first:first + m.chunk_frames]])
            values.append(_patches(chunk, m))
            grids.append((chunk.shape[0], chunk.shape[1] // p, chunk.shape[2] // p))
            starts.append(indices[first] / clip.fps)
        return torch.cat(values), grids, starts

    def text(self, starts) -> str:
        """How the prompt writes one video: its chunks, each with its start time."""
        return "".join(f"{timestamp_text(s, self.media.timestamp_mode)}<|media_begin|>video"
                       f"<|media_content|><|media_pad|><|media_end|>" for s in starts)

    def empty(self) -> torch.Tensor:
        return self.images.empty()
