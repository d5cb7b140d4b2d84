"""The training and held-out data of a run, and its tokenizer (the shipped demo data by default).

Settings may be local paths or ``s3://`` / ``msc://`` URLs, read through the node-local cache of
``megatron_slmoe.storage``; a URL ending in ``/`` means every ``*.jsonl`` (instruction) or every
``*.idx``/``*.bin`` pair (pretrain) under it, in key order.
"""

from __future__ import annotations

import os

import torch

from megatron_slmoe.data.config import DataConfig
from megatron_slmoe.training.config import ScheduleConfig
from megatron_slmoe.data.assets import asset_path
from megatron_slmoe.data.errors import DataError
from megatron_slmoe.data.tokenizer import load_tokenizer
from megatron_slmoe.storage import Storage


def build_sources(data: DataConfig, schedule: ScheduleConfig, output_dir: str, storage: Storage):
    """(train, valid, tokenizer). Collective: every rank calls it. The tokenizer and sequence
    length were checked against the model before the run started (training.inputs)."""
    tokenizer = load_tokenizer(storage.local_file(data.tokenizer) if data.tokenizer
                               else asset_path("tokenizer.json"))
    if data.format == "instruction":
        from megatron_slmoe.data.instruction import InstructionDataset

        def files(path, default: str) -> list[str]:
            return storage.local_shards(path, ".jsonl") if path else [asset_path(default)]

        # Sample i of the run is a shuffled draw (a new order each epoch): the position alone says
        # where a run is, which is what resuming needs.
        train = InstructionDataset(files(data.train_data, "digits_train.jsonl"), tokenizer,
                                   data.seq_length, seed=schedule.seed,
                                   num_samples=schedule.train_samples)
        valid = InstructionDataset(files(data.valid_data, "digits_eval.jsonl"), tokenizer,
                                   data.seq_length, seed=schedule.seed, shuffle=False)
        return train, valid, tokenizer
    return (*_pretrain_sources(data, schedule, tokenizer, output_dir, storage), tokenizer)


def _pretrain_sources(data: DataConfig, schedule: ScheduleConfig, tokenizer, output_dir: str,
                      storage: Storage):
    from megatron_slmoe.data.pretrain import build_pretrain_datasets, preprocess

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
