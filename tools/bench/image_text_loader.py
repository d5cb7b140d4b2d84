"""Benchmark the image-text sample loader: samples/s and the share of time spent decoding images.

Two datasets, made in a temporary folder (or ``--data DIR`` for an energon dataset of your own):
  shapes   the demo's synthetic task: 32 x 32 PNGs, VQA samples, 32 x 32 tower input
  photos   640 x 480 JPEGs of smooth noise (photo-like entropy), chat samples, 336 x 336 input,
           and the same with tiling (up to 4 tiles + thumbnail)

Rows per dataset (one process, the way the trainer reads: sample i by random access):
  energon_loader  energon's own loader (get_val_dataset + get_loader, its default decoder: images
                  to tensors, no tokenisation, no resize), sequential reads; chat datasets
                  (energon's CrudeWebdataset) through a task encoder whose one cooker keeps the
                  json and the decoded image parts
  energon_same_work  baseline: energon's loader doing the sample's work as an energon user
                  writes it (PIL images from energon's decoder, tiled and resized with pillow as
                  ours, scaled and normalised with numpy, text tokenised)
  read            energon's factory + tar index by random access, JSON parsed, images left as bytes
  decode          pillow decode + resize + normalise of the images alone (from read bytes)
  sample          ImageTextDataset[i]: read + decode + chat template + packing
  sample_w2       the same through torch's DataLoader with 2 worker processes
  object_cold     (photos) a larger photos dataset (--stored-records, 64 per shard) under an s3://
                  prefix of a local S3 server (moto), its first --samples samples read as
                  a run reads it: the metadata into an empty node cache, then sample by sample,
                  each shard fetched when first read and the next samples' shards in the
                  background; downloads included (--no-object-store skips the object rows)
  object_warm     the same through the filled node cache
  object_copy_all baseline: every object of the prefix into an empty cache first, then read
                  (how runs read a stored dataset before streaming)
The object rows' samples/s count the samples after the first (the other rows' datasets are opened
outside the timing); first_s: seconds from nothing open to the first sample (for object_copy_all
the whole copy).

decode_share is decode time over sample time; x_energon and x_same_work are a row's samples/s
over energon_loader's and energon_same_work's of the same dataset (above 1: faster). Times are the best of --repeats passes.

    python tools/bench/image_text_loader.py --json runs/bench/image_text_loader.json
    python tools/bench/image_text_loader.py --data my_energon_dataset --samples 2000
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

from megatron_slmoe.platform import apply_adaptor

apply_adaptor()
from megatron_slmoe.data.assets import asset_path
from megatron_slmoe.data.image import ImagePreprocessConfig, decode_image, preprocess_image
from megatron_slmoe.data.image_inputs import TiledImages
from megatron_slmoe.data.image_text import ImageTextDataset, collate_image_text, open_energon_split
from megatron_slmoe.data.image_text_prepare import ShardRecord, prepare_image_text
from megatron_slmoe.data.tokenizer import load_tokenizer
from megatron_slmoe.utils.atomic import write_json_atomic


def _chat_cooker():
    """Energon's cooker for crude chat samples (energon refuses a crude dataset without one):
    the json part and the images, as its decoder gives them."""
    from dataclasses import dataclass

    from megatron.energon import Cooker, Sample, basic_sample_keys, stateless

    from megatron_slmoe.data.image_text import IMAGE_EXTENSIONS

    @dataclass
    class ChatSample(Sample):
        json: dict
        images: list

    @stateless
    def cook_chat(crude: dict) -> ChatSample:
        names = sorted(k for k in crude if k.rsplit(".", 1)[-1] in IMAGE_EXTENSIONS)
        return ChatSample(**basic_sample_keys(crude), json=crude["json"],
                          images=[crude[k] for k in names])

    return Cooker(cook=cook_chat)


def _chat_task_encoder():
    """Energon's DefaultTaskEncoder with the chat cooker, images decoded by its default
    decoder."""
    from megatron.energon import DefaultTaskEncoder

    class ChatTaskEncoder(DefaultTaskEncoder):
        cookers = [_chat_cooker()]

    return ChatTaskEncoder()


def _same_work_task_encoder(preprocess: ImagePreprocessConfig, tokenizer, crude: bool):
    """Energon's loader doing the sample's work, written as an energon user writes it: images
    decoded to PIL by energon's decoder, then in ``encode_sample`` tiled and resized with pillow
    (the same grid, sizes and bicubic filter as ours), scaled and normalised with numpy, and
    the sample's text tokenised."""
    from dataclasses import dataclass

    from megatron.energon import DefaultTaskEncoder, Sample, SampleDecoder
    from PIL import Image

    from megatron_slmoe.data.image import tile_grid

    mean = np.asarray(preprocess.mean, dtype=np.float32)
    std = np.asarray(preprocess.std, dtype=np.float32)
    size = (preprocess.img_w, preprocess.img_h)

    def to_array(tile) -> np.ndarray:
        return ((np.asarray(tile, dtype=np.float32) / 255.0 - mean) / std).transpose(2, 0, 1)

    def pixels(image) -> torch.Tensor:
        image = image.convert("RGB")
        if preprocess.max_tiles == 1:
            tiles = [image.resize(size, Image.BICUBIC)]
        else:
            cols, rows = tile_grid(image.width, image.height, preprocess.max_tiles)
            grid = image.resize((cols * size[0], rows * size[1]), Image.BICUBIC)
            tiles = [grid.crop((c * size[0], r * size[1], (c + 1) * size[0], (r + 1) * size[1]))
                     for r in range(rows) for c in range(cols)]
            if preprocess.thumbnail:
                tiles.append(image.resize(size, Image.BICUBIC))
        return torch.from_numpy(np.stack([to_array(t) for t in tiles]))

    @dataclass
    class Encoded(Sample):
        pixels: torch.Tensor
        tokens: list

    class SameWork(DefaultTaskEncoder):
        decoder = SampleDecoder(image_decode="pil")
        cookers = [_chat_cooker()] if crude else []

        def encode_sample(self, sample):
            if crude:
                images = sample.images
                text = " ".join(m["content"] for m in sample.json["messages"])
            else:  # energon's VQASample
                images = [sample.image]
                text = f"{sample.context} {' '.join(sample.answers or [])}"
            return Encoded.derive_from(sample, pixels=torch.cat([pixels(i) for i in images]),
                                       tokens=tokenizer.encode(text))

        def batch(self, samples):
            return samples

    return SameWork()


