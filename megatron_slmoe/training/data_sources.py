"""The training and held-out data of a run, and its tokenizer (the shipped demo data by default)."""

from __future__ import annotations

import os

import torch

from megatron_slmoe.data.assets import asset_path
from megatron_slmoe.data.errors import DataError
from megatron_slmoe.data.tokenizer import load_tokenizer


def build_sources(args, model_config):
    """(train, valid, tokenizer). Collective: every rank calls it."""
    tokenizer = load_tokenizer(args.tokenizer or asset_path("tokenizer.json"))
    if tokenizer.vocab_size > model_config.vocab_size:
        raise DataError(f"--tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                        f"vocab_size {model_config.vocab_size}")
    if args.seq_length > model_config.max_sequence_length:
        raise DataError(f"--seq-length {args.seq_length} exceeds the model's "
                        f"max_sequence_length {model_config.max_sequence_length}")
    if args.data_format == "instruction":
        from megatron_slmoe.data.instruction import InstructionDataset

        # Sample i of the run is a shuffled draw (a new order each epoch): the position alone says
        # where a run is, which is what resuming needs.
        train = InstructionDataset(args.train_data or asset_path("digits_train.jsonl"), tokenizer,
                                   args.seq_length, seed=args.seed,
                                   num_samples=args.train_iters * args.global_batch_size)
        valid = InstructionDataset(args.valid_data or asset_path("digits_eval.jsonl"), tokenizer,
                                   args.seq_length, seed=args.seed, shuffle=False)
        return train, valid, tokenizer
    return (*_pretrain_sources(args, tokenizer), tokenizer)


def _pretrain_sources(args, tokenizer):
    from megatron_slmoe.data.pretrain import build_pretrain_datasets, preprocess

    output_dir = args.output_dir or "runs"
    prefix = args.train_data
    if prefix is None:  # the shipped corpus, tokenized once into the run's directory
        prefix = os.path.join(output_dir, "data", "corpus")
        if torch.distributed.get_rank() == 0 and not os.path.exists(prefix + ".idx"):
            os.makedirs(os.path.dirname(prefix), exist_ok=True)
            preprocess(asset_path("corpus.txt"), tokenizer, prefix)
        torch.distributed.barrier()
    train, valid, _ = build_pretrain_datasets(
        prefix, tokenizer, args.seq_length,
        train_samples=args.train_iters * args.global_batch_size,
        valid_samples=args.eval_iters * args.global_batch_size, seed=args.seed, split="95,5,0",
        cache_dir=os.path.join(output_dir, "data", "index-cache"))
    if valid is None:
        raise DataError(f"--train-data {prefix}: too few documents for a held-out split")
    return train, valid
