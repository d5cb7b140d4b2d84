"""Image-text steps on Megatron-Core's schedules: the forward step of the multimodal model, greedy
answer generation and exact-match accuracy (function level; the trainer wires them in).

A micro-batch is what :func:`megatron_slmoe.data.image_text.collate_image_text` makes: ``tokens``,
``labels``, ``loss_mask`` [b, S] in text positions with ``image_token_index`` where images go,
``images`` [tiles, 3, H, W] and ``num_image_tiles`` [images] of the whole micro-batch. LLaVAModel
expands each image placeholder to its tiles' embeddings and cuts or pads the combined sequence to
the model's sequence length S, so every layout sees the same [S, b] shapes.

Generation (:func:`greedy_generate`) runs the forward-only schedule once per new token over
fixed-shape micro-batches (no KV cache: answers are a few tokens), reads the next token at each
sample's last position on the last pipeline stage, and broadcasts it to the other stages. Every
data-parallel rank runs the same number of steps and micro-batches (expert parallelism exchanges
tokens between them), padding its share of prompts where needed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import Iterable, List, Optional, Sequence

import torch

from megatron_slmoe.data.image import ImagePreprocessConfig


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def forward_step(device: torch.device, data_iterator, model):
    """Megatron ``forward_step_func`` for image-text micro-batches (bind ``device`` with partial):
    the model's per-token loss and the masked-mean loss function over the combined sequence."""
    from megatron_slmoe.training.finetune import _masked_mean_loss

    batch = _to(next(data_iterator), device)
    output, loss_mask = model(batch["images"], batch["tokens"], None, None,
                              labels=batch["labels"], loss_mask=batch["loss_mask"],
                              num_image_tiles=batch["num_image_tiles"])
    return output, partial(_masked_mean_loss, loss_mask)


def combined_positions(tokens_BT: torch.Tensor, num_image_tiles: torch.Tensor,
                       image_token_index: int, tokens_per_tile: int) -> torch.Tensor:
    """[b, T] index in the combined (text + image) sequence of every text position, as LLaVAModel
    lays it out: an image placeholder becomes ``tiles * tokens_per_tile`` positions."""
    is_image = tokens_BT == image_token_index
    widths = torch.ones_like(tokens_BT)
    widths[is_image] = num_image_tiles.to(tokens_BT.dtype) * tokens_per_tile
    return torch.cumsum(widths, dim=1) - widths  # start of each text position


@dataclass
class GenerationPrompt:
    """One prompt to answer: ``tokens`` (ids with image placeholders, ending in the assistant
    role token), its ``images`` [tiles, 3, H, W] and ``num_image_tiles`` [images]."""

    tokens: List[int]
    images: torch.Tensor
    num_image_tiles: torch.Tensor


