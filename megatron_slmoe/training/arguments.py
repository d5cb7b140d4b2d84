"""Command-line flags of the LoRA fine-tuning job, spelled as Megatron spells them.

Every flag may also come from a YAML file (``--config run.yaml``; keys are the flag names with
dashes or underscores); flags on the command line win. Invalid values and combinations are
rejected before any process group forms, each with one line naming the flag (exit code 2).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional

import yaml


class ArgumentError(ValueError):
    """A flag's value or a combination of flags is unusable. The message is one line."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron_slmoe.training.finetune",
        description="LoRA fine-tuning of a Stable Latent MoE model on Megatron-Core.")
    p.add_argument("--config", default=None, help="YAML file with any of these flags")

    g = p.add_argument_group("model")
    g.add_argument("--model-config", default="tiny",
                   help="packaged model config name or YAML file (default: tiny)")
    g.add_argument("--base-checkpoint", default=None,
                   help="Megatron dist checkpoint with the base weights (default: random init)")
    g.add_argument("--finetune-mode", choices=["lora", "full"], default="lora",
                   help="'full' trains every weight (how the demo's tiny base is made)")

    g = p.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--distributed-timeout-minutes", type=int, default=30)
    g.add_argument("--moe-token-dispatcher-type", choices=["alltoall", "allgather"], default=None,
                   help="default: the model config's")
    g.add_argument("--moe-hierarchical-alltoall", action="store_true")
    g.add_argument("--moe-node-size", type=int, default=None,
                   help="ranks per node for the hierarchical all-to-all (default LOCAL_WORLD_SIZE)")

    g = p.add_argument_group("lora")
    g.add_argument("--lora-rank", type=int, default=8)
    g.add_argument("--lora-alpha", type=float, default=16.0)
    g.add_argument("--lora-dropout", type=float, default=0.0)
    g.add_argument("--lora-target-modules", nargs="+",
                   default=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    g.add_argument("--lora-init-seed", type=int, default=0,
                   help="seed of the initial LoRA A (drawn per global tensor name, so every "
                        "parallel layout starts from the same adapter)")
    g.add_argument("--adapter-init", default=None,
                   help="start from this adapter directory instead of fresh LoRA weights")

    g = p.add_argument_group("data")
    g.add_argument("--task", choices=["text", "image-text"], default="text",
                   help="image-text: the multimodal model (vision tower + projector + this "
                        "language model) on energon image-text datasets (default data: the "
                        "synthetic shapes task, captions with --data-format pretrain)")
    g.add_argument("--image-text-config", default=None,
                   help="YAML of the image-text settings (vision tower, tiling, evaluation; "
                        "megatron_slmoe.training.image_text.ImageTextConfig)")
    g.add_argument("--data-format", choices=["instruction", "pretrain"], default="instruction")
    g.add_argument("--train-data", default=None,
                   help="instruction JSONL, a Megatron indexed dataset prefix for pretrain, or "
                        "an energon dataset folder for image-text (default: the shipped demo "
                        "task / corpus)")
    g.add_argument("--valid-data", default=None)
    g.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the shipped one)")
    g.add_argument("--seq-length", type=int, default=128)

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=16)
    g.add_argument("--train-iters", type=int, default=200)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=10)
    g.add_argument("--lr-decay-style", choices=["cosine", "linear", "constant"], default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true", default=None,
                   help="default: on with GPUs/NPUs, off (fp32) on CPU")
    g.add_argument("--fp32", action="store_true", help="force fp32")
    g.add_argument("--recompute-granularity", choices=["selective", "full"], default=None)
    g.add_argument("--recompute-modules", nargs="+", default=None,
                   help="with selective recomputation, e.g. moe core_attn")
    g.add_argument("--eval-interval", type=int, default=50)
    g.add_argument("--eval-iters", type=int, default=4)

    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--output-dir", default=None, help="default: runs/<time>")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--no-tensorboard", action="store_true")
    g.add_argument("--save-interval", type=int, default=50)
    g.add_argument("--keep-last", type=int, default=2, help="full checkpoints to keep")
    g.add_argument("--no-resume", action="store_true",
                   help="start fresh even if the output directory has checkpoints")
    g.add_argument("--save-base", default=None,
                   help="with --finetune-mode full: also write the trained model here as a "
                        "Megatron dist checkpoint (a base for LoRA runs)")
    g.add_argument("--collapse-action", choices=["warn", "stop"], default="warn")
    g.add_argument("--exit-after-iters", type=int, default=None,
                   help="stop (as if killed) after this many iterations; for resume tests")
    g.add_argument("--validate-only", action="store_true",
                   help="check the arguments and exit (the launcher does this before torchrun)")
    return p


