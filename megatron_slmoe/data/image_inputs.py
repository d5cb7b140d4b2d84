"""How a model takes images, for the image-text dataset (``data/image_text.py``): what an image
becomes, and how the token ids make room for it.

* :class:`TiledImages` (Megatron-Core's ``LLaVAModel``): each image cut into fixed-size tiles
  (``data/image.py``); one placeholder token per image, which the model widens to its tiles'
  embeddings. Sample tensors ``images`` [tiles, 3, H, W] and ``num_image_tiles`` [images].
* :class:`NativeResolutionImages` (a checkpoint's own tower at each image's resolution, such as
  Kimi-K2.5's MoonViT): patches of ``data/native_resolution.py``; each image written in the text
  as the model's image text (its placeholder token once), the placeholder then repeated to one
  token per merged patch, so the token ids already hold every image position, as transformers'
  processor makes them. Sample tensors ``pixel_values`` [patches, 3, p, p] and
  ``image_grid_thw`` [images, 3].

  With a video processor (a family's ``video_patches``), each ``<video>`` is written as the
  processor writes the clip (per temporal patch a timestamp and the frame's placeholders, one per
  merged patch): sample tensors ``pixel_values_videos`` [patches, ...] and ``video_grid_thw``
  [videos, 3] too (empty when a sample has no video, so every sample has the same keys). A video
  processor that ``shares_image_placeholder`` (Kimi K3's) cuts a clip into media items of the
  image stream instead (its chunks, each written with the placeholder once and repeated as an
  image's): ``pixel_values`` and ``image_grid_thw`` hold images and chunks in the order the text
  names them.

  An image processor with an ``image_text(width, height)`` writes each image with its own size
  (Kimi K3's); one that ``decodes_transparency`` gets the image with its alpha (it composites).

Both raise :class:`~megatron_slmoe.data.image.ImageDecodeError` for images that do not decode
(and :class:`~megatron_slmoe.data.video.VideoDecodeError` for clips);
:class:`NativeResolutionImages` raises :class:`ImageCountMismatch` where the rendered ids and the
images disagree (LLaVAModel checks its own). The dataset counts either as a bad record.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_slmoe.data.config import IMAGE_TOKEN, VIDEO_TOKEN
from megatron_slmoe.data.image import ImagePreprocessConfig, decode_image, preprocess_image
from megatron_slmoe.data.video import MAX_SECONDS, decode_clip

TEXT_ONLY = ("video_timestamps", "image_sizes", "media_order")
"""Sample entries that only say how the text writes the media (dropped once it is written)."""


def media_marks(messages: Sequence[Dict[str, str]]) -> List[str]:
    """The ``<image>`` and ``<video>`` marks of a conversation in text order."""
    pattern = re.compile(f"{re.escape(IMAGE_TOKEN)}|{re.escape(VIDEO_TOKEN)}")
    return [mark for m in messages for mark in pattern.findall(m["content"])]


class ImageCountMismatch(ValueError):
    """Token ids whose image placeholders do not match the sample's images."""


class ImageTokens:
    """A tokenizer whose ``encode`` turns each ``<image>`` into ``image_token_index`` (so the chat
    template of ``data/instruction.py`` places images where the text says); all else delegates."""

    def __init__(self, tokenizer, image_token_index: int):
        self._tokenizer = tokenizer
        self.image_token_index = image_token_index

    def encode(self, text: str) -> List[int]:
        ids: List[int] = []
        for i, piece in enumerate(text.split(IMAGE_TOKEN)):
            if i:
                ids.append(self.image_token_index)
            if piece:
                ids += self._tokenizer.encode(piece)
        return ids

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


