"""The work of ``slmoe-convert-hf`` once its flags are checked (megatron_slmoe.commands.convert_hf
parses them and imports this module only then: torch, Megatron-Core and the checkpoint code load
after a bad flag has had its one line)."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
from megatron.core import dist_checkpointing, parallel_state
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from megatron_slmoe.commands.cli import BadInput
from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.families.errors import HFCheckpointError
from megatron_slmoe.hf.convert import build_model_in_layout, import_to_dist_checkpoint
from megatron_slmoe.hf.loader import open_hf_checkpoint
from megatron_slmoe.hf.megatron_export import export_megatron_weights
from megatron_slmoe.hf.merged_export import REQUANTIZATION_REPORT, export_merged
from megatron_slmoe.hf.peft_export import export_peft_adapter
from megatron_slmoe.hf.peft_import import peft_to_adapter
from megatron_slmoe.lora.adapter import (
    AdapterError,
    base_identity,
    check_base_identity,
    read_adapter_config,
)
from megatron_slmoe.parallel.layout import data_parallel_size
from megatron_slmoe.platform import apply_adaptor
from megatron_slmoe.platform.single_rank import init_single_rank
from megatron_slmoe.runtime import model as runtime
from megatron_slmoe.training.cli import run_section

__all__ = ["REQUANTIZATION_REPORT", "apply_adaptor", "run_export", "run_export_weights",
           "run_import", "run_import_adapter"]


def _check_output(path: str) -> str:
    path = os.path.abspath(path)
    if os.path.lexists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise BadInput(f"--output {path} exists and is not an empty directory")
    return path


def _prepare(args):
    """Everything that needs no process group: the checkpoint, its model, the layout."""
    output = _check_output(args.output)
    try:
        parallel = run_section(args, "parallel")
        hf = open_hf_checkpoint(args.hf_checkpoint, check_shapes=args.hf_shape_check)
        tp, pp, ep = (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                      parallel.expert_model_parallel_size)
        hf.model_config.transformer_config(
            tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
            pipeline_model_parallel_size=pp, expert_model_parallel_size=ep)
        data_parallel_size(int(os.environ.get("WORLD_SIZE", "1")), tp, pp, ep)
    except (HFCheckpointError, ConfigError) as err:
        raise BadInput(str(err)) from None
    return hf, output


@contextlib.contextmanager
def _process_group(args):
    """Inside: a process group and Megatron's parallel state, joined if one exists, else formed
    (and torn down on the way out)."""
    if torch.distributed.is_initialized():
        yield
        return
    if "RANK" not in os.environ:  # plain `slmoe-convert-hf`: a group of one (checked in _prepare)
        init_single_rank()
    else:
        parallel = dataclasses.replace(run_section(args, "parallel"),
                                       distributed_timeout_minutes=60)
        runtime.init_distributed(parallel, 1234, apply_adaptor())
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def run_import(args) -> str:
    hf, output = _prepare(args)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    with _process_group(args):
        try:
            return import_to_dist_checkpoint(hf, output, params_dtype=dtype)
        except HFCheckpointError as err:
            raise BadInput(str(err)) from None


def run_export(args) -> str:
    output = _check_output(args.output)
    if args.adapter is None and not args.merged:
        raise BadInput("export: --adapter is required (or --merged to write the base alone)")
    if args.max_shard_size_mib < 1:
        raise BadInput(f"--max-shard-size-mib must be >= 1, got {args.max_shard_size_mib}")
    try:
        hf = open_hf_checkpoint(args.hf_checkpoint, check_shapes=args.merged)
        if args.adapter:  # as generate and --adapter-init refuse it
            check_base_identity(read_adapter_config(args.adapter)[1],
                                base_identity(hf.model_config), f"--adapter {args.adapter}")
        if args.merged:
            return export_merged(args.adapter, hf, output,
                                 max_shard_bytes=args.max_shard_size_mib * 2**20)
        return export_peft_adapter(args.adapter, hf, output,
                                   layout=args.export_hf_layout,
                                   base_model_name_or_path=args.base_model_name_or_path)
    except (HFCheckpointError, AdapterError) as err:
        raise BadInput(str(err)) from None


def run_export_weights(args) -> str:
    if not os.path.isfile(os.path.join(args.checkpoint, "metadata.json")):
        raise BadInput(f"--checkpoint {args.checkpoint}: not a Megatron dist checkpoint (no "
                       f"metadata.json)")
    if args.max_shard_size_mib < 1:
        raise BadInput(f"--max-shard-size-mib must be >= 1, got {args.max_shard_size_mib}")
    hf, output = _prepare(args)
    with _process_group(args):
        model, _ = build_model_in_layout(hf.model_config)
        try:
            state = dist_checkpointing.load(model.sharded_state_dict(), args.checkpoint)
            model.load_state_dict(state, strict=True)
        except (Exception, CheckpointException) as err:  # noqa: BLE001  (one line for them all)
            if isinstance(err, CheckpointException) and err.failures:  # the first rank's cause
                err = next(iter(err.failures.values()))
                err = err[0] if isinstance(err, tuple) else err  # (exception, traceback)
            text = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
            first = (text.strip().splitlines() or [type(err).__name__])[0]
            first = first if len(first) <= 200 else first[:200] + "..."
            raise BadInput(f"--checkpoint {args.checkpoint} does not load into the model of "
                           f"{args.hf_checkpoint}: {first}") from None
        try:
            return export_megatron_weights([model], hf, output,
                                           max_shard_bytes=args.max_shard_size_mib * 2**20)
        except HFCheckpointError as err:
            raise BadInput(str(err)) from None


def run_import_adapter(args) -> str:
    output = _check_output(args.output)
    try:
        return peft_to_adapter(args.peft_adapter, args.hf_checkpoint, output)
    except HFCheckpointError as err:
        raise BadInput(str(err)) from None
