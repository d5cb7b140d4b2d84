"""Write a random-weight Hugging Face checkpoint with a real model's layer shapes and fewer layers
(memory, import and speed at realistic shapes on one machine).

    slmoe-make-hf-checkpoint --preset qwen3-30b-a3b --num-layers 2 --output /data/qwen3-2l
    slmoe-make-hf-checkpoint --preset qwen3-30b-a3b --num-layers 1 --set hidden_size=512 \\
        --set num_experts=16 --output /tmp/small

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
from megatron_slmoe.hf.synthetic import PRESETS


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="slmoe-make-hf-checkpoint",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
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

    from megatron_slmoe.data.tokenizer import write_chatml_tokenizer
    from megatron_slmoe.hf.synthetic import hf_config, write_random_checkpoint

    args = parse_args(argv)
    if args.num_layers < 1:
        raise BadInput(f"--num-layers must be >= 1, got {args.num_layers}")
    output = os.path.abspath(args.output)
    if os.path.lexists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise BadInput(f"--output {output} exists and is not an empty directory")
    model_type, fields = PRESETS[args.preset]
    fields = dict(fields)
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            raise BadInput(f"--set {item}: expected FIELD=VALUE")
        try:
            fields[name] = json.loads(value)
        except ValueError:
            fields[name] = value
    try:
        config = hf_config(model_type, args.num_layers, **fields)
    except (TypeError, ValueError) as err:
        raise BadInput(f"--set: {err}") from None
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    sizes = write_random_checkpoint(config, output, seed=args.seed, dtype=dtype,
                                    add_files=write_chatml_tokenizer)
    print(f"wrote {output}: {len(sizes)} shards, {sum(sizes.values()) / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
