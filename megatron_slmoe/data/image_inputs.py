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

Both raise :class:`~megatron_slmoe.data.image.ImageDecodeError` for images that do not decode;
:class:`NativeResolutionImages` raises :class:`ImageCountMismatch` where the rendered ids and the
images disagree (LLaVAModel checks its own). The dataset counts either as a bad record.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from megatron_slmoe.data.config import IMAGE_TOKEN
from megatron_slmoe.data.image import ImagePreprocessConfig, decode_image, preprocess_image
from megatron_slmoe.data.native_resolution import NativeResolutionConfig


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

    def messages(self, messages: List[Dict[str, str]]) -> List[Dict[str, str]]:
        """The conversation as rendered: ``<image>`` marks stay (the tokenizer places them)."""
        return messages

    def pixels(self, images: Sequence[bytes]) -> Dict[str, torch.Tensor]:
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
                 image_text: str):
        if image_text.count(image_token) != 1:
            raise ValueError(f"image text {image_text!r} must hold {image_token!r} once")
        self.config = config
        self.image_token_id = int(image_token_id)
        self.image_text = image_text

    def tokenizer(self, tokenizer):
        return tokenizer

    def messages(self, messages: List[Dict[str, str]]) -> List[Dict[str, str]]:
        """The conversation as rendered: each ``<image>`` written as the model's image text."""
        return [{**m, "content": m["content"].replace(IMAGE_TOKEN, self.image_text)}
                for m in messages]

    def pixels(self, images: Sequence[bytes]) -> Dict[str, torch.Tensor]:
        patches, grids = [], []
        for data in images:
            values, grid = self.config.patches(decode_image(data))
            patches.append(values)
            grids.append(grid)
        return {"pixel_values": torch.cat(patches) if patches else self.config.empty(),
                "image_grid_thw": torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)}

    def expand(self, ids: List[int], targets: List[int], pixels: Dict[str, torch.Tensor]
               ) -> Tuple[List[int], List[int]]:
        """Each placeholder repeated to its image's tokens (one per merged patch), never a
        target."""
        tokens = (pixels["image_grid_thw"].prod(-1) // self.config.tokens_per_merge).tolist()
        found = ids.count(self.image_token_id)
        if found != len(tokens):
            raise ImageCountMismatch(f"the rendered text holds {found} image placeholder(s) "
                                     f"(id {self.image_token_id}) for {len(tokens)} image(s)")
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
