"""Batched autoregressive generation with Megatron-Core's GPTModel, in any parallel layout.

Megatron-Core does the model work: its ``StaticInferenceContext`` is the KV cache that GPTModel's
attention fills during the prefill and reads at each decode step, and its pipeline helpers
(``recv_from_prev_pipeline_rank_`` / ``send_to_next_pipeline_rank``) move activations between
stages. What this module adds is the loop around one forward step:

* prompts of different lengths share a batch the way Megatron's static controller does it: the
  batch is right-padded, the prefill runs up to the shortest prompt, and each decode step feeds
  the next prompt token to the rows still inside their prompt and the sampled token to the others.
  So no row ever feeds a pad before its prompt ends, which a recurrent layer needs (Kimi K3's KDA
  keeps a state per row in the same context, ``model.kda_attention``: a pad in front of a prompt
  would enter that state, where attention would only have masked it); what a finished row is
  fed afterwards is never read;
* a model whose stages hand over more than hidden states (Attention Residuals' stream: the
  running sum and the bank on the sequence dimension) receives that many slots per position;
* the last pipeline stage samples (``megatron_slmoe.inference.sampling``) and broadcasts the new
  tokens to the other stages;
* expert parallelism makes every forward step a collective over the EP group, whose ranks may hold
  other prompts (they are other data-parallel replicas): all ranks agree on the number of batches
  and the KV-cache length, and keep stepping until every rank's rows are finished;
* sequence parallelism (on whenever TP > 1 in training) cannot split a one-token decode step:
  it is switched off for the duration and the model is put in eval mode; every switch is restored
  to what it was afterwards, so the training model itself can generate in the middle of a run;
* a multimodal model takes prompts with images: Megatron-Core's ``LLaVAModel`` turns each image
  placeholder token into its tiles' embeddings in the prefill, a checkpoint's own tower
  (``model.tower_language.TowerLanguageModel``) writes its image embeddings over the
  placeholders the prompt already holds one per image token; either way the images enter the KV
  cache with the prefill and decode steps feed text alone, to the language model. Prompts share
  a batch when their images take the same number of positions and lie inside the prefill.

``use_kv_cache=False`` recomputes the whole sequence at every step, without an inference context:
the reference the KV-cached path is tested against.

Collective: every rank calls ``generate``; ranks of one model replica (the same data-parallel
rank) must pass the same prompts.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from megatron.core import parallel_state
from megatron.core.inference.communication_utils import (
    recv_from_prev_pipeline_rank_,
    send_to_next_pipeline_rank,
)
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.utils import get_attr_wrapped_model, unwrap_model

from megatron_slmoe.compat.megatron import llava_padded_length
from megatron_slmoe.model.attention_residuals import pipeline_seq_length
from megatron_slmoe.model.tower_language import TowerLanguageModel
from megatron_slmoe.inference.sampling import SamplingConfig, prompt_generator, sample_next_tokens

GREEDY = SamplingConfig()


@dataclass(frozen=True)
class _Row:
    """One prompt as the loop sees it: its token ids and, for a multimodal model, its images
    (LLaVA's tiles [tiles, 3, H, W] and tiles per image, or a tower's patches and their grids
    ``image_grid_thw``), and how many positions its images add to the sequence."""

    tokens: list
    images: Any = None
    num_image_tiles: Any = None
    extra_positions: int = 0
    image_grid_thw: Any = None
    last_image_at: int = -1
    videos: Any = None  # a tower's video patches and their grids (None: no videos)
    video_grid_thw: Any = None


class TextGenerator:
    """Generates token continuations with one model chunk of this rank (a GPTModel or a
    LLaVAModel, possibly wrapped in Megatron's DDP / Float16Module).

    ``eos_id``: generation of a prompt stops after this token (it is not returned).
    ``vocab_size``: tokens at or above it (the model's vocabulary padding) are never chosen.
    ``max_batch_size``: prompts per forward pass on this rank.
    """

    def __init__(self, model: torch.nn.Module, eos_id: int, vocab_size: Optional[int] = None,
                 max_batch_size: int = 64, use_kv_cache: bool = True) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.module = unwrap_model(model)
        # A multimodal model's language model is the one whose layout and cache matter.
        self.llava = hasattr(self.module, "img_seq_len")
        self.tower = isinstance(self.module, TowerLanguageModel)
        self.multimodal = self.llava or self.tower
        self.language = self.module.language_model if self.multimodal else self.module
        self.config = self.language.config
        self.eos_id = int(eos_id)
        self.vocab_size = vocab_size
        self.max_batch_size = int(max_batch_size)
        self.use_kv_cache = bool(use_kv_cache)
        self.device = next(self.module.parameters()).device
        self.first_stage = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
        self.last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        # What one stage hands the next per position: a hidden state, or an Attention-Residual
        # model's stream (the running sum and the bank's slots, stacked on the sequence).
        self.stream_slots = pipeline_seq_length(self.language, 1)

    # -- public ----------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Any], max_new_tokens: Union[int, Sequence[int]],
                 sampling: SamplingConfig = GREEDY,
                 prompt_indices: Optional[Sequence[int]] = None) -> list[list[int]]:
        """The generated tokens of each prompt (without the prompt and without ``eos_id``).

        A prompt is a sequence of token ids or, for a multimodal model, an object with ``tokens``
        (image placeholders where images go), ``images`` and ``num_image_tiles`` (LLaVAModel's
        tiles) or ``image_grid_thw`` (a tower's patches; one placeholder per image token), and
        for a tower that takes videos ``videos`` with ``video_grid_thw`` too.
        ``max_new_tokens``: one limit for all prompts, or one per prompt. ``prompt_indices``: the
        prompts' global indices, which seed their sampling generators (default 0..n-1)."""
        count = len(prompts)
        limits = ([int(max_new_tokens)] * count if isinstance(max_new_tokens, int)
                  else [int(m) for m in max_new_tokens])
        indices = list(range(count)) if prompt_indices is None else list(prompt_indices)
        if len(limits) != count or len(indices) != count:
            raise ValueError("max_new_tokens and prompt_indices need one entry per prompt")
        rows = [self._row(p) for p in prompts]
        if any(not r.tokens for r in rows):
            raise ValueError("every prompt needs at least one token")
        batches = self._batches(rows)
        outputs: list[list[int]] = [[] for _ in range(count)]
        with self._inference_mode():
            for number in range(_global_max(len(batches), self.device)):
                members = batches[number] if number < len(batches) else []
                if members:
                    result = self._generate_batch([rows[i] for i in members],
                                                  [limits[i] for i in members], sampling,
                                                  [indices[i] for i in members])
                else:  # nothing left here, but the EP peers still need this rank's steps
                    result = self._generate_batch([_Row([self.eos_id])], [0], sampling, [0])
                for i, tokens in zip(members, result):
                    outputs[i] = tokens
        return outputs

    def _row(self, prompt: Any) -> _Row:
        if not hasattr(prompt, "tokens"):
            return _Row(list(prompt))
        if not self.multimodal:
            raise ValueError("prompts with images need a multimodal model")
        tokens = list(prompt.tokens)
        if self.tower:
            media = {self.module.image_token_id, self.module.video_token_id}
            at = [i for i, t in enumerate(tokens) if t in media]
            grids = getattr(prompt, "video_grid_thw", None)
            has_videos = grids is not None and grids.shape[0] > 0
            return _Row(tokens, prompt.images, last_image_at=at[-1] if at else -1,
                        image_grid_thw=prompt.image_grid_thw,
                        videos=prompt.videos if has_videos else None,
                        video_grid_thw=grids if has_videos else None)
        placeholder = self.module.image_token_index
        at = [i for i, t in enumerate(tokens) if t == placeholder]
        tiles = prompt.num_image_tiles
        if len(at) != len(tiles):
            raise ValueError(f"a prompt has {len(at)} image placeholders and {len(tiles)} images")
        extra = int(tiles.sum()) * self.module.img_seq_len - len(at)
        return _Row(tokens, prompt.images, tiles, extra, at[-1] if at else -1)

    def _batches(self, rows: list[_Row]) -> list[list[int]]:
        """Prompts of similar length share a batch (fewer padded decode steps); with images,
        only those whose images add the same positions and fall inside every member's prefill
        (the shortest member's length)."""
        order = sorted(range(len(rows)), key=lambda i: (rows[i].extra_positions,
                                                         len(rows[i].tokens)))
        batches: list[list[int]] = []
        for i in order:
            batch = batches[-1] if batches else None
            if (batch is not None and len(batch) < self.max_batch_size
                    and rows[batch[0]].extra_positions == rows[i].extra_positions
                    and (rows[batch[0]].images is None) == (rows[i].images is None)
                    and max(rows[j].last_image_at for j in batch + [i])
                    < min(len(rows[j].tokens) for j in batch + [i])):
                batch.append(i)
            else:
                batches.append([i])
        return batches

    @contextmanager
    def _inference_mode(self) -> Iterator[None]:
        was_training = self.module.training
        self.module.eval()
        saved = _sequence_parallel_off(self.module) if self.config.sequence_parallel else []
        try:
            with torch.no_grad():
                yield
        finally:
            for owner, name, value in saved:  # each back to what it was (not all to True)
                setattr(owner, name, value)
            self.module.train(was_training)

    def _generate_batch(self, rows: list[_Row], limits: list[int], sampling: SamplingConfig,
                        indices: list[int]) -> list[list[int]]:
        batch = len(rows)
        extra = rows[0].extra_positions  # the same for every row of a batch
        prompt_len_B = torch.tensor([len(r.tokens) for r in rows], device=self.device)
        stop_at_B = prompt_len_B + torch.tensor(limits, device=self.device)
        # Every rank takes as many steps as the EP peer that needs the most (one forward each),
        # and sizes its batch and KV cache for that.
        start_at = int(prompt_len_B.min())
        total = start_at + _global_max(int(stop_at_B.max()) - start_at, self.device)
        tokens_BS = torch.full((batch, total), self.eos_id, dtype=torch.long, device=self.device)
        for row, prompt in enumerate(rows):
            tokens_BS[row, :len(prompt.tokens)] = torch.tensor(prompt.tokens, dtype=torch.long)
        images = None
        if rows[0].images is not None:
            per_image = "image_grid_thw" if self.tower else "num_image_tiles"
            images = (torch.cat([r.images for r in rows]).to(self.device),
                      torch.cat([getattr(r, per_image) for r in rows]).to(self.device))
            with_videos = [r for r in rows if r.videos is not None]
            if with_videos:  # a tower's videos beside its images
                images += (torch.cat([r.videos for r in with_videos]).to(self.device),
                           torch.cat([r.video_grid_thw for r in with_videos]).to(self.device))
        done_B = stop_at_B <= prompt_len_B  # a limit of 0 new tokens
        generators = [] if sampling.greedy else [prompt_generator(sampling.seed, i) for i in indices]
        context = StaticInferenceContext(batch, total + extra) if self.use_kv_cache else None

        rope_3BS = self._rope_positions(rows, total)
        done_upto, position = 0, start_at
        while position < total:
            start = done_upto if context is not None else 0
            if rope_3BS is not None:  # the whole prefix: Megatron slices this step's part
                positions_BS = rope_3BS[:, :, :position]
            else:
                positions_BS = torch.arange(start, position, device=self.device).expand(batch, -1)
            # The images go in with the first forward of the sequence (every forward without a
            # cache); with a cache, later steps read them from it.
            with_images = images if start == 0 else None
            added = extra if with_images is not None else 0
            logits_BV = self._forward(tokens_BS[:, start:position], positions_BS, context,
                                      with_images, position - start + added)
            if context is not None:
                context.increment_sequence_len_offset(position - start + added)
                context.enable_decode_mode()
            writing_B = (position >= prompt_len_B) & ~done_B
            next_B = self._next_tokens(logits_BV, sampling, generators, writing_B)
            tokens_BS[writing_B, position] = next_B[writing_B]
            done_B |= writing_B & ((next_B == self.eos_id) | (position + 1 >= stop_at_B))
            done_upto, position = position, position + 1
            if not _global_any(~done_B, self.device):
                break

        outputs = []
        for row, prompt in enumerate(rows):
            generated = tokens_BS[row, len(prompt.tokens):int(stop_at_B[row])].tolist()
            if self.eos_id in generated:
                generated = generated[:generated.index(self.eos_id)]
            outputs.append(generated)
        return outputs

    def _rope_positions(self, rows: list[_Row], total: int) -> Optional[torch.Tensor]:
        """[3, B, total] rotary positions of a model with multimodal ones (Qwen3-VL's M-RoPE,
        ``TowerLanguageModel.positions``): each prompt's from its ids and image grids, the
        generated tokens' one after another from the prompt's largest, on every axis (as
        transformers' generate continues them); None for plain positions."""
        positions = getattr(self.module, "positions", None) if self.tower else None
        if positions is None:
            return None
        rope = torch.empty(3, len(rows), total, dtype=torch.long, device=self.device)
        for row, prompt in enumerate(rows):
            tokens = torch.tensor([prompt.tokens], dtype=torch.long, device=self.device)
            grid = (None if prompt.image_grid_thw is None
                    else prompt.image_grid_thw.to(self.device))
            if prompt.video_grid_thw is None:
                prompt_rope = positions(tokens, grid)[:, 0]  # [3, prompt length]
            else:
                prompt_rope = positions(tokens, grid, prompt.video_grid_thw.to(self.device))[:, 0]
            after = torch.arange(total - len(prompt.tokens), device=self.device)
            rope[:, row, :len(prompt.tokens)] = prompt_rope
            rope[:, row, len(prompt.tokens):] = int(prompt_rope.max()) + 1 + after
        return rope

    def _forward(self, tokens_BS: torch.Tensor, positions_BS: torch.Tensor,
                 context: Optional[StaticInferenceContext], images, length: int
                 ) -> Optional[torch.Tensor]:
        """One forward step of this pipeline stage over ``length`` sequence positions (the
        tokens, images expanded); the last stage returns the logits of the last position [B, V]
        (fp32), the others None."""
        batch = tokens_BS.shape[0]
        sent = length
        if (images is not None and context is None
                and parallel_state.get_pipeline_model_parallel_world_size() > 1):
            # Without a cache, a pipeline-parallel LLaVAModel pads the sequence between stages.
            sent = max(length, llava_padded_length(self.module))
        received = None
        if not self.first_stage:
            received = torch.empty((sent * self.stream_slots, batch, self.config.hidden_size),
                                   dtype=_pipeline_dtype(self.config), device=self.device)
            recv_from_prev_pipeline_rank_(received)
        if images is not None and self.tower:  # image embeddings over the placeholders
            get_attr_wrapped_model(self.model, "set_input_tensor")(received)
            videos = ({"pixel_values_videos": images[2], "video_grid_thw": images[3]}
                      if len(images) > 2 else {})
            output = self.module(tokens_BS, positions_BS, None, pixel_values=images[0],
                                 image_grid_thw=images[1], inference_context=context,
                                 runtime_gather_output=True, **videos)
        elif images is not None:  # the multimodal model expands the images into the sequence
            get_attr_wrapped_model(self.model, "set_input_tensor")(received)
            output, _ = self.module(images[0], tokens_BS, positions_BS, None,
                                    inference_context=context, num_image_tiles=images[1],
                                    runtime_gather_output=True)
        else:  # text alone (a decode step reads the images from the cache): the language model
            # LLaVAModel's own path for cached steps returns batch-major embeddings where its
            # language model wants sequence-major ones (megatron-core 0.16 decodes one prompt at
            # a time); the language model on its own embeds text as LLaVAModel would.
            self.language.set_input_tensor(received)
            output = self.language(tokens_BS, positions_BS, None, inference_context=context,
                                   runtime_gather_output=True)
        if not self.last_stage:
            send_to_next_pipeline_rank(output.to(_pipeline_dtype(self.config)).contiguous())
            return None
        # The last position before any padding (with a cache Megatron keeps only that one).
        logits_BV = output[:, min(length, output.shape[1]) - 1, :].float()
        return logits_BV[:, :self.vocab_size] if self.vocab_size else logits_BV

    def _next_tokens(self, logits_BV: Optional[torch.Tensor], sampling: SamplingConfig,
                     generators: list[torch.Generator], writing_B: torch.Tensor) -> torch.Tensor:
        """The last stage samples (drawing only for the rows that generate now); every stage
        receives its choice."""
        if self.last_stage:
            next_B = sample_next_tokens(logits_BV, sampling, generators, writing_B)
        else:
            next_B = torch.empty(len(writing_B), dtype=torch.long, device=self.device)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            torch.distributed.broadcast(next_B, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                        group=parallel_state.get_pipeline_model_parallel_group())
        return next_B


_SEQUENCE_PARALLEL_ATTRS = ("sequence_parallel", "scatter_to_sequence_parallel",
                            "reduce_scatter_embeddings", "sequence_parallel_lm")
"""Where Megatron-Core's modules keep the sequence-parallel switch (LLaVAModel: its own copy)."""


def _sequence_parallel_off(module: torch.nn.Module) -> list[tuple[object, str, bool]]:
    """Switch sequence parallelism off in ``module`` (a one-token decode step cannot be split
    over the sequence); returns (owner, attribute, value) to restore. Megatron's own
    ``set_model_to_sequence_parallel`` restores every switch to True, which turns on the
    embedding scatter that LLaVAModel keeps off in its language model."""
    saved, configs = [], {}
    for sub in module.modules():
        for name in _SEQUENCE_PARALLEL_ATTRS:
            value = sub.__dict__.get(name)
            if isinstance(value, bool):
                saved.append((sub, name, value))
                setattr(sub, name, False)
        config = getattr(sub, "config", None)
        if config is not None and isinstance(getattr(config, "sequence_parallel", None), bool):
            configs[id(config)] = config
    for config in configs.values():
        saved.append((config, "sequence_parallel", config.sequence_parallel))
        config.sequence_parallel = False
    return saved


def _pipeline_dtype(config) -> torch.dtype:
    return config.pipeline_dtype or config.params_dtype


def _global_max(value: int, device: torch.device) -> int:
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return value
    tensor = torch.tensor([value], dtype=torch.long, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return int(tensor.item())


def _global_any(flags_B: torch.Tensor, device: torch.device) -> bool:
    return _global_max(int(flags_B.any()), device) > 0