def make_photos(folder: str, count: int, size=(640, 480), per_shard: int = 256,
                name: str = "photos") -> str:
    """An energon chat dataset of smooth-noise JPEGs (deterministic)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    records = []
    for i in range(count):
        coarse = rng.integers(0, 256, (size[1] // 16, size[0] // 16, 3), dtype=np.uint8)
        image = Image.fromarray(coarse).resize(size, Image.BICUBIC)
        noise = rng.integers(-12, 13, (size[1], size[0], 3))
        image = Image.fromarray(np.clip(np.asarray(image, dtype=np.int16) + noise, 0, 255)
                                .astype(np.uint8))
        out = io.BytesIO()
        image.save(out, format="JPEG", quality=90)
        records.append(ShardRecord({"id": str(i), "messages": [
            {"role": "user", "content": "<image>\nWhat is in this picture?"},
            {"role": "assistant", "content": "smooth coloured noise"}]}, [("jpg", out.getvalue())]))
    path = os.path.join(folder, name)
    prepare_image_text(path, {"train": records}, "chat", samples_per_shard=per_shard)
    return path


def make_shapes(folder: str) -> str:
    from megatron_slmoe.data.shapes import generate

    return generate(os.path.join(folder, "shapes"), captions=64, vqa_train=1024, vqa_eval=64)["vqa"]


def best_rate(fn, samples: int, repeats: int) -> float:
    """Samples per second of ``fn()`` processing ``samples`` samples, best of ``repeats``."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return samples / best


