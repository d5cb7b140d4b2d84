"""The reference for multimodal generation: greedy decoding through Megatron-Core's forward-only
training schedule, recomputing the whole (text + images) sequence at every step over fixed-shape
micro-batches, with no inference context. ``inference.TextGenerator`` (KV cache, images in the
cache) is tested against it; it was the image-text task's own generation loop before there was
one generation path."""

from __future__ import annotations

from functools import partial
from typing import List, Optional, Sequence

import torch


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def combined_positions(tokens_BT: torch.Tensor, num_image_tiles: torch.Tensor,
                       image_token_index: int, tokens_per_tile: int) -> torch.Tensor:
    """[b, T] index in the combined (text + image) sequence of every text position, as LLaVAModel
    lays it out: an image placeholder becomes ``tiles * tokens_per_tile`` positions."""
    is_image = tokens_BT == image_token_index
    widths = torch.ones_like(tokens_BT)
    widths[is_image] = num_image_tiles.to(tokens_BT.dtype) * tokens_per_tile
    return torch.cumsum(widths, dim=1) - widths  # start of each text position


def _prompt_batch(prompts: Sequence, generated: Sequence[List[int]],
                  seq_length: int, pad_id: int) -> dict:
    tokens = torch.full((len(prompts), seq_length), pad_id, dtype=torch.int64)
    last = torch.zeros(len(prompts), dtype=torch.int64)
    for i, (prompt, new) in enumerate(zip(prompts, generated)):
        ids = (prompt.tokens + new)[:seq_length]
        tokens[i, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
        last[i] = len(ids) - 1
    return {"tokens": tokens, "last": last,
            "images": torch.cat([p.images for p in prompts]),
            "num_image_tiles": torch.cat([p.num_image_tiles for p in prompts])}


def _next_token_step(device, image_token_index: int, tokens_per_tile: int, data_iterator, model):
    batch = _to(next(data_iterator), device)
    logits, _ = model(batch["images"], batch["tokens"], None, None,
                      num_image_tiles=batch["num_image_tiles"], runtime_gather_output=True)

    def next_tokens(output: torch.Tensor, non_loss_data: bool = False):
        # output: [b, S, V] logits gathered over tensor parallelism (last stage only)
        starts = combined_positions(batch["tokens"], batch["num_image_tiles"], image_token_index,
                                    tokens_per_tile)
        rows = torch.arange(output.shape[0], device=output.device)
        at = starts[rows, batch["last"]].clamp(max=output.shape[1] - 1)
        return output[rows, at].float().argmax(dim=-1)

    return logits, next_tokens


def greedy_generate(model, prompts: Sequence, *, max_new_tokens: int,
                    seq_length: int, micro_batch_size: int, pad_id: int, eos_id: int,
                    image_token_index: int, tokens_per_tile: int, device: torch.device,
                    num_prompts_per_rank: Optional[int] = None) -> List[List[int]]:
    """Greedy continuations of this data-parallel rank's ``prompts`` (up to and excluding
    ``eos_id``), computed with Megatron's forward-only schedule on every rank of the model.

    ``num_prompts_per_rank`` (default: ``len(prompts)``, which must then be equal on every data-
    parallel rank) pads this rank's share by repeating its last prompt, so all ranks run the same
    micro-batches; padded answers are dropped.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not prompts:
        raise ValueError("greedy_generate: no prompts on this rank")
    count = num_prompts_per_rank or len(prompts)
    count += -count % micro_batch_size
    padded = list(prompts) + [prompts[-1]] * (count - len(prompts))
    generated: List[List[int]] = [[] for _ in padded]
    finished = [False] * len(padded)
    step_fn = partial(_next_token_step, device, image_token_index, tokens_per_tile)
    last_stage = parallel_state.is_pipeline_last_stage()
    for _ in range(max_new_tokens):
        microbatches = [_prompt_batch(padded[i:i + micro_batch_size],
                                      generated[i:i + micro_batch_size], seq_length, pad_id)
                        for i in range(0, count, micro_batch_size)]
        outputs = get_forward_backward_func()(
            forward_step_func=step_fn, data_iterator=iter(microbatches), model=model,
            num_microbatches=len(microbatches), seq_length=seq_length,
            micro_batch_size=micro_batch_size, forward_only=True, collect_non_loss_data=True)
        next_ids = (torch.cat(outputs).to(device) if last_stage
                    else torch.zeros(count, dtype=torch.int64, device=device))
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            torch.distributed.broadcast(next_ids, parallel_state.get_pipeline_model_parallel_last_rank(),
                                        group=parallel_state.get_pipeline_model_parallel_group())
        for i, token in enumerate(next_ids.tolist()):
            if not finished[i]:
                if token == eos_id:
                    finished[i] = True
                else:
                    generated[i].append(token)
    return generated[:len(prompts)]
