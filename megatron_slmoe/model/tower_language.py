"""An image-text model whose vision side is a module from elsewhere (a transformers vision tower
and projector) and whose language model is our Megatron-Core GPTModel.

Used where Megatron-Core has no faithful build of a checkpoint's tower (``LLaVAModel`` takes
CLIP, SigLIP, InternViT and RADIO towers; Kimi-K2.5's MoonViT is none of them, see
``families.kimi_k25.vision``). The vision module maps ``(pixel_values, image_grid_thw)`` to one language-width
embedding per image token ``[N, hidden]`` (and gives ``blank_image(device)``, the smallest input
it takes, run when a micro-batch has no image but the tower trains); it lives on the first
pipeline stage, replicated over tensor, expert and data parallelism (a tower of a few hundred
million parameters beside a language model of a trillion gains nothing from sharding).

Forward on the first stage: the text embedding of every token (image tokens embedded as id 0,
as transformers does), the image embeddings written over the image tokens in the token order of
the batch (row after row), then, under sequence parallelism, the sequence scattered over the TP
ranks; the language model runs on these embeddings. The positions are the text positions
(Kimi-K2.5 gives image tokens plain 1D positions). Later stages run the language model alone.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule

from megatron_slmoe.utils.errors import InputError


class ImageTokenMismatch(InputError, ValueError):
    """A batch whose image tokens do not match its images' embeddings; the message is one line."""


