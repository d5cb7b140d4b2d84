"""The language-model task: instruction conversations (loss on the answers, packed examples kept
apart) or Megatron indexed pretraining data, the shipped demo data by default.

Data settings may be local paths or ``s3://`` / ``msc://`` URLs, read through the node-local
cache of ``megatron_slmoe.storage``; a URL ending in ``/`` means every ``*.jsonl``
(instruction) or every ``*.idx``/``*.bin`` pair (pretrain) under it, in key order. Held-out
accuracy: the first ``eval_accuracy_samples`` held-out conversations answered greedily
(``inference.answers``) at every evaluation.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Optional

import torch

from megatron_slmoe.data.assets import asset_path
from megatron_slmoe.data.config import DataConfig
from megatron_slmoe.data.errors import DataError
from megatron_slmoe.data.instruction import InstructionDataset, packed_attention_mask
from megatron_slmoe.data.pretrain import build_pretrain_datasets, preprocess
from megatron_slmoe.data.sampler import collate
from megatron_slmoe.inference.answers import Answers, held_out_answers, request_for
from megatron_slmoe.training.config import ScheduleConfig
from megatron_slmoe.training.context import RunContext
from megatron_slmoe.training.tasks.base import Task, masked_mean_loss, to_device


class TextTask(Task):
    name = "text"

    def __init__(self, data: DataConfig, schedule: ScheduleConfig) -> None:
        self.data, self.schedule = data, schedule
        self.requests = []  # held-out prompts answered at evaluations
        self.tokenizer = None

    def datasets(self, storage, tokenizer, output_dir: str):
        """(train, valid). The tokenizer and sequence length were checked against the model
        before the run started (training.inputs)."""
        data, schedule = self.data, self.schedule
        if data.format == "instruction":
            train, valid = self._instruction(storage, tokenizer)
        else:
            train, valid = self._pretrain(storage, tokenizer, output_dir)
        conversations = getattr(valid, "conversations", None)  # instruction data only
        if conversations and schedule.eval_accuracy_samples > 0:
            self.requests = [request_for(tokenizer, m)
                             for m in conversations[:schedule.eval_accuracy_samples]]
        self.tokenizer = tokenizer
        return train, valid

    def _instruction(self, storage, tokenizer):
        data, schedule = self.data, self.schedule

        def files(path, default: str) -> list[str]:
            return storage.local_shards(path, ".jsonl") if path else [asset_path(default)]

        # Sample i of the run is a shuffled draw (a new order each epoch): the position alone
        # says where a run is, which is what resuming needs.
        train = InstructionDataset(files(data.train_data, "digits_train.jsonl"), tokenizer,
                                   data.seq_length, seed=schedule.seed,
                                   num_samples=schedule.train_samples,
                                   max_malformed_fraction=data.max_malformed_fraction)
        valid = InstructionDataset(files(data.valid_data, "digits_eval.jsonl"), tokenizer,
                                   data.seq_length, seed=schedule.seed, shuffle=False,
                                   max_malformed_fraction=data.max_malformed_fraction)
        return train, valid

    def _pretrain(self, storage, tokenizer, output_dir: str):
        data, schedule = self.data, self.schedule
        prefix = data.train_data
        if prefix is None:  # the shipped corpus, tokenized once into the run's directory
            prefix = os.path.join(output_dir, "data", "corpus")
            if torch.distributed.get_rank() == 0 and not os.path.exists(prefix + ".idx"):
                os.makedirs(os.path.dirname(prefix), exist_ok=True)
                preprocess(asset_path("corpus.txt"), tokenizer, prefix)
            torch.distributed.barrier()
        train, valid, _ = build_pretrain_datasets(
            storage.local_indexed_datasets(prefix), tokenizer, data.seq_length,
            train_samples=schedule.train_samples,
            valid_samples=schedule.eval_iters * schedule.global_batch_size, seed=schedule.seed,
            split="95,5,0", cache_dir=os.path.join(output_dir, "data", "index-cache"))
        if valid is None:
            raise DataError(f"--train-data {prefix}: too few documents for a held-out split")
        return train, valid

    def collate(self, samples: list) -> dict:
        return collate(samples)

    def forward_step(self, device: torch.device, data_iterator, model):
        batch = to_device(next(data_iterator), device)
        # Packed instruction rows keep their examples apart (data.instruction); pretraining
        # samples use Megatron's default causal mask.
        mask = packed_attention_mask(batch["segment_ids"]) if "segment_ids" in batch else None
        output = model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
        return output, partial(masked_mean_loss, batch["loss_mask"])

    def answers(self, ctx: RunContext) -> Optional[Answers]:
        if not self.requests:
            return None
        return held_out_answers(ctx.model, self.tokenizer, self.requests, ctx.dp_rank,
                                ctx.dp_size)
