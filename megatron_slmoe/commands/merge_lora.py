"""Fold a LoRA adapter into its base model and save the merged model as a Megatron dist checkpoint.

    slmoe-merge-lora --base-checkpoint runs/demo/base --adapter runs/demo/lora/adapter \\
        --output runs/demo/merged

The model config is the one the base checkpoint records (its ``model_config.yaml`` or
``model_config.txt``), else the adapter's; ``--model-config``, if given, must name the same model. The
model is built as ``megatron_slmoe.model.build.build_gpt_model`` builds it, in one process
(TP = PP = EP = 1, a one-rank gloo group), the base dist checkpoint is loaded into it, the adapter
is loaded (``load_adapter``; its recorded base model config and tokenizer must match the base's)
and merged (W += alpha/r * B A, per expert too), and ``model.sharded_state_dict()`` is saved with
Megatron's dist checkpointing into a temporary directory next to ``--output`` that is moved into
place only when complete. The result loads like any base checkpoint of that config, in any layout.

Bad input (missing or unreadable checkpoint, adapter, config; a --model-config or an adapter for
another model or tokenizer; an existing non-empty output) is one line on stderr and exit code 2,
before anything is built.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from megatron_slmoe.commands.cli import BadInput, user_errors
from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.data.errors import DataError
from megatron_slmoe.data.tokenizer import load_tokenizer, recorded_tokenizer
from megatron_slmoe.training.cli import add_run_flags
from megatron_slmoe.utils.atomic import atomic_directory


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_flags(parser, "model.base_checkpoint", required=["model.base_checkpoint"],
                  helps={"model.base_checkpoint": "Megatron dist checkpoint directory of the base "
                                                  "model"})
    parser.add_argument("--adapter", required=True,
                        help="adapter directory (adapter_config.json, adapter_model.safetensors)")
    add_run_flags(parser, "model.config", defaults={"model.config": None},
                  helps={"model.config": "model YAML file or packaged config name (default: the "
                                         "one the base checkpoint records; if given, it must "
                                         "name the same model)"})
    parser.add_argument("--output", required=True,
                        help="directory for the merged dist checkpoint (must not exist, or be empty)")
    return parser.parse_args(argv)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


def _load_error(err: BaseException) -> str:
    """The cause of a failed dist-checkpoint load in one line (torch wraps it per rank, with
    its traceback, in a CheckpointException)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        cause = next(iter(failures.values()))  # an exception, or (exception, frames)
        cause = cause[0] if isinstance(cause, tuple) and cause else cause
        if isinstance(cause, BaseException):
            err = cause
    return f"{type(err).__name__}: {_one_line(err)}"


def _check_paths(args: argparse.Namespace) -> str:
    for flag, path in (("--base-checkpoint", args.base_checkpoint), ("--adapter", args.adapter)):
        if not os.path.isdir(path):
            raise BadInput(f"{flag} {path}: no such directory")
    output = os.path.abspath(args.output)
    if os.path.lexists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise BadInput(f"--output {output} exists and is not an empty directory")
    return output


def merge(args: argparse.Namespace) -> str:
    """Do the merge; returns the output directory."""
    output = _check_paths(args)
    from megatron.core import dist_checkpointing

    from megatron_slmoe.lora.adapter import AdapterError, base_identity, load_adapter, merge_lora
    from megatron_slmoe.model.build import build_gpt_model
    from megatron_slmoe.platform import apply_adaptor
    from megatron_slmoe.platform.single_rank import init_single_rank
    from megatron_slmoe.runtime.bases import open_base

    apply_adaptor()

    try:
        base = open_base(base_checkpoint=args.base_checkpoint, model_config=args.model_config,
                         adapter=args.adapter)
        recorded = recorded_tokenizer(args.base_checkpoint)  # what the adapter is checked with
        tokenizer = load_tokenizer(recorded) if recorded else None
    except (ConfigError, DataError) as err:
        raise BadInput(_one_line(err)) from None
    model_config = base.model_config
    try:
        init_single_rank()
    except RuntimeError as err:  # a process with model parallelism already set up
        raise BadInput(f"merge_lora runs in one process without model parallelism: {err}") from None
    transformer_config = model_config.transformer_config(use_cpu_initialization=True,
                                                         perform_initialization=False)
    model = build_gpt_model(model_config, transformer_config)
    try:
        state = dist_checkpointing.load(model.sharded_state_dict(), args.base_checkpoint)
        model.load_state_dict(state)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001  (torch's CheckpointException is a BaseException)
        raise BadInput(f"cannot load base checkpoint {args.base_checkpoint} as model config "
                       f"{model_config.name}: {_load_error(err)}") from None
    try:
        load_adapter(model, args.adapter, base_info=base_identity(model_config, tokenizer))
    except AdapterError as err:
        raise BadInput(_one_line(err)) from None
    merge_lora(model)

    with atomic_directory(output) as staging:  # ``output`` is absent or empty (checked above)
        dist_checkpointing.save(model.sharded_state_dict(), staging)
    return output


@user_errors()
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("megatron").setLevel(logging.ERROR)  # construction chatter
    warnings.simplefilter("ignore", FutureWarning)  # torch deprecations inside Megatron's loader
    output = merge(args)
    print(f"merged {args.adapter} into {args.base_checkpoint} -> {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