def bench_dataset(name: str, path: str, preprocess: ImagePreprocessConfig, patch: int,
                  args) -> list[dict]:
    """Rows of one dataset; ``patch``: the tower's patch size (image positions per tile)."""
    from megatron.energon import CrudeSample, WorkerConfig, get_loader, get_val_dataset

    tokenizer = load_tokenizer(asset_path("tokenizer.json"))
    tokens_per_tile = (preprocess.img_h // patch) * (preprocess.img_w // patch)
    dataset = ImageTextDataset(path, tokenizer, args.seq_length + preprocess.tiles_per_image
                               * tokens_per_tile,
                               images=TiledImages(preprocess, -200, tokens_per_tile),
                               shuffle=False)
    n = min(args.samples, dataset.records)
    factory, reader = open_energon_split(path, "train")
    raws = [reader[i] for i in range(n)]
    images = [bytes(v) for raw in raws for k, v in raw.items()
              if not k.startswith("__") and k.rsplit(".", 1)[-1] in ("png", "jpg")]

    crude = issubclass(getattr(factory, "__sample_type__", object), CrudeSample)
    encoder = {"task_encoder": _chat_task_encoder()} if crude else {}

    # Built once, outside the timing (as the sample rows' dataset is): rows time reading only.
    def energon(**task_encoder):
        return get_loader(get_val_dataset(
            path, split_part="train",
            worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
            batch_size=1, limit=n, **task_encoder))

    loader = energon(**encoder)
    same_work = energon(task_encoder=_same_work_task_encoder(preprocess, tokenizer, crude))

    def run(a_loader):
        count = sum(1 for _ in a_loader)
        if count != n:
            raise RuntimeError(f"energon's loader gave {count} samples, expected {n}")

    def energon_loader():
        run(loader)

    def energon_same_work():
        run(same_work)

    def read():
        for i in range(n):
            factory.load_sample(reader[i])

    def decode():
        for data in images:
            preprocess_image(decode_image(data), preprocess)

    def sample():
        for i in range(n):
            dataset[i]

    def sample_workers():
        loader = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, range(n)),
                                             batch_size=8, num_workers=2,
                                             collate_fn=collate_image_text)
        for _ in loader:
            pass

    rates = {"energon_loader": best_rate(energon_loader, n, args.repeats),
             "energon_same_work": best_rate(energon_same_work, n, args.repeats),
             "read": best_rate(read, n, args.repeats),
             "decode": best_rate(decode, n, args.repeats),
             "sample": best_rate(sample, n, args.repeats)}
    if args.workers:
        rates["sample_w2"] = best_rate(sample_workers, n, args.repeats)
    share = rates["sample"] / rates["decode"]  # decode seconds per sample over sample seconds
    return [{"dataset": name, "row": row, "samples": n, "samples_per_s": rate,
             "ms_per_sample": 1e3 / rate, "x_energon": rate / rates["energon_loader"],
             "x_same_work": rate / rates["energon_same_work"],
             "decode_share": share if row == "sample" else None,
             "tile": f"{preprocess.img_h}x{preprocess.img_w}",
             "tiles": preprocess.tiles_per_image} for row, rate in rates.items()]