class TiledImages:
    """LLaVAModel's image input (see the module doc)."""

    def __init__(self, preprocess: ImagePreprocessConfig, image_token_index: int,
                 tokens_per_tile: int):
        self.preprocess = preprocess
        self.image_token_index = image_token_index
        self.tokens_per_tile = int(tokens_per_tile)

    def tokenizer(self, tokenizer):
        """The tokenizer the conversation is rendered with."""
        return ImageTokens(tokenizer, self.image_token_index)

    def messages(self, messages: List[Dict[str, str]],
                 pixels: Optional[Dict[str, torch.Tensor]] = None) -> List[Dict[str, str]]:
        """The conversation as rendered: ``<image>`` marks stay (the tokenizer places them)."""
        return messages

    def pixels(self, images: Sequence[bytes], videos: Sequence[bytes] = (),
               order: Sequence[str] = ()) -> Dict[str, torch.Tensor]:
        if videos:
            raise ImageCountMismatch(f"the sample has {len(videos)} video(s); LLaVAModel takes "
                                     f"no videos")
        tiles = [preprocess_image(decode_image(data), self.preprocess) for data in images]
        cfg = self.preprocess
        return {"images": torch.cat(tiles) if tiles else torch.zeros(0, 3, cfg.img_h, cfg.img_w),
                "num_image_tiles": torch.tensor([t.shape[0] for t in tiles], dtype=torch.int32)}

    def expand(self, ids: List[int], targets: List[int], pixels: Dict[str, torch.Tensor]
               ) -> Tuple[List[int], List[int]]:
        """Token ids with room for the images: unchanged (the model widens each placeholder)."""
        return ids, targets

    def positions(self, num_inputs: int, pixels: Dict[str, torch.Tensor]) -> int:
        """Sequence positions of ``num_inputs`` input ids once the model has placed the images:
        each placeholder widens to its tiles' positions."""
        counts = pixels["num_image_tiles"]
        return num_inputs + int((counts * self.tokens_per_tile - 1).sum())


