"""The image-text task (``--task image-text``): the multimodal model (vision tower, projector and
the Stable Latent MoE language model in Megatron-Core's LLaVAModel), energon image-text data (the
shapes task by default), its forward step on Megatron-Core's schedules and greedy answers to
held-out questions.

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
from functools import partial
from typing import List, Optional, Sequence

import torch

from megatron_slmoe.data.config import DataConfig, ImageTextConfig
from megatron_slmoe.data.image import ImagePreprocessConfig
from megatron_slmoe.data.image_text import GenerationPrompt
from megatron_slmoe.data.scoring import exact_match
from megatron_slmoe.model.config import VisionConfig
from megatron_slmoe.training.callbacks.base import Callback, RunContext
from megatron_slmoe.training.config import ScheduleConfig
from megatron_slmoe.training.evaluation import gather_answers, share_of
from megatron_slmoe.training.tasks.base import Answers, Task, masked_mean_loss, to_device


def forward_step(device: torch.device, data_iterator, model):
    """Megatron ``forward_step_func`` for image-text micro-batches (bind ``device`` with partial):
    the model's per-token loss and the masked-mean loss function over the combined sequence."""
    batch = to_device(next(data_iterator), device)
    output, loss_mask = model(batch["images"], batch["tokens"], None, None,
                              labels=batch["labels"], loss_mask=batch["loss_mask"],
                              num_image_tiles=batch["num_image_tiles"])
    return output, partial(masked_mean_loss, loss_mask)


def combined_positions(tokens_BT: torch.Tensor, num_image_tiles: torch.Tensor,
                       image_token_index: int, tokens_per_tile: int) -> torch.Tensor:
    """[b, T] index in the combined (text + image) sequence of every text position, as LLaVAModel
    lays it out: an image placeholder becomes ``tiles * tokens_per_tile`` positions."""
    is_image = tokens_BT == image_token_index
    widths = torch.ones_like(tokens_BT)
    widths[is_image] = num_image_tiles.to(tokens_BT.dtype) * tokens_per_tile
    return torch.cumsum(widths, dim=1) - widths  # start of each text position


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
    batch = to_device(next(data_iterator), device)
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


