"""A plain Kimi K3 media processor, written from the description of the release's processor
(``KimiK3VisionProcessor``, its ``media_utils``, and the Kimi-K2.5 video path whose chunk prompt
K3 keeps), step by step with PIL and Python loops; nothing shared with the package.

Settings are a dict in the release's ``media_proc_cfg`` names."""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image

RELEASE = {"in_patch_limit": 65536, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5],
           "image_std": [0.5, 0.5, 0.5], "merge_kernel_size": 2, "fixed_output_tokens": None,
           "patch_limit_on_one_side": 512, "in_patch_limit_each_frame": 16384,
           "sample_fps": 8.0, "temporal_merge_kernel_size": 4,
           "transparent_bg_config": {"pattern": "chessboard", "chessboard_square_size": 8,
                                     "chessboard_square_on_top_left": True,
                                     "chessboard_white_value": 255,
                                     "chessboard_gray_value": 180},
           "transparent_bg_fill_stage": "after_resize"}
"""The release's ``media_proc_cfg``."""


def plan(width, height, cfg, limit):
    """(new_w, new_h, pad_w, pad_h): scale = min(1, sqrt(limit / patches), side / w, side / h),
    sizes truncated, padding to whole merged patches."""
    p, side = cfg["patch_size"], cfg["patch_limit_on_one_side"]
    patches = max(1.0, width // p) * max(1.0, height // p)
    scale = min(1.0, math.sqrt(limit / patches), side * p / width, side * p / height)
    new_w = min(max(1, int(width * scale)), side * p)
    new_h = min(max(1, int(height * scale)), side * p)
    f = cfg["merge_kernel_size"] * p
    return new_w, new_h, (f - new_w % f) % f, (f - new_h % f) % f


def fill(image, cfg):
    """The image on the configured background, as RGB (alpha dropped without one)."""
    bg = cfg.get("transparent_bg_config")
    if bg is None or image.mode == "RGB":
        return image.convert("RGB")
    if "A" not in image.getbands() and "transparency" not in image.info:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    out = Image.new("RGB", rgba.size)
    square = bg.get("chessboard_square_size", 16)
    for y in range(rgba.height):
        for x in range(rgba.width):
            if bg.get("pattern", "black") == "chessboard":
                odd = (y // square + x // square) % 2 == 1
                gray = odd if bg.get("chessboard_square_on_top_left", True) else not odd
                value = bg.get("chessboard_gray_value", 200) if gray else \
                    bg.get("chessboard_white_value", 255)
            else:
                value = {"white": 255, "black": 0, "gray": 128}[bg["pattern"]]
            r, g, b, a = rgba.getpixel((x, y))
            alpha = np.float32(a) / np.float32(255.0)
            out.putpixel((x, y), tuple(int(alpha * c + (np.float32(1.0) - alpha) * value)
                                       for c in (r, g, b)))
    return out


def frame(image, cfg, limit):
    """uint8 [H, W, 3]: resized (PIL bicubic), background filled, zero-padded."""
    new_w, new_h, pad_w, pad_h = plan(image.width, image.height, cfg, limit)
    if cfg.get("transparent_bg_fill_stage", "after_resize") == "before_resize":
        image = fill(image, cfg)
    image = fill(image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC), cfg)
    out = np.zeros((new_h + pad_h, new_w + pad_w, 3), dtype=np.uint8)
    out[:new_h, :new_w] = np.asarray(image)
    return out


def patchify(frames, cfg):
    """(pixel_values [t * h * w, 3, p, p], (t, h, w)) of uint8 frames [t, H, W, 3]."""
    p = cfg["patch_size"]
    mean, std = cfg["image_mean"], cfg["image_std"]
    t, height, width = len(frames), frames[0].shape[0], frames[0].shape[1]
    patches = []
    for f in frames:
        x = f.astype(np.float32) / np.float32(255.0)
        x = np.stack([(x[..., c] - np.float32(mean[c])) * np.float32(1.0 / std[c])
                      for c in range(3)])
        for r in range(height // p):
            for c in range(width // p):
                patches.append(x[:, r * p:(r + 1) * p, c * p:(c + 1) * p])
    return torch.from_numpy(np.stack(patches)), (t, height // p, width // p)


def image(img, cfg=RELEASE):
    """(pixel_values, grid, prompt text with one pad per merged patch) of one image."""
    values, grid = patchify([frame(img, cfg, cfg["in_patch_limit"])], cfg)
    pads = grid[1] * grid[2] // cfg["merge_kernel_size"] ** 2
    text = (f"<|media_begin|>image {img.width}x{img.height}<|media_content|>"
            + "<|media_pad|>" * pads + "<|media_end|>")
    return values, grid, text


def video(frames, fps, cfg=RELEASE):
    """(pixel_values, chunk grids, prompt text) of a clip's RGB frames (uint8 [H, W, 3])."""
    rate = min(cfg["sample_fps"], fps)
    count = max(round(len(frames) * rate / fps), 1)
    picks = [int(v) for v in np.linspace(0, len(frames) - 1, count).round()]
    size = cfg["temporal_merge_kernel_size"]
    values, grids, text = [], [], ""
    for start in range(0, len(picks), size):
        chunk = [frame(Image.fromarray(frames[i]), cfg, cfg["in_patch_limit_each_frame"])
                 for i in picks[start:start + size]]
        v, grid = patchify(chunk, cfg)
        values.append(v)
        grids.append(grid)
        seconds = picks[start] / fps
        stamp = "%02d:%02d:%02d.%03d" % (int(seconds) // 3600, int(seconds) // 60 % 60,
                                         int(seconds) % 60, int((seconds % 1) * 1000))
        pads = grid[1] * grid[2] // cfg["merge_kernel_size"] ** 2
        text += (f"{stamp}<|media_begin|>video<|media_content|>" + "<|media_pad|>" * pads
                 + "<|media_end|>")
    return torch.cat(values), grids, text
