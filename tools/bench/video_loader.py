"""Benchmark the video sample loader: clips/s of Qwen3-VL-MoE video samples, local and streamed
from object storage, against energon's own AV decoding of the same clips.

The clips are made in a temporary folder (``--clips`` of ``--seconds`` s at 30 fps, 320 x 240,
MPEG-4 part 2, a square moving over smooth gradients), prepared into energon shards by
``tools/prepare_image_text.py``'s code, and read with Qwen3-VL's published video processor
settings (2 fps, two frames per temporal patch, 16-pixel patches, 2x2 merge).

Rows (one process, the way the trainer reads: sample i by random access):
  energon_av   energon's ``AVDecoder(...).get_video()`` on each clip's bytes: every frame decoded
               to a uint8 tensor (no sampling, no resize)
  decode       ours on the same bytes: PyAV decode (``data/video.py``), the processor's frame
               sampling, resize, normalisation and patches (``Qwen3VLVideoPatches``)
  sample       ImageTextDataset[i]: tar read + decode + the video's text in the chat template +
               packing
  object_cold  the dataset under an s3:// prefix of a local S3 server (moto), read through an
               empty node cache (each shard fetched when first read, the next in the background)
  object_warm  the same through the filled node cache

clips/s is the best of ``--repeats`` passes (object rows: one pass, the clips after the first);
x_energon is a row's clips/s over energon_av's.

    python tools/bench/video_loader.py --json runs/bench/video_loader.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from megatron_slmoe.platform import apply_adaptor

apply_adaptor()

from megatron_slmoe.data.image_inputs import NativeResolutionImages  # noqa: E402
from megatron_slmoe.data.image_text import ImageTextDataset  # noqa: E402
from megatron_slmoe.data.image_text_prepare import prepare_from_llava_json  # noqa: E402
from megatron_slmoe.data.tokenizer import load_tokenizer  # noqa: E402
from megatron_slmoe.data.video import decode_clip  # noqa: E402
from megatron_slmoe.families.qwen3_vl_moe.processor import (  # noqa: E402
    Qwen2VLPatches,
    Qwen3VLVideoPatches,
)
from megatron_slmoe.utils.atomic import write_json_atomic  # noqa: E402

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_SETTINGS = {"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16,
                  "temporal_patch_size": 2, "merge_size": 2,
                  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
VIDEO_SETTINGS = {"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 16,
                  "temporal_patch_size": 2, "merge_size": 2, "fps": 2, "min_frames": 4,
                  "max_frames": 768, "size": {"shortest_edge": 4096, "longest_edge": 25165824},
                  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                  "cap_pixels_per_frame": False}
"""Qwen3-VL's published video processor settings."""


def make_clips(folder: str, count: int, seconds: float, fps: int = 30) -> list[str]:
    import av

    os.makedirs(folder, exist_ok=True)
    ys, xs = np.mgrid[0:240, 0:320]
    names = []
    for index in range(count):
        buffer = io.BytesIO()
        with av.open(buffer, mode="w", format="mp4") as out:
            stream = out.add_stream("mpeg4", rate=fps)
            stream.width, stream.height, stream.pix_fmt = 320, 240, "yuv420p"
            for t in range(int(seconds * fps)):
                frame = ((ys[..., None] + xs[..., None] * (index % 3 + 1) + 3 * t
                          + np.array([0, 80, 160])) % 256).astype(np.uint8)
                y, x = (2 * t) % 200, (3 * t + 17 * index) % 280
                frame[y:y + 40, x:x + 40] = 255
                for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
        name = f"clip{index:05d}.mp4"
        with open(os.path.join(folder, name), "wb") as f:
            f.write(buffer.getvalue())
        names.append(name)
    return names


def video_input(folder: str):
    """(tokenizer, image input) of Qwen3-VL-MoE's processors: the tests' ChatML tokenizer with
    Qwen's vision tokens."""
    import pathlib

    import tokenizers

    _repository_on_path()
    from tests.helpers.hf_models import save_chatml_tokenizer

    save_chatml_tokenizer(pathlib.Path(folder), special_tokens=VISION_TOKENS)
    backend = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    ids = {t: backend.token_to_id(t) for t in VISION_TOKENS}
    for name, settings in (("preprocessor_config.json", IMAGE_SETTINGS),
                           ("video_preprocessor_config.json", VIDEO_SETTINGS)):
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            json.dump(settings, f)
    images = NativeResolutionImages(
        Qwen2VLPatches.from_preprocessor_config(os.path.join(folder, "preprocessor_config.json")),
        "<|image_pad|>", ids["<|image_pad|>"], "<|vision_start|><|image_pad|><|vision_end|>",
        videos=Qwen3VLVideoPatches.from_preprocessor_config(
            os.path.join(folder, "video_preprocessor_config.json")),
        video_token_id=ids["<|video_pad|>"])
    return load_tokenizer(folder), images


