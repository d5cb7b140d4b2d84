"""Convert between Hugging Face checkpoints and Megatron dist checkpoints / adapters.

    slmoe-convert-hf import --hf-checkpoint DIR --output OUT
    slmoe-convert-hf export --adapter RUN/adapter --hf-checkpoint DIR --output PEFT_DIR \\
        [--export-hf-layout per-expert|fused|shared-outer|shared-outer-expanded]
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
import json
import logging
import os
import sys
import warnings

from megatron_slmoe.commands.cli import user_errors
from megatron_slmoe.training.cli import LAYOUT_FLAGS, add_run_flags

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
    exp.add_argument("--export-hf-layout", "--expert-layout", dest="export_hf_layout",
                     default="per-expert",
                     help="PEFT adapter layout, named by what reads it: per-expert (vLLM; PEFT "
                          "for Qwen2/3-MoE, DeepSeek), fused (PEFT target_parameters on "
                          "transformers 5's 3D experts), shared-outer (SGLang "
                          "--experts-shared-outer-loras), shared-outer-expanded (a shared-outer "
                          "adapter per expert, for vLLM/PEFT); the manifest in the output says "
                          "which")
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


@user_errors()
def main(argv=None) -> int:
    args = parse_args(argv)
    logging.getLogger("megatron").setLevel(logging.ERROR)  # construction chatter
    warnings.simplefilter("ignore", FutureWarning)
    from megatron_slmoe.commands import convert_hf_steps as steps  # the heavy part, flags checked

    steps.apply_adaptor()

    output = {"export": steps.run_export, "import-adapter": steps.run_import_adapter,
              "import": steps.run_import, "export-weights": steps.run_export_weights
              }[args.command](args)
    if args.command == "export":
        print(f"exported {args.adapter or args.hf_checkpoint} -> {output}")
        report = os.path.join(output, steps.REQUANTIZATION_REPORT)
        if os.path.isfile(report):  # a merged export that re-encoded packed weights
            with open(report, encoding="utf-8") as f:
                print(f"{json.load(f)['line']} ({report})")
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
