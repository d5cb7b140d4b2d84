"""Images at their own resolution, cut into patches: the input of a NaViT-style tower such as
Kimi-K2.5's MoonViT, made as transformers' ``Kimi_K25ImageProcessor`` makes it (that processor
runs on torchvision; this is torch alone, and ``tests/unit/test_native_resolution.py`` holds it to
the processor's recorded output).

One image becomes:

1. its size within the budgets: scaled down (never up) so that it has at most ``max_patches``
   patches and at most ``max_side_patches`` patches per side, sizes truncated to whole pixels;
2. resized to that size (bicubic, antialiased, on the uint8 pixels), then padded with zeros on
   the bottom and right to a multiple of ``patch_size * merge_size``;
3. scaled and normalised per channel: ``(x - 255 mean) / (255 std)``;
4. cut into ``patch_size`` squares in raster order: ``pixel_values`` [h * w, 3, p, p] and its grid
   ``(1, h, w)`` in patches. The tower merges ``merge_size`` x ``merge_size`` patches into one
   language token, so the image takes ``h * w / merge_size**2`` placeholder tokens.

The settings are the checkpoint's ``preprocessor_config.json`` (``from_preprocessor_config``), in
either layout: transformers' (``patch_size``, ``merge_size``, ``max_patches``, ``size.max_height``,
``image_mean``, ``image_std``) or the published checkpoints' (under ``media_proc_cfg``:
``patch_size``, ``merge_kernel_size``, ``in_patch_limit``, ``patch_limit_on_one_side``,
``image_mean``, ``image_std``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Tuple

import torch

from megatron_slmoe.data.errors import DataError

IMAGENET_STANDARD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class NativeResolutionConfig:
    """How images become patches (the defaults are Kimi-K2.5's processor's)."""

    patch_size: int = 14
    merge_size: int = 2
    max_patches: int = 16384
    max_side_patches: int = 512
    mean: Tuple[float, float, float] = IMAGENET_STANDARD
    std: Tuple[float, float, float] = IMAGENET_STANDARD
    rescale_factor: float = 1 / 255

    @classmethod
    def from_preprocessor_config(cls, path: str) -> "NativeResolutionConfig":
        """The settings of a checkpoint's ``preprocessor_config.json``; one DataError line naming
        the file and the field when it is unreadable or a value is unusable."""
        raw = read_processor_settings(path)
        if "media_proc_cfg" in raw:
            raw = _from_published(raw["media_proc_cfg"], path)
        elif not {"patch_size", "merge_size", "max_patches", "size"} & raw.keys():
            raise DataError(f"{path}: neither transformers' image processor settings (patch_size, "
                            f"merge_size, max_patches, size) nor the published media_proc_cfg")
        size = raw.get("size") or {}
        if not isinstance(size, dict):
            raise DataError(f"{path}: size must be an object, got {size!r}")
        if size.get("max_height") != size.get("max_width"):
            raise DataError(f"{path}: size.max_height and size.max_width differ ({size}); the "
                            f"processor takes one limit per side")
        defaults = cls()
        values = dict(patch_size=raw.get("patch_size", defaults.patch_size),
                      merge_size=raw.get("merge_size", defaults.merge_size),
                      max_patches=raw.get("max_patches", defaults.max_patches),
                      max_side_patches=size.get("max_height", defaults.max_side_patches))
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DataError(f"{path}: {name} must be a positive integer, got {value!r}")
        for name, default in (("image_mean", defaults.mean), ("image_std", defaults.std)):
            value = raw.get(name, default)
            if (not isinstance(value, (list, tuple)) or len(value) != 3
                    or not all(isinstance(v, (int, float)) for v in value)
                    or (name == "image_std" and not all(v > 0 for v in value))):
                raise DataError(f"{path}: {name} must be three numbers (std above 0), "
                                f"got {value!r}")
            values["mean" if name == "image_mean" else "std"] = tuple(float(v) for v in value)
        rescale = raw.get("rescale_factor", defaults.rescale_factor)
        if not isinstance(rescale, (int, float)) or rescale <= 0:
            raise DataError(f"{path}: rescale_factor must be a number above 0, got {rescale!r}")
        for flag, wanted in (("do_resize", True), ("do_rescale", True), ("do_normalize", True)):
            if raw.get(flag, wanted) is not wanted:
                raise DataError(f"{path}: {flag}={raw[flag]!r} is not supported (the tower's "
                                f"patches are resized, rescaled and normalised)")
        if raw.get("resample", 3) != 3:
            raise DataError(f"{path}: resample={raw['resample']!r} is not supported (bicubic, 3)")
        return cls(rescale_factor=float(rescale), **values)

    @property
    def tokens_per_merge(self) -> int:
        """Patches that become one language token."""
        return self.merge_size ** 2

    def patches(self, image) -> Tuple[torch.Tensor, Tuple[int, int, int]]:
        return image_patches(image, self)

    def empty(self) -> torch.Tensor:
        """``pixel_values`` of no image."""
        return torch.zeros(0, 3, self.patch_size, self.patch_size)


def check_fits_tower(path: str, **settings: Tuple[int, int]) -> None:
    """One DataError line when a setting of the image processor ``path`` is not the tower's
    (``settings``: name -> (the processor's, the tower's, from config.json)): its patches would
    not fit the tower, failing inside it or training on wrongly cut images."""
    for name, (processor, tower) in settings.items():
        if processor != tower:
            raise DataError(f"{path}: {name} {processor} does not fit the checkpoint's tower "
                            f"({name} {tower} in config.json's vision_config): use the image "
                            f"processor settings the checkpoint was published with")


def read_processor_settings(path: str) -> dict:
    """A checkpoint's ``preprocessor_config.json``; one DataError line naming the file when it
    is missing or not a JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise DataError(f"{path}: missing (the image processor's settings; a multimodal "
                        f"checkpoint ships it)") from None
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(raw, dict):
        raise DataError(f"{path}: not a JSON object")
    return raw