def _repository_on_path() -> None:
    """The repository root on sys.path: its tests/helpers make the tokenizer and run the local
    S3 server."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if root not in sys.path:
        sys.path.insert(0, root)


def best_rate(fn, count: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return count / best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clips", type=int, default=32)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--per-shard", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-object-store", action="store_true")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    from megatron.energon.av import AVDecoder

    rows = []
    with tempfile.TemporaryDirectory() as work:
        clips = os.path.join(work, "clips")
        names = make_clips(clips, args.clips, args.seconds)
        records = [{"messages": [{"role": "user", "content": "<video>\nWhat moves?"},
                                 {"role": "assistant", "content": "a square"}],
                    "videos": [n]} for n in names]
        jsonl = os.path.join(work, "clips.jsonl")
        with open(jsonl, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        dataset_dir = os.path.join(work, "ds")
        prepare_from_llava_json(dataset_dir, jsonl, clips, samples_per_shard=args.per_shard,
                                max_bad_fraction=0.0)
        tokenizer, images = video_input(work)
        data = [open(os.path.join(clips, n), "rb").read() for n in names]
        dataset = ImageTextDataset(dataset_dir, tokenizer, args.seq_length, images=images,
                                   shuffle=False)
        grid = dataset[0]["video_grid_thw"][0].tolist()
        n = len(data)

        def energon_av():
            for clip in data:
                AVDecoder(io.BytesIO(clip)).get_video()

        def decode():
            for clip in data:
                images.videos.patches(decode_clip(clip))

        def sample():
            for i in range(n):
                dataset[i]

        rates = {}
        for row, fn in (("energon_av", energon_av), ("decode", decode), ("sample", sample)):
            rates[row] = best_rate(fn, n, args.repeats)
            rows.append({"row": row, "clips": n, "clips_per_s": rates[row]})
        if not args.no_object_store:
            rows += object_rows(dataset_dir, tokenizer, images, args, n)
        for row in rows:
            row.update(x_energon=row["clips_per_s"] / rates["energon_av"],
                       seconds=args.seconds, grid_thw=grid)
    print(f"{'row':<12} {'clips':>5} {'clips/s':>9} {'x_energon':>9}   "
          f"({args.seconds:g} s 320x240 30 fps clips; grid {grid}; load {os.getloadavg()[0]:.1f})")
    for r in rows:
        print(f"{r['row']:<12} {r['clips']:>5} {r['clips_per_s']:>9.2f} {r['x_energon']:>9.2f}")
    if args.json:
        write_json_atomic(args.json, {"rows": rows, "load_average": os.getloadavg()})
    return 0


def object_rows(dataset_dir: str, tokenizer, images, args, n: int) -> list[dict]:
    """object_cold / object_warm: the dataset read from moto's S3 server through the node
    cache, empty and then filled; clips/s over the clips after the first."""
    _repository_on_path()
    from tests.helpers.s3_server import S3TestServer

    from megatron_slmoe.storage.config import StorageConfig
    from megatron_slmoe.storage.session import Storage
    from megatron_slmoe.training.tasks.image_text import node_view

    rows = []
    with S3TestServer() as server, tempfile.TemporaryDirectory() as caches:
        os.environ.update(server.env())
        server.client().create_bucket(Bucket="bench-videos")
        server.upload_folder("bench-videos", "clips/", dataset_dir)
        cache = os.path.join(caches, "cache")
        for row in ("object_cold", "object_warm"):
            if row == "object_cold" and os.path.isdir(cache):
                shutil.rmtree(cache)
            storage = Storage(StorageConfig(cache_dir=cache))
            local, stored = node_view(storage, "s3://bench-videos/clips/")
            dataset = ImageTextDataset(local, tokenizer, args.seq_length, images=images,
                                       shuffle=False, stored=stored)
            dataset[0]
            start = time.perf_counter()
            for i in range(1, n):
                dataset[i]
            rate = (n - 1) / (time.perf_counter() - start)
            stored.close()
            rows.append({"row": row, "clips": n - 1, "clips_per_s": rate})
    return rows


if __name__ == "__main__":
    sys.exit(main())
