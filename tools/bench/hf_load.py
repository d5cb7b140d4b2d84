"""Benchmark: load time and peak host memory per rank of importing a Hugging Face MoE checkpoint,
streaming and rank-local (``megatron_slmoe.hf.load_hf_weights``) against the baseline of loading
every shard on every rank (``safetensors.torch.load_file`` of each shard, then the same copy into
the model), in one run:

    python tools/bench/hf_load.py --ranks 2 --json runs/bench/hf_load.json

It writes a Qwen3-MoE checkpoint with many experts (bf16, a few hundred MB, per-expert keys in
indexed shards, as transformers saves them) under ``--workdir`` (default: a temporary directory in
/tmp, removed afterwards), then for each method spawns ``--ranks`` gloo processes with expert
parallelism over all of them. Each rank builds its bf16 shard of the Megatron model, loads, and
reports its resident memory before loading, its peak while loading (``VmHWM``, reset just
before; file pages mapped by safetensors count too) and the time. Both methods must fill the ranks' models identically (a
checksum per rank is compared) before any figure is printed. Prints a table and writes JSON rows
with the ratios baseline / streaming.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from datetime import timedelta

METHODS = ("streaming", "every_shard")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="processes (= expert parallel size)")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--expert-ffn", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--shard-mb", type=int, default=100, help="size of a checkpoint shard")
    parser.add_argument("--workdir", default=None, help="where to write the checkpoint")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.experts % args.ranks:
        parser.error(f"--experts {args.experts} must be divisible by --ranks {args.ranks}")
    return args


# --- the checkpoint --------------------------------------------------------------------------------


def write_checkpoint(args, directory: str) -> int:
    """A Qwen3-MoE checkpoint of random bf16 weights in shards of about --shard-mb, with an
    index; returns its size in bytes. Tensors are drawn one at a time (never the whole model)."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    heads, kv_heads, head_dim = 8, 4, args.hidden // 8
    config = Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.expert_ffn, num_hidden_layers=args.layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        num_experts=args.experts, num_experts_per_tok=8, mlp_only_layers=[0],
        max_position_embeddings=4096, norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])
    config.save_pretrained(directory)
    shapes = {"model.embed_tokens.weight": (args.vocab, args.hidden),
              "lm_head.weight": (args.vocab, args.hidden), "model.norm.weight": (args.hidden,)}
    for layer in range(args.layers):
        p = f"model.layers.{layer}"
        shapes.update({
            f"{p}.input_layernorm.weight": (args.hidden,),
            f"{p}.post_attention_layernorm.weight": (args.hidden,),
            f"{p}.self_attn.q_proj.weight": (heads * head_dim, args.hidden),
            f"{p}.self_attn.k_proj.weight": (kv_heads * head_dim, args.hidden),
            f"{p}.self_attn.v_proj.weight": (kv_heads * head_dim, args.hidden),
            f"{p}.self_attn.o_proj.weight": (args.hidden, heads * head_dim),
            f"{p}.self_attn.q_norm.weight": (head_dim,), f"{p}.self_attn.k_norm.weight": (head_dim,),
        })
        if layer == 0:
            for proj, shape in (("gate_proj", (4 * args.hidden, args.hidden)),
                                ("up_proj", (4 * args.hidden, args.hidden)),
                                ("down_proj", (args.hidden, 4 * args.hidden))):
                shapes[f"{p}.mlp.{proj}.weight"] = shape
            continue
        shapes[f"{p}.mlp.gate.weight"] = (args.experts, args.hidden)
        for e in range(args.experts):
            shapes[f"{p}.mlp.experts.{e}.gate_proj.weight"] = (args.expert_ffn, args.hidden)
            shapes[f"{p}.mlp.experts.{e}.up_proj.weight"] = (args.expert_ffn, args.hidden)
            shapes[f"{p}.mlp.experts.{e}.down_proj.weight"] = (args.hidden, args.expert_ffn)
    gen = torch.Generator().manual_seed(0)
    limit, shards, current, size, total = args.shard_mb * 2**20, [], {}, 0, 0
    for key, shape in shapes.items():
        tensor = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if current and size + tensor.nbytes > limit:
            shards.append(current)
            current, size = {}, 0
        current[key] = tensor
        size += tensor.nbytes
        total += tensor.nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


