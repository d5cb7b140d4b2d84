"""Convert between Hugging Face checkpoints and Megatron dist checkpoints / adapters.

    slmoe-convert-hf import --hf-checkpoint DIR --output OUT
    slmoe-convert-hf export --adapter RUN/adapter --hf-checkpoint DIR --output PEFT_DIR \\
        [--expert-layout per-expert|fused]
    slmoe-convert-hf export --merged --adapter RUN/adapter --hf-checkpoint DIR --output HF_DIR
    slmoe-convert-hf import-adapter --peft-adapter PEFT_DIR --hf-checkpoint DIR --output ADAPTER
    slmoe-convert-hf export-weights --checkpoint MEGATRON_DIR --hf-checkpoint DIR --output HF_DIR
    torchrun --nproc-per-node 8 -m megatron_slmoe.commands.convert_hf import --hf-checkpoint DIR \\
        --output OUT --expert-model-parallel-size 8   # each rank holds and reads only its shard

``import`` builds the Megatron model ``DIR/config.json`` describes (Qwen3-MoE, DeepSeek-V3 /
Kimi-K2, NemotronH attention+MoE, Stable Latent MoE), reads into each rank only the slices of its
own TP/PP/EP shard (``megatron_slmoe.hf.loader``) and writes one Megatron dist checkpoint (any
layout can load it: ``--base-checkpoint OUT``) with ``OUT/model_config.yaml``
(``--model-config OUT/model_config.yaml``) and the tokenizer files. The parallel sizes only decide
how the work and memory are split.

``export`` needs no process group: the adapter file is the same whatever the run's layout, and
it streams one tensor at a time (``megatron_slmoe.hf.peft_export``, ``hf.merged_export``).
``export-weights`` writes the weights of a Megatron dist checkpoint of an imported model (a full
fine-tune's ``--save-base``, or ``import``'s output) as an HF checkpoint of the family of
``--hf-checkpoint`` (its config and tokenizer files): each rank loads its shard, rank 0 assembles
and writes one HF weight at a time (``hf.megatron_export``); run it under torchrun with the
parallel sizes that fit the model in memory.

Bad input (missing or truncated shard, an index naming a file that is not there, a config whose
sizes disagree with the tensors, an unknown architecture, an existing non-empty output) is one
line on stderr and exit code 2, before any process group forms where the checkpoint alone
shows it; nothing is left at OUT.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import warnings

from megatron_slmoe.commands.cli import BadInput, user_errors
from megatron_slmoe.parallel.layout import data_parallel_size
from megatron_slmoe.training.cli import LAYOUT_FLAGS, add_run_flags, run_section

_DTYPES = ("fp32", "bf16")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="HF checkpoint -> Megatron dist checkpoint")
    imp.add_argument("--hf-checkpoint", required=True,
                     help="directory with config.json and *.safetensors (with or without index)")
    imp.add_argument("--output", required=True, help="new (or empty) directory for the result")
    imp.add_argument("--dtype", choices=_DTYPES, default="fp32",
                     help="dtype of the saved weights (FP8 sources are dequantised to it)")
    add_run_flags(imp, *LAYOUT_FLAGS, "model.hf_shape_check")
    exp = commands.add_parser("export", help="megatron_slmoe adapter -> PEFT adapter or merged "
                                             "HF checkpoint")
    exp.add_argument("--adapter", help="adapter directory written by the fine-tune (--save); "
                                       "without it --merged writes the base alone")
    exp.add_argument("--hf-checkpoint", required=True,
                     help="the HF checkpoint directory of the base model the run imported")
    exp.add_argument("--output", required=True, help="new (or empty) directory for the result")
    exp.add_argument("--merged", action="store_true",
                     help="write the base with the adapter merged as a full HF checkpoint instead "
                          "of a PEFT adapter")
    exp.add_argument("--expert-layout", choices=("per-expert", "fused"), default="per-expert",
                     help="PEFT adapter: routed experts as per-expert modules (vLLM) or as PEFT "
                          "target_parameters on transformers 5's fused 3D expert tensors")
    exp.add_argument("--base-model-name-or-path", default=None,
                     help="base_model_name_or_path of adapter_config.json (default: "
                          "--hf-checkpoint), e.g. the hub id serving stacks load")
    exp.add_argument("--max-shard-size-mib", type=int, default=5120,
                     help="merged checkpoint: MiB per safetensors shard")
    weights = commands.add_parser("export-weights", help="Megatron dist checkpoint -> HF "
                                                         "checkpoint (e.g. after full fine-tuning)")
    weights.add_argument("--checkpoint", required=True,
                         help="Megatron dist checkpoint of a model imported from --hf-checkpoint")
    weights.add_argument("--hf-checkpoint", required=True,
                         help="the HF checkpoint the model was imported from (config, tokenizer)")
    weights.add_argument("--output", required=True, help="new (or empty) directory")
    weights.add_argument("--max-shard-size-mib", type=int, default=5120,
                         help="MiB per safetensors shard")
    add_run_flags(weights, *LAYOUT_FLAGS)
    weights.set_defaults(hf_shape_check=False)
    imp_adapter = commands.add_parser("import-adapter", help="PEFT adapter -> megatron_slmoe "
                                                             "adapter (for --adapter-init)")
    imp_adapter.add_argument("--peft-adapter", required=True,
                             help="PEFT LoRA adapter directory (adapter_config.json, "
                                  "adapter_model.safetensors)")
    imp_adapter.add_argument("--hf-checkpoint", required=True,
                             help="the HF checkpoint directory of its base model")
    imp_adapter.add_argument("--output", required=True, help="new (or empty) directory")
    return parser.parse_args(argv)


def _check_output(path: str) -> str:
    path = os.path.abspath(path)
    if os.path.lexists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise BadInput(f"--output {path} exists and is not an empty directory")
    return path


def _prepare(args):
    """Everything that needs no process group: the checkpoint, its model, the layout."""
    from megatron_slmoe.config.errors import ConfigError
    from megatron_slmoe.hf.errors import HFCheckpointError
    from megatron_slmoe.hf.loader import open_hf_checkpoint

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
    import torch

    from megatron_slmoe.platform import apply_adaptor
    from megatron_slmoe.platform.single_rank import init_single_rank
    from megatron_slmoe.runtime import model as runtime

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
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def run_import(args) -> str:
    import torch

    from megatron_slmoe.hf.convert import import_to_dist_checkpoint
    from megatron_slmoe.hf.errors import HFCheckpointError

    hf, output = _prepare(args)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    with _process_group(args):
        try:
            return import_to_dist_checkpoint(hf, output, params_dtype=dtype)
        except HFCheckpointError as err:
            raise BadInput(str(err)) from None


def run_export(args) -> str:
    from megatron_slmoe.hf.errors import HFCheckpointError
    from megatron_slmoe.hf.merged_export import export_merged
    from megatron_slmoe.hf.peft_export import export_peft_adapter
    from megatron_slmoe.lora.adapter import AdapterError

    output = _check_output(args.output)
    if args.adapter is None and not args.merged:
        raise BadInput("export: --adapter is required (or --merged to write the base alone)")
    if args.max_shard_size_mib < 1:
        raise BadInput(f"--max-shard-size-mib must be >= 1, got {args.max_shard_size_mib}")
    try:
        if args.merged:
            return export_merged(args.adapter, args.hf_checkpoint, output,
                                 max_shard_bytes=args.max_shard_size_mib * 2**20)
        return export_peft_adapter(args.adapter, args.hf_checkpoint, output,
                                   layout=args.expert_layout,
                                   base_model_name_or_path=args.base_model_name_or_path)
    except (HFCheckpointError, AdapterError) as err:
        raise BadInput(str(err)) from None


def run_export_weights(args) -> str:
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    from megatron_slmoe.hf.convert import build_model_in_layout
    from megatron_slmoe.hf.errors import HFCheckpointError
    from megatron_slmoe.hf.megatron_export import export_megatron_weights

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
    from megatron_slmoe.hf.errors import HFCheckpointError
    from megatron_slmoe.hf.peft_import import peft_to_adapter

    output = _check_output(args.output)
    try:
        return peft_to_adapter(args.peft_adapter, args.hf_checkpoint, output)
    except HFCheckpointError as err:
        raise BadInput(str(err)) from None


@user_errors()
def main(argv=None) -> int:
    args = parse_args(argv)
    logging.getLogger("megatron").setLevel(logging.ERROR)  # construction chatter
    warnings.simplefilter("ignore", FutureWarning)
    from megatron_slmoe.platform import apply_adaptor

    apply_adaptor()

    output = {"export": run_export, "import-adapter": run_import_adapter,
              "import": run_import, "export-weights": run_export_weights}[args.command](args)
    if args.command == "export":
        print(f"exported {args.adapter or args.hf_checkpoint} -> {output}")
    elif args.command == "export-weights":
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"exported {args.checkpoint} -> {output}")
    elif args.command == "import-adapter":
        print(f"imported {args.peft_adapter} -> {output} (--adapter-init {output})")
    elif int(os.environ.get("RANK", "0")) == 0:
        print(f"imported {args.hf_checkpoint} -> {output} (--model-config "
              f"{os.path.join(output, 'model_config.yaml')} --base-checkpoint {output})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