def _yaml_defaults(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as err:
        raise ArgumentError(f"--config {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ArgumentError(f"--config {path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ArgumentError(f"--config {path}: expected a mapping of flags")
    known = {a.dest for a in parser._actions}
    defaults = {}
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in known or dest in ("config", "help"):
            raise ArgumentError(f"--config {path}: unknown flag {key!r}")
        defaults[dest] = value
    return defaults


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Parse and validate; raises ArgumentError (one line) on bad input."""
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        parser.set_defaults(**_yaml_defaults(parser, pre.config))
    args = parser.parse_args(argv)  # argparse itself exits 2 with one line on a malformed flag
    validate(args)
    return args


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def validate(args: argparse.Namespace, world_size: Optional[int] = None) -> None:
    world = world_size or _world_size()
    positive = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                "expert_model_parallel_size", "lora_rank", "seq_length", "micro_batch_size",
                "global_batch_size", "train_iters", "log_interval", "eval_interval", "eval_iters",
                "save_interval", "keep_last", "distributed_timeout_minutes")
    for name in positive:
        if getattr(args, name) <= 0:
            raise ArgumentError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0.0 <= args.lora_dropout < 1.0:
        raise ArgumentError(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    if args.lr <= 0 or args.min_lr < 0 or args.min_lr > args.lr:
        raise ArgumentError(f"--lr {args.lr} / --min-lr {args.min_lr}: need 0 <= min-lr <= lr, lr > 0")
    if args.lr_warmup_iters < 0 or args.lr_warmup_iters >= args.train_iters:
        raise ArgumentError(f"--lr-warmup-iters {args.lr_warmup_iters} must be in "
                            f"[0, --train-iters {args.train_iters})")
    if args.clip_grad < 0:
        raise ArgumentError(f"--clip-grad must be >= 0, got {args.clip_grad}")
    tp, pp, ep = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.expert_model_parallel_size)
    if world % (tp * pp):
        raise ArgumentError(f"world size {world} is not divisible by --tensor-model-parallel-size "
                            f"{tp} x --pipeline-model-parallel-size {pp}")
    dp = world // (tp * pp)
    if (dp * tp) % ep:
        raise ArgumentError(f"--expert-model-parallel-size {ep} must divide the {dp * tp} ranks "
                            f"of a pipeline stage (world {world} / PP {pp})")
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ArgumentError(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                            f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}")
    if args.finetune_mode == "full" and args.adapter_init:
        raise ArgumentError("--adapter-init needs --finetune-mode lora")
    if args.save_base and args.finetune_mode != "full":
        raise ArgumentError("--save-base needs --finetune-mode full")
    if args.recompute_modules and args.recompute_granularity != "selective":
        raise ArgumentError("--recompute-modules needs --recompute-granularity selective")
    if args.bf16 and args.fp32:
        raise ArgumentError("--bf16 and --fp32 exclude each other")
    for name in ("base_checkpoint", "adapter_init", "tokenizer"):
        path = getattr(args, name)
        if path and not os.path.exists(path):
            raise ArgumentError(f"--{name.replace('_', '-')} {path}: no such file or directory")
    if args.task == "image-text":
        _validate_image_text(args)
    elif args.train_data and args.data_format == "instruction" and not os.path.isfile(args.train_data):
        raise ArgumentError(f"--train-data {args.train_data}: no such file")
    elif args.valid_data and args.data_format == "instruction" and not os.path.isfile(args.valid_data):
        raise ArgumentError(f"--valid-data {args.valid_data}: no such file")


def _validate_image_text(args: argparse.Namespace) -> None:
    for name in ("train_data", "valid_data"):
        path = getattr(args, name)
        if path and not os.path.isdir(os.path.join(path, ".nv-meta")):
            raise ArgumentError(f"--{name.replace('_', '-')} {path}: not an energon dataset "
                                f"folder (prepare one with tools/prepare_image_text.py)")
    if args.image_text_config and not os.path.isfile(args.image_text_config):
        raise ArgumentError(f"--image-text-config {args.image_text_config}: no such file")
    from megatron_slmoe.training.image_text import ImageTextConfig

    try:
        settings = ImageTextConfig.from_yaml(args.image_text_config)
        settings.vision.validate(tensor_parallel=args.tensor_model_parallel_size)
    except ValueError as err:
        raise ArgumentError(str(err)) from None
    if args.seq_length % args.tensor_model_parallel_size:
        raise ArgumentError(f"--seq-length {args.seq_length} must be divisible by "
                            f"--tensor-model-parallel-size {args.tensor_model_parallel_size} "
                            f"(the image-text sequence is split over tensor-parallel ranks)")


def main_guard(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """parse_args for a command line: one line on stderr and exit code 2 on bad input."""
    try:
        return parse_args(argv)
    except ArgumentError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