def bench_object_store(name: str, path: str, preprocess: ImagePreprocessConfig, patch: int,
                       args, energon_rates: dict) -> list[dict]:
    """Rows ``object_cold`` / ``object_warm``: the dataset folder uploaded under an s3:// prefix
    of moto's S3 server on 127.0.0.1, read the way a run reads it (``node_view``: the metadata
    into the node cache, each shard when a sample of it is read, the next samples' shards in the
    background), through an empty cache and through the filled one; and ``object_copy_all``,
    the way runs read it before (every object into the cache first, then the folder), through an
    empty cache. samples/s over samples 2..n (downloads included), and the seconds from
    nothing open to the first sample (for object_copy_all the whole copy)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))))  # the repository root: its tests/helpers run the local S3 server
    from tests.helpers.s3_server import S3TestServer

    from megatron_slmoe.storage.config import StorageConfig
    from megatron_slmoe.storage.session import Storage
    from megatron_slmoe.training.tasks.image_text import node_view

    tokenizer = load_tokenizer(asset_path("tokenizer.json"))
    tokens_per_tile = (preprocess.img_h // patch) * (preprocess.img_w // patch)
    rows = []
    with S3TestServer() as server, tempfile.TemporaryDirectory() as caches:
        os.environ.update(server.env())
        server.client().create_bucket(Bucket="bench-images")
        server.upload_folder("bench-images", f"{name}/", path)
        url = f"s3://bench-images/{name}/"
        cache = os.path.join(caches, "cache")
        for row in ("object_copy_all", "object_cold", "object_warm"):
            if row != "object_warm" and os.path.isdir(cache):
                shutil.rmtree(cache)
            start = time.perf_counter()
            storage = Storage(StorageConfig(cache_dir=cache))
            if row == "object_copy_all":
                local, stored = storage.local_dir(url), None
            else:
                local, stored = node_view(storage, url)
            dataset = ImageTextDataset(local, tokenizer,
                                       args.seq_length + preprocess.tiles_per_image
                                       * tokens_per_tile,
                                       images=TiledImages(preprocess, -200, tokens_per_tile),
                                       shuffle=False, stored=stored)
            n = min(args.samples, dataset.records)
            dataset[0]
            first_done = time.perf_counter()
            for i in range(1, n):
                dataset[i]
            # Samples after the first, as the local rows time them (their dataset is opened
            # outside the timing); the opening and the first sample are first_sample_s.
            rate = (n - 1) / (time.perf_counter() - first_done)
            if stored is not None:
                stored.close()
            rows.append({"dataset": name, "row": row, "samples": n, "samples_per_s": rate,
                         "ms_per_sample": 1e3 / rate,
                         "x_energon": rate / energon_rates["energon_loader"],
                         "x_same_work": rate / energon_rates["energon_same_work"],
                         "decode_share": None, "tile": f"{preprocess.img_h}x{preprocess.img_w}",
                         "tiles": preprocess.tiles_per_image,
                         "first_sample_s": first_done - start,
                         "stored_records": dataset.records,
                         "bytes_from_store": server.get_bytes("/bench-images/")})
            server.reset_counts()
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'dataset':<14} {'row':<17} {'input':>9} {'tiles':>5} {'samples/s':>10} "
          f"{'ms/sample':>10} {'x_energon':>9} {'x_same_work':>11} {'decode_share':>12} "
          f"{'first_s':>8}")
    for r in rows:
        share = "" if r["decode_share"] is None else f"{r['decode_share']:.0%}"
        first = f"{r['first_sample_s']:.2f}" if "first_sample_s" in r else ""
        print(f"{r['dataset']:<14} {r['row']:<17} {r['tile']:>9} {r['tiles']:>5} "
              f"{r['samples_per_s']:>10.1f} {r['ms_per_sample']:>10.2f} {r['x_energon']:>9.2f} "
              f"{r['x_same_work']:>11.2f} {share:>12} {first:>8}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="an energon dataset folder to measure (split 'train') instead "
                                  "of the generated ones")
    p.add_argument("--samples", type=int, default=256, help="samples per pass (default 256)")
    p.add_argument("--repeats", type=int, default=3, help="passes per row; the best counts")
    p.add_argument("--seq-length", type=int, default=64, help="text positions per sample")
    p.add_argument("--no-workers", dest="workers", action="store_false",
                   help="skip the DataLoader row with worker processes")
    p.add_argument("--no-object-store", dest="object_store", action="store_false",
                   help="skip the object_cold / object_warm rows (a local S3 server)")
    p.add_argument("--stored-records", type=int, default=None,
                   help="records of the stored dataset of the object rows, 64 per shard "
                        "(default 16 x --samples)")
    p.add_argument("--json", metavar="FILE", help="write the rows as a JSON list")
    args = p.parse_args(argv)
    if args.object_store and args.samples < 2:
        p.error("the object rows time samples 2..n: --samples must be at least 2 (or "
                "--no-object-store)")
    if args.samples < 1 or args.repeats < 1:
        p.error("--samples and --repeats must be positive")
    if args.stored_records is None:
        args.stored_records = 16 * args.samples
    if args.stored_records < args.samples:
        p.error(f"--stored-records {args.stored_records} must be at least --samples "
                f"{args.samples}")
    if args.data and not os.path.isdir(os.path.join(args.data, ".nv-meta")):
        p.error(f"--data {args.data}: not an energon dataset folder")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        if args.data:
            datasets = [("data", args.data, ImagePreprocessConfig(img_h=336, img_w=336), 14)]
        else:
            photos = make_photos(folder, args.samples)
            datasets = [("shapes", make_shapes(folder), ImagePreprocessConfig(img_h=32, img_w=32),
                         16),
                        ("photos", photos, ImagePreprocessConfig(img_h=336, img_w=336), 14),
                        ("photos-tiled", photos, ImagePreprocessConfig(
                            img_h=336, img_w=336, max_tiles=4, thumbnail=True), 14)]
        for name, path, preprocess, patch in datasets:
            rows += bench_dataset(name, path, preprocess, patch, args)
            if args.object_store and name == "photos":
                # A stored dataset much larger than what is read, in smaller shards, as real
                # ones are: what streaming saves over copying everything first shows.
                stored = make_photos(folder, args.stored_records, per_shard=64,
                                     name="photos-stored")
                rates = {r["row"]: r["samples_per_s"] for r in rows if r["dataset"] == name}
                rows += bench_object_store(name, stored, preprocess, patch, args, rates)
    print(f"# image-text loader, one process ({os.cpu_count()} CPUs visible), torch "
          f"{torch.__version__}")
    print_rows(rows)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        write_json_atomic(args.json, rows, indent=1)
        print(f"# rows written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