class TowerLanguageModel(MegatronModule):
    """``language_model``: this stage's GPTModel, built with
    ``scatter_embedding_sequence_parallel=False`` (the image embeddings are written in before the
    scatter). ``vision``: the vision module on the first stage, None elsewhere; its DeepStack
    features (``deepstack_layers`` of them) go to the outputs of the first decoder layers."""

    def __init__(self, language_model, vision: Optional[torch.nn.Module], image_token_id: int,
                 positions: Optional[Callable] = None, deepstack_layers: int = 0,
                 video_token_id: Optional[int] = None):
        super().__init__(config=language_model.config)
        self.language_model = language_model
        self.vision = vision
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id  # None: a model without video input
        # (input_ids, image_grid_thw[, video_grid_thw]) -> the rotary positions
        self.positions = positions
        # DeepStack (a vision module that returns per-layer features too): added to the outputs
        # of the first decoder layers at the image positions, for one forward at a time.
        self._deepstack: list = []
        deepstack = deepstack_layers
        if deepstack > len(language_model.decoder.layers):
            raise ValueError(f"the tower's DeepStack features go to the first {deepstack} "
                             f"decoder layers; the first pipeline stage has "
                             f"{len(language_model.decoder.layers)}")
        for index in range(deepstack):
            layer = language_model.decoder.layers[index]
            layer.register_forward_hook(partial(self._add_deepstack, index))
        self.model_type = language_model.model_type  # read by Megatron's schedules
        self.pre_process = language_model.pre_process
        self.post_process = language_model.post_process
        self.share_embeddings_and_output_weights = (
            language_model.share_embeddings_and_output_weights)

    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
              pixel_values: Optional[torch.Tensor] = None,
              image_grid_thw: Optional[torch.Tensor] = None,
              pixel_values_videos: Optional[torch.Tensor] = None,
              video_grid_thw: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The first stage's input embeddings ``[S, B, hidden]`` (this rank's part of the
        sequence under sequence parallelism). Videos go through the same vision module as
        images (their patches and grids), their features written over the video tokens."""
        image = input_ids == self.image_token_id
        video = (input_ids == self.video_token_id if self.video_token_id is not None
                 else torch.zeros_like(image))
        text_ids = input_ids.masked_fill(image | video, 0)
        embeddings = self.language_model.embedding(input_ids=text_ids, position_ids=position_ids)
        self._deepstack = []
        took_media = False
        for what, token_id, mask, pixels, grids in (
                ("image", self.image_token_id, image, pixel_values, image_grid_thw),
                ("video", self.video_token_id, video, pixel_values_videos, video_grid_thw)):
            if pixels is not None and pixels.shape[0] == 0:
                pixels = None  # a micro-batch without this medium
            if pixels is not None:
                embeddings = self._write_features(embeddings, mask, pixels, grids, what)
                took_media = True
            elif mask.any():
                raise ImageTokenMismatch(
                    f"the batch has {int(mask.sum())} {what} tokens (id {token_id}) and no "
                    f"{what}s: text data must not contain the model's {what} placeholder")
        if not took_media and self.training and any(p.requires_grad
                                                    for p in self.vision.parameters()):
            # A trained tower stays in the graph (its gradients zero) when no image came:
            # Megatron's DDP waits for a gradient of every trained parameter.
            blank = self.vision(*self.vision.blank_image(embeddings.device))
            blank, deepstack = blank if isinstance(blank, tuple) else (blank, [])
            total = blank.sum() + sum(d.sum() for d in deepstack)  # every merger trained too
            embeddings = embeddings + 0.0 * total.to(embeddings.dtype)
        if self.config.sequence_parallel:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
            self._deepstack = [tensor_parallel.scatter_to_sequence_parallel_region(d)
                               for d in self._deepstack]
        return embeddings

    def _write_features(self, embeddings: torch.Tensor, mask: torch.Tensor,
                        pixels: torch.Tensor, grids: torch.Tensor, what: str) -> torch.Tensor:
        """``embeddings`` with the vision module's features of ``pixels`` over the positions of
        ``mask``; their DeepStack features added to this forward's (images and videos take
        different positions, so the sum is transformers' joint DeepStack input)."""
        dtype = next(self.vision.parameters()).dtype  # the data pipeline's are float32
        features = self.vision(pixels.to(dtype), grids)
        features, deepstack = features if isinstance(features, tuple) else (features, [])
        wanted = int(mask.sum())
        if features.shape[0] != wanted:
            raise ImageTokenMismatch(f"the batch has {wanted} {what} tokens, its {what}s "
                                     f"{features.shape[0]} embeddings")
        placed = [self._at_image_positions(torch.zeros_like(embeddings), mask, f)
                  for f in deepstack]
        self._deepstack = ([a + b for a, b in zip(self._deepstack, placed)] if self._deepstack
                           else placed)
        return self._at_image_positions(embeddings, mask, features)

    @staticmethod
    def _at_image_positions(embeddings: torch.Tensor, image: torch.Tensor,
                            features: torch.Tensor) -> torch.Tensor:
        """``embeddings`` [S, B, h] with ``features`` written over the image positions (``image``
        [B, S]) in the token order of the batch (row after row)."""
        batch_first = embeddings.transpose(0, 1)
        batch_first = batch_first.masked_scatter(image.unsqueeze(-1),
                                                 features.to(embeddings.dtype))
        return batch_first.transpose(0, 1).contiguous()

    def _add_deepstack(self, index: int, module, args, output):
        if index >= len(self._deepstack):
            return output
        hidden, *rest = output if isinstance(output, tuple) else (output,)
        hidden = hidden + self._deepstack[index]
        return (hidden, *rest) if isinstance(output, tuple) else hidden

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None,
                pixel_values: Optional[torch.Tensor] = None,
                image_grid_thw: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None,
                pixel_values_videos: Optional[torch.Tensor] = None,
                video_grid_thw: Optional[torch.Tensor] = None, **kwargs):
        decoder_input = None
        if self.positions is not None and (position_ids is None or position_ids.dim() == 2):
            # from the text positions
            position_ids = (self.positions(input_ids, image_grid_thw) if video_grid_thw is None
                            else self.positions(input_ids, image_grid_thw, video_grid_thw))
        self._deepstack = []
        try:
            if self.pre_process:
                decoder_input = self.embed(input_ids, position_ids, pixel_values, image_grid_thw,
                                           pixel_values_videos, video_grid_thw)
            return self.language_model(input_ids, position_ids, attention_mask,
                                       decoder_input=decoder_input, labels=labels, **kwargs)
        finally:
            self._deepstack = []

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None):
        """The language model's tensors under ``language_model.`` (sharded as Megatron shards
        them), the vision module's under ``vision.`` (whole on every rank)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.language_model.sharded_state_dict(f"{prefix}language_model.",
                                                       sharded_offsets, metadata)
        if self.vision is not None:
            vision = self.vision.state_dict(prefix=f"{prefix}vision.", keep_vars=True)
            state.update(make_sharded_tensors_for_checkpoint(vision, ""))
        return state