def _from_published(cfg, path: str) -> dict:
    """The published checkpoints' ``media_proc_cfg`` in transformers' names."""
    if not isinstance(cfg, dict):
        raise DataError(f"{path}: media_proc_cfg must be an object, got {cfg!r}")
    if cfg.get("fixed_output_tokens") is not None:
        raise DataError(f"{path}: media_proc_cfg.fixed_output_tokens="
                        f"{cfg['fixed_output_tokens']!r} is not supported (images are sized by "
                        f"the patch budgets)")
    merge = cfg.get("merge_kernel_size", 2)
    if isinstance(merge, (list, tuple)):
        if len(merge) != 2 or merge[0] != merge[1]:
            raise DataError(f"{path}: media_proc_cfg.merge_kernel_size must be square, "
                            f"got {merge!r}")
        merge = merge[0]
    names = {"patch_size": "patch_size", "in_patch_limit": "max_patches",
             "image_mean": "image_mean", "image_std": "image_std"}
    out = {ours: cfg[theirs] for theirs, ours in names.items() if theirs in cfg}
    out["merge_size"] = merge
    if "patch_limit_on_one_side" in cfg:
        side = cfg["patch_limit_on_one_side"]
        out["size"] = {"max_height": side, "max_width": side}
    return out


def fitted_size(height: int, width: int, config: NativeResolutionConfig
                ) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """((resized height, width), (padded height, width)) of an image, in pixels: the processor's
    rule (scale down only, to the total and per-side patch budgets; pad to whole merged
    patches)."""
    patch = config.patch_size
    patches = max(1.0, height // patch) * max(1.0, width // patch)
    side = config.max_side_patches * patch
    scale = min(1.0, math.sqrt(config.max_patches / patches), side / height, side / width)
    new_h = min(max(1, int(height * scale)), side)
    new_w = min(max(1, int(width * scale)), side)
    factor = config.merge_size * patch
    return (new_h, new_w), (-(-new_h // factor) * factor, -(-new_w // factor) * factor)


def image_patches(image, config: NativeResolutionConfig
                  ) -> Tuple[torch.Tensor, Tuple[int, int, int]]:
    """(``pixel_values`` float32 [h * w, 3, p, p], grid ``(1, h, w)``) of an RGB ``PIL.Image``."""
    import numpy as np

    pixels = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).unsqueeze(0)
    height, width = pixels.shape[-2:]
    (new_h, new_w), (pad_h, pad_w) = fitted_size(height, width, config)
    if (new_h, new_w) != (height, width):
        # uint8 in, uint8 out: the CPU kernel rounds as torchvision's resize does.
        pixels = torch.nn.functional.interpolate(pixels.contiguous(), size=(new_h, new_w),
                                                 mode="bicubic", align_corners=False,
                                                 antialias=True)
    pixels = torch.nn.functional.pad(pixels, (0, pad_w - new_w, 0, pad_h - new_h))
    # The processor's fused rescale + normalise: mean and std scaled by 1 / rescale_factor.
    mean = (torch.tensor(config.mean) * (1.0 / config.rescale_factor)).view(-1, 1, 1)
    std = (torch.tensor(config.std) * (1.0 / config.rescale_factor)).view(-1, 1, 1)
    values = pixels.to(torch.float32).sub_(mean).div_(std)
    patch = config.patch_size
    grid_h, grid_w = pad_h // patch, pad_w // patch
    values = values.reshape(1, 3, grid_h, patch, grid_w, patch).permute(0, 2, 4, 1, 3, 5)
    return values.reshape(grid_h * grid_w, 3, patch, patch).contiguous(), (1, grid_h, grid_w)