# --- one rank ------------------------------------------------------------------------------------


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _reset_peak_rss() -> None:
    """Start the peak over from the current resident size (Linux: clear_refs 5 resets VmHWM), so
    the peak is the load's, not that of imports or model construction before it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status")


def _load_every_shard(model, hf) -> None:
    """The baseline: every shard read whole into this process, then the rank's slices copied
    out of memory (the same plan as the streaming import, so only the reading differs)."""
    import torch
    from safetensors.torch import load_file

    from megatron_slmoe.hf.loader import plan_reads

    state = {}
    for name in sorted({info.file for info in hf.checkpoint.tensors.values()}):
        state.update(load_file(os.path.join(hf.checkpoint.directory, name)))
    with torch.no_grad():
        for stored, index, overlap, local in plan_reads([model], hf):
            overlap.to_megatron(state[stored][index], local)


def _rank(rank: int, world: int, port: int, method: str, hf_dir: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)
    import megatron_slmoe
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_slmoe.hf.convert import build_model_in_layout
    from megatron_slmoe.hf.loader import load_hf_weights, open_hf_checkpoint

    torch.distributed.init_process_group(megatron_slmoe.PLATFORM.backend, rank=rank,
                                         world_size=world, timeout=timedelta(minutes=30))
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(0)
    hf = open_hf_checkpoint(hf_dir, check_shapes=False)
    model, _ = build_model_in_layout(hf.model_config, params_dtype=torch.bfloat16)
    shard_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()
                      if torch.is_tensor(t))
    _reset_peak_rss()
    rss_before, start = _rss(), time.perf_counter()
    if method == "streaming":
        load_hf_weights([model], hf_dir, hf)
    else:
        _load_every_shard(model, hf)
    seconds, peak = time.perf_counter() - start, _peak_rss()
    checksum = sum(float(t.double().sum()) for t in model.state_dict().values()
                   if torch.is_tensor(t) and t.is_floating_point())
    record = dict(method=method, rank=rank, seconds=seconds, shard_bytes=shard_bytes,
                  rss_before_load=rss_before, peak_rss=peak, checksum=checksum)
    with open(os.path.join(out_dir, f"{method}-{rank}.json"), "w") as f:
        json.dump(record, f)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def run_method(method: str, ranks: int, hf_dir: str, out_dir: str) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, ranks, port, method, hf_dir, out_dir))
             for r in range(ranks)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    records = []
    for rank, proc in enumerate(procs):
        path = os.path.join(out_dir, f"{method}-{rank}.json")
        if proc.exitcode != 0 or not os.path.exists(path):
            raise SystemExit(f"error: {method} rank {rank} failed (exit code {proc.exitcode})")
        with open(path) as f:
            records.append(json.load(f))
    return records


# --- the run -------------------------------------------------------------------------------------


def _mb(n: float) -> str:
    return f"{n / 2**20:.0f}"


def print_table(rows: list[dict], checkpoint_bytes: int) -> None:
    print(f"checkpoint: {_mb(checkpoint_bytes)} MB bf16; per rank:")
    header = ("method", "rank", "shard MB", "RSS before MB", "peak RSS MB", "load +MB", "seconds")
    print(" | ".join(f"{h:>13}" for h in header))
    for r in rows:
        cells = (r["method"], r["rank"], _mb(r["shard_bytes"]), _mb(r["rss_before_load"]),
                 _mb(r["peak_rss"]), _mb(r["peak_rss"] - r["rss_before_load"]),
                 f"{r['seconds']:.2f}")
        print(" | ".join(f"{c:>13}" for c in map(str, cells)))


def main(argv=None) -> int:
    args = parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="slmoe-hf-load-", dir="/tmp")
    hf_dir = os.path.join(workdir, "checkpoint")
    os.makedirs(hf_dir, exist_ok=True)
    try:
        from megatron_slmoe.platform import apply_adaptor

        apply_adaptor()  # before transformers is imported
        from megatron_slmoe.hf.loader import open_hf_checkpoint

        checkpoint_bytes = write_checkpoint(args, hf_dir)
        open_hf_checkpoint(hf_dir)  # every tensor against config.json, once, before timing
        records = {m: run_method(m, args.ranks, hf_dir, workdir) for m in METHODS}
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    for a, b in zip(records["streaming"], records["every_shard"]):
        if abs(a["checksum"] - b["checksum"]) > 1e-6 * max(1.0, abs(b["checksum"])):
            print(f"error: rank {a['rank']}: the methods loaded different weights", file=sys.stderr)
            return 1
    rows = records["streaming"] + records["every_shard"]
    print_table(rows, checkpoint_bytes)
    summary = []
    for a, b in zip(records["streaming"], records["every_shard"]):
        summary.append(dict(
            rank=a["rank"],
            peak_rss_ratio=b["peak_rss"] / a["peak_rss"],
            load_overhead_ratio=((b["peak_rss"] - b["rss_before_load"])
                                 / max(1, a["peak_rss"] - a["rss_before_load"])),
            time_ratio=b["seconds"] / a["seconds"]))
        print(f"rank {a['rank']}: every-shard / streaming: peak RSS x{summary[-1]['peak_rss_ratio']:.2f}, "
              f"memory added by loading x{summary[-1]['load_overhead_ratio']:.1f}, "
              f"time x{summary[-1]['time_ratio']:.2f}")
    if args.json:
        from megatron_slmoe.utils.atomic import write_json_atomic

        write_json_atomic(args.json, {"checkpoint_bytes": checkpoint_bytes, "ranks": args.ranks,
                                      "experts": args.experts, "rows": rows, "ratios": summary})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
