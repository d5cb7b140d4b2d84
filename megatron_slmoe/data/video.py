"""Video clips decoded with PyAV (FFmpeg's libraries in a wheel: no torchvision, no ffmpeg
binary), for a family's video processor (``Family.video_patches``), which samples the frames.

``decode_clip(data, max_seconds)`` turns an encoded clip (MP4, WebM, MKV, ... whatever FFmpeg
reads) into a :class:`Clip`: its frames in presentation order and its frame rate. A clip that
cannot be used raises :class:`VideoDecodeError` with one line saying why: zero-length bytes, not
a video (or corrupt), a codec this FFmpeg cannot decode, no video stream, no frames, longer than
``max_seconds``, frames of different sizes, no frame rate. The dataset counts it as a bad record.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import List, Sequence

import torch

MAX_SECONDS = 600.0
"""The longest clip taken by default (10 minutes): longer ones are refused before they are
decoded to the end, as a sample too large to prepare."""


class VideoDecodeError(ValueError):
    """Bytes that do not give a usable clip; the message is one line."""


@dataclass
class Clip:
    """A decoded clip: ``frames`` (PyAV video frames, converted to pixels only when sampled) and
    ``fps``, the stream's average frame rate."""

    frames: list
    fps: float

    @property
    def height(self) -> int:
        return self.frames[0].height

    @property
    def width(self) -> int:
        return self.frames[0].width

    def pixels(self, indices: Sequence[int]) -> torch.Tensor:
        """uint8 ``[len(indices), 3, height, width]``: the RGB frames at ``indices``."""
        import numpy as np

        rgb: List = [self.frames[int(i)].to_ndarray(format="rgb24") for i in indices]
        return torch.from_numpy(np.stack(rgb)).permute(0, 3, 1, 2).contiguous()


def decode_clip(data: bytes, max_seconds: float = MAX_SECONDS) -> Clip:
    """Every frame of an encoded clip (see the module doc); VideoDecodeError when unusable."""
    import av

    if not data:
        raise VideoDecodeError("zero-length clip")
    try:
        with av.open(io.BytesIO(bytes(data)), mode="r") as container:
            if not container.streams.video:
                raise VideoDecodeError("no video stream in the clip")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            if not rate or float(rate) <= 0:
                raise VideoDecodeError("the clip's video stream has no frame rate")
            fps = float(rate)
            frames = []
            for frame in container.decode(stream):
                if len(frames) / fps > max_seconds:
                    raise VideoDecodeError(f"the clip is longer than the limit of "
                                           f"{max_seconds:g} s")
                frames.append(frame)
    except VideoDecodeError:
        raise
    except av.error.DecoderNotFoundError as err:
        raise VideoDecodeError(f"unsupported codec ({_line(err)})") from None
    except (av.error.FFmpegError, ValueError, RuntimeError, OSError) as err:
        raise VideoDecodeError(f"not a decodable video ({_line(err)})") from None
    if not frames:
        raise VideoDecodeError("the clip has no frames")
    sizes = {(f.width, f.height) for f in frames}
    if len(sizes) > 1:
        raise VideoDecodeError(f"the clip's frames have different sizes "
                               f"({', '.join(f'{w}x{h}' for w, h in sorted(sizes))})")
    return Clip(frames, fps)


def _line(err: Exception) -> str:
    return " ".join(str(err).split())[:200] or type(err).__name__
