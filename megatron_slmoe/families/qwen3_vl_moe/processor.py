"""Qwen3-VL-MoE's image patches (Qwen2-VL's image processor, which its checkpoints name) and
video patches (Qwen3-VL's video processor)."""

from __future__ import annotations

from typing import Tuple

import torch

from megatron_slmoe.data.errors import DataError
from megatron_slmoe.data.image import ImageDecodeError
from megatron_slmoe.data.native_resolution import read_processor_settings
from megatron_slmoe.data.video import VideoDecodeError


class Qwen2VLPatches:
    """Images as Qwen2-VL's image processor makes them (Qwen3-VL-MoE's checkpoints name it), by
    transformers' own PIL implementation of it (``Qwen2VLImageProcessorPil``, which needs no
    torchvision) with the checkpoint's settings: resized within the pixel budget to a multiple
    of ``patch_size * merge_size`` a side, each frame repeated over ``temporal_patch_size``,
    flattened patches ``[patches, channels * temporal * patch * patch]`` in merge order."""

    def __init__(self, processor) -> None:
        self.processor = processor

    @classmethod
    def from_preprocessor_config(cls, path: str) -> "Qwen2VLPatches":
        """One DataError line naming the file when it is missing, unreadable or refused."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        raw = read_processor_settings(path)
        kind = raw.get("image_processor_type", "")
        if not kind.startswith("Qwen2VLImageProcessor"):
            raise DataError(f"{path}: image_processor_type {kind!r} is not Qwen2-VL's (the "
                            f"checkpoint's config.json names a Qwen3-VL model)")
        try:
            return cls(Qwen2VLImageProcessorPil.from_dict(raw))
        except (TypeError, ValueError) as err:
            raise DataError(f"{path}: {' '.join(str(err).split())}") from None

    @property
    def tokens_per_merge(self) -> int:
        return self.processor.merge_size ** 2

    def patches(self, image) -> Tuple[torch.Tensor, Tuple[int, int, int]]:
        try:
            out = self.processor(images=[image], return_tensors="pt")
        except ValueError as err:  # e.g. an aspect ratio over 200: a bad sample, counted
            raise ImageDecodeError(f"Qwen2-VL's image processor refuses the {image.width}x"
                                   f"{image.height} image: {' '.join(str(err).split())}") from None
        return out["pixel_values"].float(), tuple(int(v) for v in out["image_grid_thw"][0])

    def empty(self) -> torch.Tensor:
        p = self.processor
        return torch.zeros(0, 3 * p.temporal_patch_size * p.patch_size ** 2)


class Qwen3VLVideoPatches:
    """Videos as Qwen3-VL's video processor makes them (``video_preprocessor_config.json``),
    with its settings and its own frame sampling and patch layout (transformers'
    ``Qwen3VLVideoProcessor.sample_frames`` and ``patchify``, which need no torchvision): frames
    sampled at ``fps`` (within ``min_frames`` .. ``max_frames``), resized together within the
    video's pixel budget (``smart_resize``) to a multiple of ``patch_size * merge_size`` a side
    (bicubic, antialiased, on the uint8 frames, as its torchvision resize does), normalised,
    then ``temporal_patch_size`` frames per temporal patch (the last repeated to fill one). The
    text of a video is the processor's: per temporal patch its timestamp ``<t seconds>`` (the
    mean time of its frames, one decimal) and the frame's ``<|vision_start|>``, one
    ``<|video_pad|>`` per merged patch, ``<|vision_end|>``."""

    vision_start, video_token, vision_end = "<|vision_start|>", "<|video_pad|>", "<|vision_end|>"

    def __init__(self, processor) -> None:
        self.processor = processor

    @classmethod
    def from_preprocessor_config(cls, path: str) -> "Qwen3VLVideoPatches":
        """One DataError line naming the file when it is missing, unreadable or refused."""
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        raw = read_processor_settings(path)
        kind = raw.get("video_processor_type", "")
        if not kind.startswith("Qwen3VLVideoProcessor"):
            raise DataError(f"{path}: video_processor_type {kind!r} is not Qwen3-VL's")
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_sample_frames"):
            if raw.get(flag, True) is not True:
                raise DataError(f"{path}: {flag}={raw[flag]!r} is not supported (clips are "
                                f"sampled, resized, rescaled and normalised)")
        if raw.get("resample", 3) != 3:
            raise DataError(f"{path}: resample={raw['resample']!r} is not supported (bicubic, 3)")
        if raw.get("num_frames") is not None:
            raise DataError(f"{path}: num_frames is not supported (frames are sampled at fps)")
        try:
            return cls(Qwen3VLVideoProcessor(**{k: v for k, v in raw.items()
                                                if k != "video_processor_type"}))
        except (TypeError, ValueError) as err:
            raise DataError(f"{path}: {' '.join(str(err).split())}") from None

    @property
    def tokens_per_merge(self) -> int:
        return self.processor.merge_size ** 2

    def sample(self, total_frames: int, fps: float) -> list[int]:
        """Indices of the frames the processor samples of a clip."""
        from transformers.video_utils import VideoMetadata

        metadata = VideoMetadata(total_num_frames=total_frames, fps=fps)
        return [int(i) for i in self.processor.sample_frames(metadata)]

    def resized_size(self, frames: int, height: int, width: int) -> Tuple[int, int]:
        """(height, width) the processor resizes ``frames`` frames of a clip to."""
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        p = self.processor
        factor, size = p.patch_size * p.merge_size, p.size
        max_pixels = size["longest_edge"]
        if p.cap_pixels_per_frame:
            per_frame = max(min(p.max_video_tokens * factor * factor,
                                size["longest_edge"] // frames), int(size["shortest_edge"] * 1.05))
            max_pixels = per_frame * frames
        return smart_resize(num_frames=frames, height=height, width=width,
                            temporal_factor=p.temporal_patch_size, factor=factor,
                            min_pixels=size["shortest_edge"], max_pixels=max_pixels)

    def patches(self, clip) -> Tuple[torch.Tensor, Tuple[int, int, int], list]:
        """(``pixel_values_videos`` [patches, C * T * P * P], grid ``(t, h, w)``, the timestamps
        in seconds of the ``t`` temporal patches) of a decoded clip (``data.video.Clip``); a
        VideoDecodeError line when the processor refuses it."""
        p = self.processor
        indices = self.sample(len(clip.frames), clip.fps)
        try:
            height, width = self.resized_size(len(indices), clip.height, clip.width)
        except ValueError as err:  # fewer frames than a temporal patch, aspect ratio over 200
            raise VideoDecodeError(f"Qwen3-VL's video processor refuses the {clip.width}x"
                                   f"{clip.height} clip of {len(indices)} sampled frame(s): "
                                   f"{' '.join(str(err).split())}") from None
        frames = clip.pixels(indices)
        if (height, width) != tuple(frames.shape[-2:]):
            frames = torch.nn.functional.interpolate(frames, size=(height, width), mode="bicubic",
                                                     align_corners=False, antialias=True)
        # The processor's fused rescale + normalise: mean and std scaled by 1 / rescale_factor.
        mean = (torch.tensor(p.image_mean) * (1.0 / p.rescale_factor)).view(-1, 1, 1)
        std = (torch.tensor(p.image_std) * (1.0 / p.rescale_factor)).view(-1, 1, 1)
        values = frames.to(torch.float32).sub_(mean).div_(std)
        flat, grid_t, grid_h, grid_w = p.patchify(values.unsqueeze(0), patch_size=p.patch_size,
                                                  merge_size=p.merge_size,
                                                  temporal_patch_size=p.temporal_patch_size)
        return flat[0], (grid_t, grid_h, grid_w), self.timestamps(indices, clip.fps)

    def timestamps(self, indices, fps: float) -> list:
        """The time of each temporal patch: the mean of its first and last frame's (the last
        frame repeated to fill the last patch)."""
        group = self.processor.temporal_patch_size
        times = [i / fps for i in indices]
        times += times[-1:] * (-len(times) % group)
        return [(times[i] + times[i + group - 1]) / 2 for i in range(0, len(times), group)]

    def text(self, grid, timestamps) -> str:
        """How the processor writes one video in the prompt."""
        per_frame = int(grid[1]) * int(grid[2]) // self.tokens_per_merge
        return "".join(f"<{t:.1f} seconds>{self.vision_start}{self.video_token * per_frame}"
                       f"{self.vision_end}" for t in timestamps[:int(grid[0])])

    def empty(self) -> torch.Tensor:
        p = self.processor
        return torch.zeros(0, 3 * p.temporal_patch_size * p.patch_size ** 2)
