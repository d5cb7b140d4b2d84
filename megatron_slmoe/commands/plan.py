"""slmoe-plan: the fastest layouts of a cluster that fit, and why others do not.

Also ``python -m megatron_slmoe.plan``.

    slmoe-plan --model-config flagship_2p8t --num-devices 256 --device h200
    slmoe-plan --model-config my.yaml --num-devices 512 --device-memory-gb 64 \\
        --devices-per-node 16 --json plan.json

The run's own settings (model config, sequence length, global batch, LoRA rank and targets, device
memory) are the fine-tune's flags, declared and checked by their sections; the planner's defaults
are ``PlanOptions``'. Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Optional

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.plan.devices import DEVICES, GiB, generic_device
from megatron_slmoe.plan.model_shape import load_shape
from megatron_slmoe.plan.planner import PlanOptions, plan
from megatron_slmoe.plan.report import format_table, plan_document
from megatron_slmoe.plan.settings import DTYPES
from megatron_slmoe.training.cli import add_run_flags, run_section
from megatron_slmoe.utils.atomic import write_json_atomic


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage too: one line is the rule here
        raise _BadInput(message)


class _BadInput(ValueError):
    pass


def _finite(text: str) -> float:
    """A float flag's value: infinity and NaN mean nothing here."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m megatron_slmoe.plan", description=__doc__.splitlines()[0])
    add_run_flags(p, "model.config", "parallel.device_memory_gb", "data.seq_length",
                  "schedule.global_batch_size", "lora.rank", "lora.targets",
                  "lora.expert_rank", "lora.moe_rank_scaling", "lora.expert_layout",
                  required=["model.config"],
                  defaults={"data.seq_length": PlanOptions.seq_length,
                            "schedule.global_batch_size": PlanOptions.global_batch_size,
                            "lora.rank": PlanOptions.lora_rank,
                            "lora.targets": list(PlanOptions.lora_targets)},
                  helps={"parallel.device_memory_gb": "memory per device in GiB (2^30 bytes); "
                                                      "overrides the preset's"})
    p.add_argument("--num-devices", type=int, required=True)
    p.add_argument("--device", choices=sorted(DEVICES), default=None,
                   help="a preset (memory, rates, links, overhead)")
    p.add_argument("--devices-per-node", type=int, default=None, help="default 8")
    p.add_argument("--intra-node-gbps", type=_finite, default=None, help="GB/s per device")
    p.add_argument("--inter-node-gbps", type=_finite, default=None, help="GB/s per device")
    p.add_argument("--framework-overhead-gb", type=_finite, default=None,
                   help="GiB per process outside tensors (context, communicators)")
    p.add_argument("--fragmentation", type=_finite, default=None,
                   help="allocator margin as a share of the allocated peak")
    p.add_argument("--micro-batch-sizes", type=int, nargs="+",
                   default=list(PlanOptions.micro_batch_sizes))
    p.add_argument("--dtype", choices=sorted(DTYPES), default=PlanOptions.dtype)
    p.add_argument("--moe-imbalance", type=_finite, default=PlanOptions.moe_imbalance,
                   help="tokens on the busiest EP rank over the mean "
                        f"(default {PlanOptions.moe_imbalance})")
    p.add_argument("--hierarchical-alltoall", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--top", type=int, default=10, help="rows of each table")
    p.add_argument("--json", default=None, help="write the whole plan here")
    return p


RANGES = (  # (field, lowest, highest, above the lowest only): beyond them a figure is a typo
    ("intra_node_gbps", 0, 1e6, True), ("inter_node_gbps", 0, 1e6, True),
    ("framework_overhead_gb", 0, 1e4, False), ("fragmentation", 0, 10, False),
    ("moe_imbalance", 1, 1e4, False),
)


def _check_writable(path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):  # made on writing: its nearest existing parent counts
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise _BadInput(f"--json {path}: {folder} is a file, not a directory")
    if os.path.isdir(path):
        raise _BadInput(f"--json {path} is a directory")
    if not os.access(folder, os.W_OK):
        raise _BadInput(f"--json {path}: {folder} is not writable")


def _device(args, memory_gb: Optional[float]):
    base = DEVICES[args.device] if args.device else None
    if base is None and memory_gb is None:
        raise _BadInput("give --device (" + ", ".join(sorted(DEVICES)) + ") or --device-memory-gb")
    for name, low, high, positive in RANGES:
        value = getattr(args, name)
        if value is not None and not ((value > low if positive else value >= low)
                                      and value <= high):
            bounds = f"{'(' if positive else '['}{low:g}, {high:g}]"
            raise _BadInput(f"--{name.replace('_', '-')} must be in {bounds}, got {value:g}")
    if args.devices_per_node is not None and args.devices_per_node < 1:
        raise _BadInput(f"--devices-per-node must be positive, got {args.devices_per_node}")
    memory = int(memory_gb * GiB) if memory_gb is not None else None
    if base is None:
        base = generic_device(memory)
    return base.with_overrides(
        memory_bytes=memory, devices_per_node=args.devices_per_node,
        intra_node_gbps=args.intra_node_gbps, inter_node_gbps=args.inter_node_gbps,
        framework_overhead=(int(args.framework_overhead_gb * GiB)
                            if args.framework_overhead_gb is not None else None),
        fragmentation=args.fragmentation)


def main(argv: Optional[list[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.num_devices < 1:
            raise _BadInput(f"--num-devices must be positive, got {args.num_devices}")
        if args.top < 1:
            raise _BadInput(f"--top must be positive, got {args.top}")
        lora = run_section(args, "lora")
        seq_length = run_section(args, "data").seq_length
        global_batch_size = run_section(args, "schedule").global_batch_size
        memory_gb = run_section(args, "parallel").device_memory_gb
        if args.json:
            _check_writable(args.json)
        device = _device(args, memory_gb)
        hierarchical = {"auto": None, "on": True, "off": False}[args.hierarchical_alltoall]
        options = PlanOptions(seq_length=seq_length, global_batch_size=global_batch_size,
                              dtype=args.dtype, lora_rank=lora.rank,
                              lora_targets=tuple(lora.targets),
                              expert_lora_rank=lora.expert_rank,
                              moe_rank_scaling=lora.moe_rank_scaling,
                              expert_lora_layout=lora.expert_layout,
                              moe_imbalance=args.moe_imbalance,
                              micro_batch_sizes=tuple(args.micro_batch_sizes),
                              hierarchical_alltoall=hierarchical)
        options.settings(micro_batch_size=min(options.micro_batch_sizes)).validate()
        if any(m < 1 for m in options.micro_batch_sizes):
            raise _BadInput("--micro-batch-sizes must be positive")
        model_config = run_section(args, "model").config
        shape = load_shape(model_config)
        unmatched = [t for t in options.lora_targets if t not in shape.lora_targets]
        if unmatched:
            raise _BadInput(f"--lora-target-modules {' '.join(options.lora_targets)}: "
                            f"{unmatched[0]!r} matches nothing in --model-config "
                            f"{model_config}; targetable: {', '.join(shape.lora_targets)}")
        if shape.experts:  # a rank scaling that gives no whole rank: one line, not "none fits"
            options.settings().expert_rank(shape)
        if args.num_devices > device.devices_per_node and args.num_devices % device.devices_per_node:
            raise _BadInput(f"--num-devices {args.num_devices} is not a whole number of nodes of "
                            f"{device.devices_per_node} devices (--devices-per-node)")
        if seq_length > shape.max_sequence_length:
            raise _BadInput(f"--seq-length {seq_length} exceeds the model's "
                            f"max_sequence_length {shape.max_sequence_length} "
                            f"(--model-config {model_config})")
    except (_BadInput, ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = plan(shape, device, args.num_devices, options)
    print(format_table(result, top=args.top))
    if args.json:
        try:
            write_json_atomic(args.json, plan_document(result))
        except OSError as err:
            print(f"error: --json {args.json}: {err.strerror}", file=sys.stderr)
            return 2
    return 0 if result.feasible else 1


if __name__ == "__main__":
    sys.exit(main())
