#!/usr/bin/env python
"""Fold a LoRA adapter into its base model and save the merged model as a Megatron dist checkpoint.

    python tools/merge_lora.py --base-checkpoint runs/demo/base --adapter runs/demo/lora/adapter \\
        --config tiny --output runs/demo/merged

The model is built as ``megatron_slmoe.moe.model_config.build_gpt_model`` builds it, in one process
(TP = PP = EP = 1, a one-rank gloo group), the base dist checkpoint is loaded into it, the adapter
is loaded (``load_adapter``; its recorded base model config name must match ``--config``) and
merged (W += alpha/r * B A, per expert too), and ``model.sharded_state_dict()`` is saved with
Megatron's dist checkpointing into a temporary directory next to ``--output`` that is moved into
place only when complete. The result loads like any base checkpoint of that config, in any layout.

Bad input (missing or unreadable checkpoint, adapter, config; an adapter for another model; an
existing non-empty output) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import warnings
from datetime import timedelta


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-checkpoint", required=True,
                        help="Megatron dist checkpoint directory of the base model")
    parser.add_argument("--adapter", required=True,
                        help="adapter directory (adapter_config.json, adapter_model.safetensors)")
    parser.add_argument("--config", required=True,
                        help="model YAML file or packaged config name (tiny, flagship_2p8t)")
    parser.add_argument("--output", required=True,
                        help="directory for the merged dist checkpoint (must not exist, or be empty)")
    return parser.parse_args(argv)


class BadInput(Exception):
    """One line for the user, exit code 2."""


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


def _init_single_rank() -> None:
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import megatron_slmoe

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            import socket

            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
        torch.distributed.init_process_group(megatron_slmoe.PLATFORM.backend, rank=0,
                                             world_size=1, timeout=timedelta(minutes=10))
    if torch.distributed.get_world_size() != 1:
        raise BadInput("merge_lora runs in one process (world size 1)")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(1234)  # nothing is drawn (no initialisation); set anyway
    if (parallel_state.get_tensor_model_parallel_world_size() != 1
            or parallel_state.get_pipeline_model_parallel_world_size() != 1
            or parallel_state.get_expert_model_parallel_world_size() != 1):
        raise BadInput("merge_lora needs TP = PP = EP = 1")


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
    import megatron_slmoe  # noqa: F401  (applies the platform adaptor)
    from megatron.core import dist_checkpointing

    from megatron_slmoe.lora.adapter import AdapterError, load_adapter, merge_lora
    from megatron_slmoe.moe.model_config import build_gpt_model, load_model_config
    from megatron_slmoe.moe.validation import ConfigError

    try:
        model_config = load_model_config(args.config)
    except ConfigError as err:
        raise BadInput(_one_line(err)) from None
    _init_single_rank()
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
        load_adapter(model, args.adapter, base_info={"model_config": model_config.name})
    except AdapterError as err:
        raise BadInput(_one_line(err)) from None
    merge_lora(model)

    parent = os.path.dirname(output)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.tmp-", dir=parent)
    try:
        dist_checkpointing.save(model.sharded_state_dict(), staging)
        if os.path.isdir(output):
            os.rmdir(output)  # empty (checked above); os.replace needs it gone or empty
        os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("megatron").setLevel(logging.ERROR)  # construction chatter
    warnings.simplefilter("ignore", FutureWarning)  # torch deprecations inside Megatron's loader
    try:
        output = merge(args)
    except BadInput as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001
        platform = sys.modules.get("megatron_slmoe.platform")
        if platform is not None and isinstance(err, platform.PlatformError):
            print(f"error: {err}", file=sys.stderr)
            return 2
        raise
    print(f"merged {args.adapter} into {args.base_checkpoint} -> {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