class NativeResolutionImages:
    """A native-resolution tower's image input (see the module doc). ``image_text``: how the model
    writes one image in its text, holding the placeholder token ``image_token`` (id
    ``image_token_id``) once."""

    def __init__(self, config, image_token: str, image_token_id: int,
                 image_text: str, videos=None, video_token_id: Optional[int] = None,
                 max_video_seconds: float = MAX_SECONDS):
        if image_text.count(image_token) != 1:
            raise ValueError(f"image text {image_text!r} must hold {image_token!r} once")
        self.config = config
        self.image_token_id = int(image_token_id)
        self.image_text = image_text
        self.videos = videos  # the family's video processor; None: no video input
        self.video_token_id = video_token_id
        self.max_video_seconds = max_video_seconds

    def tokenizer(self, tokenizer):
        return tokenizer

    def messages(self, messages: List[Dict[str, str]],
                 pixels: Optional[Dict[str, torch.Tensor]] = None) -> List[Dict[str, str]]:
        """The conversation as rendered: each ``<image>`` written as the model's image text, each
        ``<video>`` as the video processor writes that clip (its grid and timestamps in
        ``pixels``, in order)."""
        texts = iter(self.video_texts(pixels) if pixels is not None and self.videos else ())
        sized = pixels is not None and "image_sizes" in pixels
        images = iter([self.config.image_text(w, h) for w, h in pixels["image_sizes"].tolist()]
                      if sized else ())

        def written(content: str) -> str:
            parts = content.split(IMAGE_TOKEN)
            content = parts[0] + "".join((next(images, IMAGE_TOKEN) if sized else
                                          self.image_text) + p for p in parts[1:])
            parts = content.split(VIDEO_TOKEN)
            return parts[0] + "".join(next(texts, VIDEO_TOKEN) + p for p in parts[1:])

        return [{**m, "content": written(m["content"])} for m in messages]

    def video_texts(self, pixels: Dict[str, torch.Tensor]) -> List[str]:
        if self._shared:  # per video its chunks' start times, ahead of the images' items
            if "media_order" not in pixels:
                return []
            order, starts = pixels["media_order"].tolist(), pixels["video_timestamps"].tolist()
            texts = []
            for chunks in order:
                if chunks:
                    texts.append(self.videos.text(starts[:chunks]))
                    starts = starts[chunks:]
            return texts
        times = pixels["video_timestamps"].tolist()
        texts = []
        for grid in pixels["video_grid_thw"].tolist():
            texts.append(self.videos.text(grid, times[:grid[0]]))
            times = times[grid[0]:]
        return texts

    @property
    def _shared(self) -> bool:
        return getattr(self.videos, "shares_image_placeholder", False)

    def pixels(self, images: Sequence[bytes], videos: Sequence[bytes] = (),
               order: Sequence[str] = ()) -> Dict[str, torch.Tensor]:
        """The sample's tensors; ``order``: the media marks (``IMAGE_TOKEN`` / ``VIDEO_TOKEN``)
        in text order, which a video processor sharing the image placeholder needs."""
        patches, grids, sizes = [], [], []
        rgb = not getattr(self.config, "decodes_transparency", False)
        for data in images:
            image = decode_image(data, rgb=rgb)
            values, grid = self.config.patches(image)
            patches.append(values)
            grids.append(grid)
            sizes.append(image.size)
        if self._shared and videos:
            return self._media_stream(patches, grids, sizes, videos, order)
        out = {"pixel_values": torch.cat(patches) if patches else self.config.empty(),
               "image_grid_thw": torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)}
        if hasattr(self.config, "image_text"):
            out["image_sizes"] = torch.tensor(sizes, dtype=torch.int64).reshape(-1, 2)
        if self._shared:
            return out
        if self.videos is None:
            if videos:
                raise ImageCountMismatch(f"the sample has {len(videos)} video(s); this model "
                                         f"takes no videos (its checkpoint has no video "
                                         f"processor settings)")
            return out
        patches, grids, times = [], [], []
        for data in videos:
            values, grid, stamps = self.videos.patches(decode_clip(data, self.max_video_seconds))
            patches.append(values)
            grids.append(grid)
            times += stamps
        out.update(pixel_values_videos=torch.cat(patches) if patches else self.videos.empty(),
                   video_grid_thw=torch.tensor(grids, dtype=torch.int64).reshape(-1, 3),
                   video_timestamps=torch.tensor(times, dtype=torch.float64))
        return out

    def _media_stream(self, patches, grids, sizes, videos, order) -> Dict[str, torch.Tensor]:
        """Images and video chunks as one stream of media items in text order (a video
        processor sharing the image placeholder); ``media_order`` [marks]: 0 for an image, a
        video's chunk count for a video."""
        marks = list(order)
        if sorted(marks) != sorted([IMAGE_TOKEN] * len(patches) + [VIDEO_TOKEN] * len(videos)):
            raise ImageCountMismatch(f"the text marks {marks.count(IMAGE_TOKEN)} image(s) and "
                                     f"{marks.count(VIDEO_TOKEN)} video(s) for "
                                     f"{len(patches)} image(s) and {len(videos)} video(s)")
        images, clips = iter(zip(patches, grids)), iter(videos)
        values, items, counts, starts = [], [], [], []
        for mark in marks:
            if mark == IMAGE_TOKEN:
                pixels, grid = next(images)
                values.append(pixels)
                items.append(grid)
                counts.append(0)
                continue
            pixels, chunks, times = self.videos.patches(
                decode_clip(next(clips), self.max_video_seconds))
            values.append(pixels)
            items += chunks
            counts.append(len(chunks))
            starts += times
        return {"pixel_values": torch.cat(values),
                "image_grid_thw": torch.tensor(items, dtype=torch.int64).reshape(-1, 3),
                "image_sizes": torch.tensor(sizes, dtype=torch.int64).reshape(-1, 2),
                "media_order": torch.tensor(counts, dtype=torch.int64),
                "video_timestamps": torch.tensor(starts, dtype=torch.float64)}

    def expand(self, ids: List[int], targets: List[int], pixels: Dict[str, torch.Tensor]
               ) -> Tuple[List[int], List[int]]:
        """Each placeholder repeated to its image's tokens (one per merged patch), never a
        target."""
        # An item's frames are pooled into one frame's tokens (a video chunk; an image has one).
        tokens = (pixels["image_grid_thw"][:, 1:].prod(-1) // self.config.tokens_per_merge
                  ).tolist()
        found = ids.count(self.image_token_id)
        if found != len(tokens):
            raise ImageCountMismatch(f"the rendered text holds {found} image placeholder(s) "
                                     f"(id {self.image_token_id}) for {len(tokens)} image(s)")
        if self.videos is not None and not self._shared:  # its text holds every video token
            wanted = int((pixels["video_grid_thw"].prod(-1) // self.videos.tokens_per_merge).sum())
            found = ids.count(self.video_token_id)
            if found != wanted:
                raise ImageCountMismatch(f"the rendered text holds {found} video placeholder(s) "
                                         f"(id {self.video_token_id}) where its videos take "
                                         f"{wanted}")
        out_ids: List[int] = []
        out_targets: List[int] = []
        images = iter(tokens)
        for token, target in zip(ids, targets):
            if token == self.image_token_id:
                n = next(images)
                out_ids += [token] * n
                out_targets += [0] * n
            else:
                out_ids.append(token)
                out_targets.append(target)
        return out_ids, out_targets

    def positions(self, num_inputs: int, pixels: Dict[str, torch.Tensor]) -> int:
        """The ids already hold every image position."""
        return num_inputs
