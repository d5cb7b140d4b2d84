"""Write a random-weight Hugging Face checkpoint with a real model's layer shapes and fewer layers
(memory, import and speed at realistic shapes on one machine).

    slmoe-make-hf-checkpoint --preset qwen3-30b-a3b --num-layers 2 --output /data/qwen3-2l
    slmoe-make-hf-checkpoint --preset qwen3-30b-a3b --num-layers 1 --set hidden_size=512 \\
        --set num_experts=16 --output /tmp/small
    slmoe-make-hf-checkpoint --preset kimi-k3 --num-layers 4 --set num_experts=32 --output /tmp/k3
    slmoe-make-hf-checkpoint --preset kimi-k3-tiny --num-layers 13 --output /tmp/k3-tiny

Kimi K3 presets write the release's layout (``hf.kimi_k3_release``: experts MXFP4, fp32 tensors
fp32, ``A_log`` zero-padded to 128, 1-based layer lists in K3's pattern); ``--set
linear_attn_config.num_heads=8`` changes a nested field.

Weights are written shard by shard (one decoder layer in memory at a time) with a small ChatML
tokenizer; ``--set FIELD=VALUE`` changes a config field (JSON values). Bad input is one line,
exit code 2; nothing is left at ``--output`` on an error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from megatron_slmoe.commands.cli import BadInput, user_errors
from megatron_slmoe.data.tokenizer import write_chatml_tokenizer
from megatron_slmoe.hf import kimi_k3_release
from megatron_slmoe.hf.kimi_k3_release import PRESETS as RELEASE_PRESETS
from megatron_slmoe.hf.synthetic import (
    PRESETS,
    checked_config,
    largest_shard,
    write_random_checkpoint,
)
from megatron_slmoe.utils.sizes import format_bytes


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="slmoe-make-hf-checkpoint",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted([*PRESETS, *RELEASE_PRESETS]), required=True)
    parser.add_argument("--num-layers", type=int, required=True, help="decoder layers to write")
    parser.add_argument("--output", required=True, help="new (or empty) directory")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a config field (value as JSON, e.g. num_experts=16)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


@user_errors()
def main(argv: Optional[list[str]] = None) -> int:
    import torch

    args = parse_args(argv)
    if args.num_layers < 1:
        raise BadInput(f"--num-layers must be >= 1, got {args.num_layers}")
    output = os.path.abspath(args.output)
    if os.path.lexists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise BadInput(f"--output {output} exists and is not an empty directory")
    changes = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            raise BadInput(f"--set {item}: expected FIELD=VALUE")
        try:
            changes[name] = json.loads(value)
        except ValueError:
            changes[name] = value
    where = f"--preset {args.preset}{' with --set' if args.set else ''}"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.preset in RELEASE_PRESETS:
        config = kimi_k3_release.release_config(args.preset, args.num_layers, changes, where)
        shard, needed = kimi_k3_release.largest_shard(config, dtype)
        write = kimi_k3_release.write_release_checkpoint
    else:
        model_type, fields = PRESETS[args.preset]
        config = checked_config(model_type, args.num_layers, {**fields, **changes}, where)
        shard, needed = largest_shard(config, dtype)
        write = write_random_checkpoint
    available = _available_memory()
    if available is not None and needed > available:
        raise BadInput(f"--preset {args.preset}: its largest shard ({shard}) needs about "
                       f"{format_bytes(needed)} ({needed:,} bytes) of memory to write; this "
                       f"machine has {format_bytes(available)} available: --set fewer experts "
                       f"or smaller widths")
    sizes = write(config, output, seed=args.seed, dtype=dtype, add_files=write_chatml_tokenizer)
    print(f"wrote {output}: {len(sizes)} shards, {format_bytes(sum(sizes.values()))}")
    return 0


def _available_memory() -> Optional[int]:
    """Bytes of host memory available now (/proc/meminfo's MemAvailable), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


if __name__ == "__main__":
    sys.exit(main())
