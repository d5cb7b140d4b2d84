"""Benchmark the data path from object storage through the node cache, against local disk.

Three sources, in one run, over the same sharded token dataset (``--shards`` files of uint16
tokens, ``seq_length + 1`` per sample, as Megatron's ``.bin`` files hold them):

  local        the shards on local disk (the baseline every ratio is taken against)
  object_cold  the shards on an S3 endpoint, through an empty node cache
  object_warm  the same, through the cache the cold pass filled (entries older than
               --cache-revalidate-seconds are checked with one HEAD per shard and node)

Each source is measured twice per repeat (``--repeats``, sources interleaved, medians shown), with
``--ranks`` real processes on this node sharing one cache:

* a read pass: every rank streams the shards in order (the next ``--prefetch-shards`` downloading
  in the background) and reads its share of the samples; samples/s over all ranks, and the body
  bytes the server sent (bytes fetched per node, counted on the server side);
* a short training run: every rank trains a small transformer language model (torch, real
  forward/backward/AdamW steps) on the streamed samples; the share of step time spent waiting for
  the next batch (data_wait_share).

The endpoint is moto's S3 server on 127.0.0.1 (tests/helpers/s3_server.py) unless ``--url`` names
a prefix on a real one (credentials and endpoint from the environment, as for a run); an
optional ``--bandwidth-mbps`` throttles the local server to a network-like rate.

    python tools/bench/data_pipeline.py --json runs/bench/data_pipeline.json
    python tools/bench/data_pipeline.py --shards 32 --shard-mb 16 --bandwidth-mbps 400
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

VOCAB = 4096
SOURCES = ("local", "object_cold", "object_warm")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--shard-mb", type=float, default=4.0)
    p.add_argument("--ranks", type=int, default=2, help="processes on this node (one cache)")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--train-steps", type=int, default=30, help="steps of the training run per rank")
    p.add_argument("--prefetch-shards", type=int, default=2)
    p.add_argument("--bandwidth-mbps", type=float, default=None,
                   help="throttle the local S3 server's GET bodies to this many MB/s")
    p.add_argument("--url", default=None,
                   help="s3:// or msc:// prefix of a real endpoint to upload the dataset to "
                        "(default: moto's server on 127.0.0.1)")
    p.add_argument("--repeats", type=int, default=3,
                   help="measurements per source (interleaved); the table shows medians")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    for name in ("shards", "ranks", "seq_length", "micro_batch_size", "train_steps", "repeats"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.shard_mb <= 0 or (args.bandwidth_mbps is not None and args.bandwidth_mbps <= 0):
        p.error("--shard-mb and --bandwidth-mbps must be positive")
    return args


# --- one rank -------------------------------------------------------------------------------------


def _shard_paths(storage, shards):
    """Local paths of the shards in order (objects through the prefetcher) and the prefetcher."""
    if not shards[0].startswith(("s3://", "msc://")):
        return iter(shards), None
    prefetcher = storage.prefetcher(shards)
    return iter(prefetcher), prefetcher


def _samples(storage, shards, seq_length, rank, world):
    """This rank's samples (int64 [seq_length + 1]) in shard order."""
    paths, prefetcher = _shard_paths(storage, shards)
    try:
        for path in paths:
            rows = np.memmap(path, dtype=np.uint16, mode="r").reshape(-1, seq_length + 1)
            for i in range(rank, rows.shape[0], world):
                yield np.asarray(rows[i], dtype=np.int64)
    finally:
        if prefetcher is not None:
            prefetcher.close()


def _read_pass(storage, spec, rank, world) -> dict:
    count, checksum = 0, 0
    for sample in _samples(storage, spec["shards"], spec["seq_length"], rank, world):
        count += 1
        checksum += int(sample[0])
    return {"samples": count, "checksum": checksum}


