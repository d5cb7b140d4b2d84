"""python -m megatron_slmoe.plan: the fastest layouts of a cluster that fit, and why others do not.

    python -m megatron_slmoe.plan --model-config flagship_2p8t --num-devices 256 --device h200
    python -m megatron_slmoe.plan --model-config my.yaml --num-devices 512 --device-memory-gb 64 \\
        --devices-per-node 16 --json plan.json

Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Optional

from megatron_slmoe.lora.config import MAX_LORA_RANK
from megatron_slmoe.parallel.config import MAX_DEVICE_MEMORY_GB
from megatron_slmoe.plan.devices import DEVICES, GiB, generic_device
from megatron_slmoe.plan.settings import DEFAULT_LORA_TARGETS, DTYPES, LORA_TARGETS


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
    p.add_argument("--model-config", required=True, help="packaged model config name or YAML file")
    p.add_argument("--num-devices", type=int, required=True)
    p.add_argument("--device", choices=sorted(DEVICES), default=None,
                   help="a preset (memory, rates, links, overhead)")
    p.add_argument("--device-memory-gb", type=_finite, default=None,
                   help="memory per device in GiB (2^30 bytes); overrides the preset's")
    p.add_argument("--devices-per-node", type=int, default=None, help="default 8")
    p.add_argument("--intra-node-gbps", type=_finite, default=None, help="GB/s per device")
    p.add_argument("--inter-node-gbps", type=_finite, default=None, help="GB/s per device")
    p.add_argument("--framework-overhead-gb", type=_finite, default=None,
                   help="GiB per process outside tensors (context, communicators)")
    p.add_argument("--fragmentation", type=_finite, default=None,
                   help="allocator margin as a share of the allocated peak")
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--global-batch-size", type=int, default=512)
    p.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-target-modules", nargs="+", choices=LORA_TARGETS,
                   default=list(DEFAULT_LORA_TARGETS))
    p.add_argument("--moe-imbalance", type=_finite, default=1.25,
                   help="tokens on the busiest EP rank over the mean (default 1.25)")
    p.add_argument("--hierarchical-alltoall", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--top", type=int, default=10, help="rows of each table")
    p.add_argument("--json", default=None, help="write the whole plan here")
    return p


RANGES = (  # (field, lowest, highest, above the lowest only): beyond them a figure is a typo
    ("device_memory_gb", 0, MAX_DEVICE_MEMORY_GB, True), ("intra_node_gbps", 0, 1e6, True),
    ("inter_node_gbps", 0, 1e6, True), ("framework_overhead_gb", 0, 1e4, False),
    ("fragmentation", 0, 10, False), ("moe_imbalance", 1, 1e4, False),
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


def _device(args):
    base = DEVICES[args.device] if args.device else None
    if base is None and args.device_memory_gb is None:
        raise _BadInput("give --device (" + ", ".join(sorted(DEVICES)) + ") or --device-memory-gb")
    for name, low, high, positive in RANGES:
        value = getattr(args, name)
        if value is not None and not ((value > low if positive else value >= low)
                                      and value <= high):
            bounds = f"{'(' if positive else '['}{low:g}, {high:g}]"
            raise _BadInput(f"--{name.replace('_', '-')} must be in {bounds}, got {value:g}")
    if args.devices_per_node is not None and args.devices_per_node < 1:
        raise _BadInput(f"--devices-per-node must be positive, got {args.devices_per_node}")
    memory = int(args.device_memory_gb * GiB) if args.device_memory_gb is not None else None
    if base is None:
        base = generic_device(memory)
    return base.with_overrides(
        memory_bytes=memory, devices_per_node=args.devices_per_node,
        intra_node_gbps=args.intra_node_gbps, inter_node_gbps=args.inter_node_gbps,
        framework_overhead=(int(args.framework_overhead_gb * GiB)
                            if args.framework_overhead_gb is not None else None),
        fragmentation=args.fragmentation)


def main(argv: Optional[list[str]] = None) -> int:
    from megatron_slmoe.plan._sources import ConfigError
    from megatron_slmoe.plan.model_shape import load_shape
    from megatron_slmoe.plan.planner import PlanOptions, plan
    from megatron_slmoe.plan.report import format_table, plan_document
    from megatron_slmoe.utils.atomic import write_json_atomic

    try:
        args = build_parser().parse_args(argv)
        if args.num_devices < 1:
            raise _BadInput(f"--num-devices must be positive, got {args.num_devices}")
        if args.top < 1:
            raise _BadInput(f"--top must be positive, got {args.top}")
        if not 1 <= args.lora_rank <= MAX_LORA_RANK:
            raise _BadInput(f"--lora-rank must be in 1..{MAX_LORA_RANK}, got {args.lora_rank}")
        if args.json:
            _check_writable(args.json)
        device = _device(args)
        hierarchical = {"auto": None, "on": True, "off": False}[args.hierarchical_alltoall]
        options = PlanOptions(seq_length=args.seq_length, global_batch_size=args.global_batch_size,
                              dtype=args.dtype, lora_rank=args.lora_rank,
                              lora_targets=tuple(args.lora_target_modules),
                              moe_imbalance=args.moe_imbalance,
                              micro_batch_sizes=tuple(args.micro_batch_sizes),
                              hierarchical_alltoall=hierarchical)
        options.settings(micro_batch_size=min(options.micro_batch_sizes)).validate()
        if any(m < 1 for m in options.micro_batch_sizes):
            raise _BadInput("--micro-batch-sizes must be positive")
        shape = load_shape(args.model_config)
        if args.seq_length > shape.max_sequence_length:
            raise _BadInput(f"--seq-length {args.seq_length} exceeds the model's "
                            f"max_sequence_length {shape.max_sequence_length} "
                            f"(--model-config {args.model_config})")
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
