"""Turn a LLaVA-style JSON file and an image folder into an energon image-text dataset (records
may hold video clips too: ``"videos"``, ms-swift's and LLaMA-Factory's field, ``<video>`` marks).

    python tools/prepare_image_text.py --json train.json --image-dir images --output data/mine
    python tools/prepare_image_text.py --json train.json --val-json eval.json --image-dir images \\
        --sample-type vqa --output data/mine-vqa

Writes WebDataset shards (``train/``, ``val/``) with energon's ``.nv-meta`` (index, splits,
``dataset.yaml``) into a new folder; records that cannot make a correct sample are skipped, counted
and named (see ``megatron_slmoe/data/image_text_prepare.py``). Train with
``--task image-text --train-data <output>``. Bad input: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

from megatron_slmoe.data.errors import DataError
from megatron_slmoe.data.image_text import KINDS
from megatron_slmoe.data.image_text_prepare import prepare_from_llava_json


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="LLaVA-style JSON list (or JSON lines)")
    p.add_argument("--val-json", help="held-out records (the 'val' split)")
    p.add_argument("--image-dir", required=True,
                   help="folder the image and video paths are relative to")
    p.add_argument("--output", required=True, help="new dataset folder (must not exist)")
    p.add_argument("--sample-type", choices=KINDS, default="chat",
                   help="chat (any conversation, any number of images; default), vqa or caption "
                        "(one image, one exchange: energon's VQASample / CaptioningSample)")
    p.add_argument("--samples-per-shard", type=int, default=1000)
    p.add_argument("--max-warnings", type=int, default=20, help="skipped records named per file")
    p.add_argument("--max-bad-fraction", type=float, default=1.0,
                   help="refuse a split with more bad (skipped) records than this fraction "
                        "(default 1: skip and count them all)")
    p.add_argument("--max-video-seconds", type=float, default=600.0,
                   help="longer clips are skipped as undecodable video (default 600)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        written, stats = prepare_from_llava_json(
            args.output, args.json, args.image_dir, kind=args.sample_type,
            val_json=args.val_json, samples_per_shard=args.samples_per_shard,
            max_warnings=args.max_warnings, max_bad_fraction=args.max_bad_fraction,
            max_video_seconds=args.max_video_seconds)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for split, count in written.items():
        print(f"{split}: {stats[split].summary()}")
    print(f"energon dataset ({args.sample_type}) written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