def _train_pass(storage, spec, rank, world) -> dict:
    import torch

    torch.manual_seed(rank)
    d = 128
    model = torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, d),
        torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(
            d, 4, 4 * d, dropout=0.0, batch_first=True), num_layers=2),
        torch.nn.Linear(d, VOCAB))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(spec["seq_length"])
    samples = _samples(storage, spec["shards"], spec["seq_length"], rank, world)
    wait = total = 0.0
    steps = 0
    for _ in range(spec["train_steps"]):
        start = time.perf_counter()
        batch = [next(samples, None) for _ in range(spec["micro_batch_size"])]
        if batch[-1] is None:
            break
        tokens = torch.from_numpy(np.stack(batch))
        got = time.perf_counter()
        hidden = model[1](model[0](tokens[:, :-1]), mask=mask, is_causal=True)
        loss = torch.nn.functional.cross_entropy(model[2](hidden).flatten(0, 1),
                                                 tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        wait += got - start
        total += time.perf_counter() - start
        steps += 1
    samples.close()
    return {"steps": steps, "wait_s": wait, "step_s": total}


def _rank(rank: int, world: int, spec: dict, barrier, results) -> None:
    os.environ.update(spec["env"])
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank))
    try:
        import torch

        torch.set_num_threads(1)
        from megatron_slmoe.storage.config import StorageConfig
        from megatron_slmoe.storage import Storage

        storage = Storage(StorageConfig(cache_dir=spec["cache_dir"], cache_max_gb=spec["cache_gb"],
                                        prefetch_shards=spec["prefetch"]))
        if spec["shards"][0].startswith(("s3://", "msc://")):
            storage.store.connect(spec["shards"][0])  # once per process, as a run does at start
        barrier.wait()  # imports and client set-up done: time the data path only
        start = time.perf_counter()
        result = (_read_pass if spec["mode"] == "read" else _train_pass)(storage, spec, rank, world)
        result["elapsed_s"] = time.perf_counter() - start
        # The client's count, for endpoints whose server side cannot be asked (--url)
        result["bytes_downloaded"] = storage.cache.stats.bytes_downloaded \
            if storage.cache_in_use else 0
        results.put((rank, result))
    except BaseException as err:  # the parent reports it
        results.put((rank, {"error": f"{type(err).__name__}: {err}"}))
        barrier.abort()


def _run_ranks(spec: dict, world: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, spec, barrier, results)) for r in range(world)]
    for proc in procs:
        proc.start()
    out = dict(results.get(timeout=1800) for _ in procs)
    for proc in procs:
        proc.join()
    errors = [f"rank {r}: {res['error']}" for r, res in out.items() if "error" in res]
    if errors:
        raise SystemExit("error: " + "; ".join(errors))
    return [out[r] for r in range(world)]


# --- the dataset ----------------------------------------------------------------------------------


def _measure(source: str, repeat: int, base: dict, local: list, objects: list, warm_cache: str,
             work: str, server, ranks: int) -> dict:
    """One read pass and one training run of ``source`` (see the module doc)."""
    row = {}
    for mode in ("read", "train"):
        if source == "object_cold":  # an empty cache for each pass; the first read fills warm_cache
            first = repeat == 0 and mode == "read"
            cache_dir = warm_cache if first else os.path.join(work, f"cache-cold-{repeat}-{mode}")
        else:
            cache_dir = warm_cache
        spec = dict(base, mode=mode, cache_dir=cache_dir,
                    shards=local if source == "local" else objects)
        before = server.get_bytes("/bench-data/") if server else 0
        results = _run_ranks(spec, ranks)
        fetched = server.get_bytes("/bench-data/") - before if server else \
            sum(r["bytes_downloaded"] for r in results)
        if mode == "read":
            samples = sum(r["samples"] for r in results)
            row.update(samples=samples,
                       samples_per_s=samples / max(r["elapsed_s"] for r in results),
                       bytes_fetched_per_node=fetched)
        else:
            step = sum(r["step_s"] for r in results)
            steps = sum(r["steps"] for r in results)
            row.update(data_wait_share=sum(r["wait_s"] for r in results) / step,
                       step_ms=1e3 * step / max(steps, 1), train_bytes_fetched_per_node=fetched)
    return row