class ImageTextTask(Task):
    """Its sections: ``data``, ``vision``, ``image_text``, the schedule (seed, samples) and the
    fine-tuning mode (a full fine-tune freezes the tower unless ``--train-vision-tower``)."""

    name = "image-text"
    score_every_evaluation = False  # answers are generated without a KV cache: slow

    def __init__(self, data: DataConfig, vision: VisionConfig, image_text: ImageTextConfig,
                 schedule: ScheduleConfig, finetune_mode: str) -> None:
        self.data, self.vision, self.settings = data, vision, image_text
        self.schedule, self.finetune_mode = schedule, finetune_mode
        self.train = self.valid = self.tokenizer = None

    def build_model(self, model_config, transformer_config, pre_process: bool,
                    post_process: bool):
        from megatron_slmoe.model.multimodal import build_multimodal_model

        model = build_multimodal_model(model_config, transformer_config, self.vision,
                                       seq_length=self.data.seq_length,
                                       pre_process=pre_process, post_process=post_process)
        if self.finetune_mode == "full" and not self.settings.train_vision_tower:
            model.freeze(freeze_language_model=False, freeze_vision_model=True,
                         freeze_vision_projection=False)
        return model

    def after_base_weights(self, model) -> None:
        """The tower's weights from ``--vision-checkpoint``, if given; a pipeline stage without
        the tower has nothing to load."""
        if self.vision.checkpoint:
            from megatron_slmoe.model.hf_vision import load_hf_vision_tower

            load_hf_vision_tower(model, self.vision.checkpoint, self.vision)

    def _paths(self, output_dir: str) -> tuple[str, str]:
        """(train dataset, held-out dataset): the flags', else the shapes task made on first use
        in the run's folder (captions for ``--data-format pretrain``, else questions)."""
        from megatron_slmoe.data.shapes import ensure_shapes_task

        data = self.data
        if data.train_data:
            return data.train_data, data.valid_data or data.train_data
        folder = os.path.join(output_dir, "data", "shapes")
        if torch.distributed.get_rank() == 0:
            ensure_shapes_task(folder)
        torch.distributed.barrier()
        name = "captions" if data.format == "pretrain" else "vqa"
        path = os.path.join(folder, name)
        return path, path

    def datasets(self, storage, model_config, output_dir: str):
        from megatron_slmoe.data.errors import DataError
        from megatron_slmoe.data.image_text import ImageTextDataset
        from megatron_slmoe.data.tokenizer import load_tokenizer, tokenizer_source

        data, schedule = self.data, self.schedule
        tokenizer = load_tokenizer(storage.local_file(tokenizer_source(data.tokenizer)))
        if tokenizer.vocab_size > model_config.vocab_size:
            raise DataError(f"--tokenizer has {tokenizer.vocab_size} tokens, more than the "
                            f"model's vocab_size {model_config.vocab_size}")
        train_path, valid_path = self._paths(output_dir)
        common = dict(image_token_index=self.vision.image_token_index,
                      tokens_per_tile=self.vision.num_image_embeddings,
                      preprocess=ImagePreprocessConfig.from_sections(self.vision, self.settings),
                      caption_prompt=self.settings.caption_prompt, seed=schedule.seed)
        train = ImageTextDataset(train_path, tokenizer, data.seq_length, split="train",
                                 num_samples=schedule.train_samples, **common)
        valid = ImageTextDataset(valid_path, tokenizer, data.seq_length, split="val",
                                 shuffle=False, **common)
        self.train, self.valid, self.tokenizer = train, valid, tokenizer
        return train, valid, tokenizer

    def collate(self, samples: list) -> dict:
        from megatron_slmoe.data.image_text import collate_image_text

        return collate_image_text(samples)

    def forward_step(self, device: torch.device, data_iterator, model):
        return forward_step(device, data_iterator, model)

    def answers(self, ctx: RunContext) -> Optional[Answers]:
        """Greedy answers to the first ``eval_answers`` held-out questions (None when switched
        off or for captioning data: a caption is no single answer to match)."""
        limit = self.settings.eval_answers
        if limit == 0 or self.valid.captioning:
            return None
        examples = self.valid.generation_examples(limit)
        if not examples:
            return None
        share = share_of(len(examples), ctx.dp_rank, ctx.dp_size)
        mine = [examples[i] for i in share]
        tokenizer = self.tokenizer
        longest = max(len(tokenizer.encode(reference)) for _, reference in examples)
        was_training = ctx.ddp.training
        ctx.ddp.eval()
        with torch.no_grad():
            generated = greedy_generate(
                ctx.ddp, [p for p, _ in mine] or [examples[0][0]],
                max_new_tokens=min(self.settings.max_answer_tokens, longest + 1),
                seq_length=self.data.seq_length, micro_batch_size=ctx.micro_batch_size,
                pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
                image_token_index=self.vision.image_token_index,
                tokens_per_tile=self.vision.num_image_embeddings, device=ctx.device,
                num_prompts_per_rank=len(share_of(len(examples), 0, ctx.dp_size)))
        ctx.ddp.train(was_training)
        answers = [tokenizer.decode(ids) for ids in generated[:len(mine)]]
        rows = [(tokenizer.decode([t for t in prompt.tokens if t >= 0]), answer, reference)
                for (prompt, reference), answer in zip(mine, answers)]
        correct = sum(exact_match(a, r) for _, a, r in rows)
        return Answers(*gather_answers(rows, correct, ctx.device))

    def callbacks(self) -> list[Callback]:
        return [BadSampleCount(self)]


class BadSampleCount(Callback):
    """Records skipped for being bad (undecodable images, too long, ...), by reason: in the
    progress records and the summary."""

    name = "bad_samples"

    def __init__(self, task: ImageTextTask) -> None:
        self.task = task
        self.log_interval = task.schedule.log_interval

    def _counts(self) -> dict:
        """Distinct bad records skipped so far by reason, over the data-parallel ranks (train +
        held-out data); collective."""
        from megatron_slmoe.data.image_text import reduce_skip_counts

        return reduce_skip_counts(self.task.train.stats, self.task.valid.stats)

    def after_step(self, ctx: RunContext, record: dict) -> None:
        if ctx.iteration % self.log_interval == 0 or ctx.iteration == ctx.train_iters:
            record["bad_samples"] = self._counts()

    def finish(self, ctx: RunContext, summary: dict) -> None:
        counts = self._counts()
        summary.update(task="image-text", bad_samples=counts)
        ctx.info(f"[finetune] bad samples skipped: {sum(counts.values())} {counts}")