def _prompt_batch(prompts: Sequence[GenerationPrompt], generated: Sequence[List[int]],
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


def greedy_generate(model, prompts: Sequence[GenerationPrompt], *, max_new_tokens: int,
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


def exact_match_accuracy(answers: Iterable[str], references: Iterable[str]) -> tuple[int, int]:
    """(correct, total) of answers equal to their references after stripping whitespace."""
    pairs = list(zip(answers, references, strict=True))
    return sum(a.strip() == r.strip() for a, r in pairs), len(pairs)


def all_reduce_counts(correct: int, total: int, device: torch.device) -> tuple[int, int]:
    """Sum (correct, total) over the data-parallel ranks."""
    from megatron.core import parallel_state

    counts = torch.tensor([correct, total], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(counts, group=parallel_state.get_data_parallel_group())
    return int(counts[0]), int(counts[1])



# --- the image-text task of a run ------------------------------------------------------------------


def preprocess_config(vision, image_text) -> ImagePreprocessConfig:
    """How a run's images become tower input (the ``vision`` and ``image_text`` sections)."""
    return ImagePreprocessConfig(img_h=vision.img_h, img_w=vision.img_w,
                                 max_tiles=image_text.max_tiles, thumbnail=image_text.thumbnail,
                                 mean=tuple(image_text.image_mean), std=tuple(image_text.image_std))


class ImageTextTask:
    """What the trainer needs for ``--task image-text``: the multimodal model, the energon
    datasets (the shapes task by default), micro-batch collation, the forward step, and the
    held-out answer accuracy. It reads the run's ``data``, ``vision`` and ``image_text``
    sections (and the schedule's batch sizes)."""

    def __init__(self, run) -> None:
        self.run = run
        self.vision, self.settings = run.vision, run.image_text

    def build_model(self, model_config, config, pre_process: bool, post_process: bool):
        """This rank's multimodal model, its vision tower frozen in a full fine-tune unless
        ``--train-vision-tower``."""
        from megatron_slmoe.model.multimodal import build_multimodal_model

        model = build_multimodal_model(model_config, config, self.vision,
                                       seq_length=self.run.data.seq_length,
                                       pre_process=pre_process, post_process=post_process)
        if self.run.model.finetune_mode == "full" and not self.settings.train_vision_tower:
            model.freeze(freeze_language_model=False, freeze_vision_model=True,
                         freeze_vision_projection=False)
        return model

    def load_vision_tower(self, model) -> None:
        """The tower's weights from ``--vision-checkpoint`` (after the base weights), if given;
        a pipeline stage without the tower has nothing to load."""
        if self.vision.checkpoint:
            from megatron_slmoe.model.hf_vision import load_hf_vision_tower

            load_hf_vision_tower(model, self.vision.checkpoint, self.vision)

    def _paths(self, output_dir: str) -> tuple[str, str]:
        """(train dataset, held-out dataset): the flags', else the shapes task made on first use
        in the run's folder (captions for ``--data-format pretrain``, else questions)."""
        from megatron_slmoe.data.shapes import ensure_shapes_task

        data = self.run.data
        if data.train_data:
            return data.train_data, data.valid_data or data.train_data
        folder = os.path.join(output_dir, "data", "shapes")
        if torch.distributed.get_rank() == 0:
            ensure_shapes_task(folder)
        torch.distributed.barrier()
        name = "captions" if data.format == "pretrain" else "vqa"
        path = os.path.join(folder, name)
        return path, path

    def datasets(self, model_config, output_dir: str):
        """(train, valid, tokenizer); collective (the default data is made on rank 0)."""
        from megatron_slmoe.data.assets import asset_path
        from megatron_slmoe.data.errors import DataError
        from megatron_slmoe.data.image_text import ImageTextDataset
        from megatron_slmoe.data.tokenizer import load_tokenizer

        data, schedule = self.run.data, self.run.schedule
        tokenizer = load_tokenizer(data.tokenizer or asset_path("tokenizer.json"))
        if tokenizer.vocab_size > model_config.vocab_size:
            raise DataError(f"--tokenizer has {tokenizer.vocab_size} tokens, more than the "
                            f"model's vocab_size {model_config.vocab_size}")
        train_path, valid_path = self._paths(output_dir)
        common = dict(image_token_index=self.vision.image_token_index,
                      tokens_per_tile=self.vision.num_image_embeddings,
                      preprocess=preprocess_config(self.vision, self.settings),
                      caption_prompt=self.settings.caption_prompt, seed=schedule.seed)
        train = ImageTextDataset(train_path, tokenizer, data.seq_length, split="train",
                                 num_samples=schedule.train_samples, **common)
        valid = ImageTextDataset(valid_path, tokenizer, data.seq_length, split="val",
                                 shuffle=False, **common)
        self.train, self.valid, self.tokenizer = train, valid, tokenizer
        return train, valid, tokenizer

    @staticmethod
    def collate(samples):
        from megatron_slmoe.data.image_text import collate_image_text

        return collate_image_text(samples)

    def answer_accuracy(self, model, micro_batch_size: int, device: torch.device):
        """Exact-match accuracy of greedy answers to the first ``eval_answers`` held-out prompts
        (None when switched off or for captioning data), and every (prompt, answer, reference)
        of the data-parallel ranks together, in split order; collective."""
        from megatron.core import parallel_state

        limit = self.settings.eval_answers
        if limit == 0 or self.valid.captioning:  # a caption is no single answer to match
            return None, []
        examples = self.valid.generation_examples(limit)
        if not examples:
            return None, []
        dp, rank = (parallel_state.get_data_parallel_world_size(),
                    parallel_state.get_data_parallel_rank())
        per_rank = -(-len(examples) // dp)
        mine = examples[rank * per_rank:(rank + 1) * per_rank]
        tokenizer = self.tokenizer
        longest = max(len(tokenizer.encode(answer)) for _, answer in examples)
        was_training = model.training
        model.eval()
        with torch.no_grad():
            generated = greedy_generate(
                model, [p for p, _ in mine] or [examples[0][0]],
                max_new_tokens=min(self.settings.max_answer_tokens, longest + 1),
                seq_length=self.run.data.seq_length, micro_batch_size=micro_batch_size,
                pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
                image_token_index=self.vision.image_token_index,
                tokens_per_tile=self.vision.num_image_embeddings, device=device,
                num_prompts_per_rank=per_rank)
        model.train(was_training)
        answers = [tokenizer.decode(ids) for ids in generated[:len(mine)]]
        correct, total = exact_match_accuracy(answers, [a for _, a in mine])
        correct, total = all_reduce_counts(correct, total, device)
        ours = [(tokenizer.decode([t for t in p.tokens if t >= 0]), a, r)
                for (p, r), a in zip(mine, answers)]
        everyone = [None] * dp
        torch.distributed.all_gather_object(everyone, ours,
                                            group=parallel_state.get_data_parallel_group())
        return correct / max(total, 1), [row for rows in everyone for row in rows]

    def bad_samples(self) -> dict:
        """Distinct bad records skipped so far by reason, over the data-parallel ranks (train +
        held-out data); collective."""
        from megatron_slmoe.data.image_text import reduce_skip_counts

        return reduce_skip_counts(self.train.stats, self.valid.stats)