def _write_dataset(directory: str, args) -> list[str]:
    rng = np.random.default_rng(0)
    rows = max(1, int(args.shard_mb * 2**20) // (2 * (args.seq_length + 1)))
    paths = []
    for i in range(args.shards):
        path = os.path.join(directory, f"shard-{i:05d}.bin")
        rng.integers(0, VOCAB, size=(rows, args.seq_length + 1), dtype=np.uint16).tofile(path)
        paths.append(path)
    return paths


def main(argv=None) -> int:
    args = parse_args(argv)
    work = tempfile.mkdtemp(prefix="slmoe-bench-data-")
    server = None
    try:
        from megatron_slmoe.storage import StorageError
        from megatron_slmoe.storage.client import ObjectStore
        from megatron_slmoe.storage.retry import RetryPolicy
        from megatron_slmoe.storage.urls import parse_url

        os.makedirs(os.path.join(work, "local"))
        local = _write_dataset(os.path.join(work, "local"), args)
        dataset_bytes = sum(os.path.getsize(p) for p in local)
        if args.url:
            prefix, env = parse_url(args.url).as_prefix(), {}
            endpoint = "from the environment"
        else:
            from tests.helpers.s3_server import S3TestServer

            server = S3TestServer().start()
            server.client().create_bucket(Bucket="bench-data")
            prefix, env = parse_url("s3://bench-data/tokens/"), server.env()
            endpoint = server.endpoint
            os.environ.update(env)
        store = ObjectStore(RetryPolicy(600.0))
        objects = []
        for path in local:
            url = prefix.join(os.path.basename(path))
            store.upload(path, url)
            objects.append(str(url))
        if server is not None and args.bandwidth_mbps:
            server.throttle(args.bandwidth_mbps * 1e6, path_contains="/tokens/")

        base = {"seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size,
                "train_steps": args.train_steps, "prefetch": args.prefetch_shards, "env": env,
                "cache_gb": 2 * dataset_bytes / 2**30 + 0.01}
        warm_cache = os.path.join(work, "cache-warm")
        runs = {source: [] for source in SOURCES}
        for repeat in range(args.repeats):  # sources interleaved: a busy spell hits them all
            for source in SOURCES:
                runs[source].append(_measure(source, repeat, base, local, objects, warm_cache,
                                             work, server, args.ranks))
        rows = [{"source": source, "dataset_bytes": dataset_bytes, "repeats": args.repeats,
                 **{key: statistics.median(run[key] for run in runs[source])
                    for key in runs[source][0]}} for source in SOURCES]
        baseline = rows[0]
        for row in rows:
            row["x_local_samples_per_s"] = row["samples_per_s"] / baseline["samples_per_s"]
            row["step_ms_over_local"] = row["step_ms"] / baseline["step_ms"]
    except StorageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"data pipeline: {args.shards} shards x {args.shard_mb:g} MB ({dataset_bytes / 1e6:.1f} MB), "
          f"{args.ranks} ranks on one node, prefetch {args.prefetch_shards}, endpoint {endpoint}"
          + (f" throttled to {args.bandwidth_mbps:g} MB/s" if args.bandwidth_mbps else ""))
    header = (f"{'source':<12} {'samples/s':>10} {'x local':>8} {'fetched/node MB':>16} "
              f"{'dataset MB':>11} {'wait share':>11} {'step ms':>8} {'/ local':>8}")
    print(header)
    print("-" * len(header))
    for row in rows:
        fetched = row["bytes_fetched_per_node"]
        print(f"{row['source']:<12} {row['samples_per_s']:>10.0f} {row['x_local_samples_per_s']:>8.2f} "
              f"{(fetched or 0) / 1e6:>16.1f} {row['dataset_bytes'] / 1e6:>11.1f} "
              f"{row['data_wait_share']:>11.1%} {row['step_ms']:>8.1f} {row['step_ms_over_local']:>8.2f}")
    if args.json:
        from megatron_slmoe.utils.atomic import write_json_atomic

        report = {"benchmark": "data_pipeline", "machine": {
            "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
            "config": {k: v for k, v in vars(args).items() if k != "json"}, "endpoint": endpoint,
            "rows": rows}
        write_json_atomic(args.json, report)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
