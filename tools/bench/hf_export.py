"""Benchmark: peak host memory and time of exporting an adapter to Hugging Face form, streamed one
tensor at a time (``megatron_slmoe.hf.merged_export`` / ``peft_export``) against the baseline of
holding everything (every shard and the adapter loaded, merged, saved with ``save_file``), in one
run:

    python tools/bench/hf_export.py --json runs/bench/hf_export.json

It writes a Qwen3-MoE checkpoint with many experts (bf16, indexed shards; ``hf_load.py``'s) and a
megatron_slmoe adapter of random factors on attention, dense MLP and every expert, then runs each
method in a fresh process that reports its resident memory before exporting and its peak while
exporting (``VmHWM``, reset just before). The merged outputs of both methods must be equal
(checksum) before any figure is printed. Prints a table and writes JSON rows with the ratio
baseline / streaming of the peak above the starting memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_load import _peak_rss, _reset_peak_rss, _rss, write_checkpoint  # noqa: E402

METHODS = ("merged_streaming", "merged_whole", "peft_streaming", "peft_whole")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--expert-ffn", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--shard-mb", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--measure", choices=METHODS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def write_adapter(args, hf_dir: str, directory: str) -> int:
    """A megatron_slmoe adapter with random A and B on every module the default targets adapt."""
    import torch
    from safetensors.torch import save_file

    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.hf.loader import open_hf_checkpoint
    from megatron_slmoe.lora.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config_json

    t = open_hf_checkpoint(hf_dir, check_shapes=False).model_config.transformer
    d, r, gen = args.hidden, args.rank, torch.Generator().manual_seed(1)
    qkv = (t["num_attention_heads"] + 2 * t["num_query_groups"]) * t["kv_channels"]
    shapes = {}
    for layer in range(args.layers):
        p = f"decoder.layers.{layer}"
        attention_width = t["num_attention_heads"] * t["kv_channels"]
        modules = {f"{p}.self_attention.linear_qkv": (qkv, d),
                   f"{p}.self_attention.linear_proj": (d, attention_width)}
        if layer == 0:
            modules.update({f"{p}.mlp.linear_fc1": (8 * d, d), f"{p}.mlp.linear_fc2": (d, 4 * d)})
        else:
            for e in range(args.experts):
                modules.update({f"{p}.mlp.experts.{e}.linear_fc1": (2 * args.expert_ffn, d),
                                f"{p}.mlp.experts.{e}.linear_fc2": (d, args.expert_ffn)})
        for module, (out, inp) in modules.items():
            shapes[f"{module}.lora_A.weight"] = (r, inp)
            shapes[f"{module}.lora_B.weight"] = (out, r)
    tensors = {k: torch.randn(s, generator=gen) * 0.01 for k, s in shapes.items()}
    os.makedirs(directory)
    save_file(tensors, os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(directory, ADAPTER_CONFIG), "w") as f:
        f.write(adapter_config_json(LoRAConfig(rank=r, alpha=2.0 * r)))
    return sum(v.nbytes for v in tensors.values())


def _merged_whole(adapter: str, hf_dir: str, out: str) -> None:
    """The baseline: every shard and the adapter in memory, merged, one save_file."""
    import torch
    from safetensors.torch import load_file, save_file

    from megatron_slmoe.hf.loader import open_hf_checkpoint
    from megatron_slmoe.hf.lora_mapping import hf_loras, megatron_lora_modules
    from megatron_slmoe.lora.adapter import ADAPTER_WEIGHTS, read_adapter_config

    hf = open_hf_checkpoint(hf_dir, check_shapes=False)
    weights = {}
    for name in sorted({info.file for info in hf.checkpoint.tensors.values()}):
        weights.update(load_file(os.path.join(hf_dir, name)))
    lora = load_file(os.path.join(adapter, ADAPTER_WEIGHTS))
    scaling = read_adapter_config(adapter)[0].scaling
    table = hf.family.table(hf.model_config)
    for module in megatron_lora_modules(lora):
        a, b = lora[f"{module}.lora_A.weight"], lora[f"{module}.lora_B.weight"]
        for target in hf_loras(table, module, b.shape[0], a.shape[1], hf.family.name):
            rows = torch.empty(target.out_features, b.shape[1])
            for row in target.rows:
                rows[row.hf[0]:row.hf[1]] = b[row.megatron[0]:row.megatron[1]]
            w = weights[target.hf_weight]
            weights[target.hf_weight] = (w.float() + scaling * (rows @ a)).to(w.dtype)
    os.makedirs(out)
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


def _peft_whole(adapter: str, out: str) -> None:
    """The baseline of a PEFT export: the adapter read whole, renamed, one save_file."""
    from safetensors.torch import load_file, save_file

    from megatron_slmoe.lora.adapter import ADAPTER_WEIGHTS

    tensors = load_file(os.path.join(adapter, ADAPTER_WEIGHTS))
    os.makedirs(out)
    save_file({f"base_model.model.{k}": v for k, v in tensors.items()},
              os.path.join(out, "adapter_model.safetensors"))


def measure(method: str, work: str) -> dict:
    import megatron_slmoe  # noqa: F401  (as the tool imports it)
    from megatron_slmoe.hf.merged_export import export_merged
    from megatron_slmoe.hf.peft_export import export_peft_adapter

    adapter, hf_dir, out = (os.path.join(work, n) for n in ("adapter", "hf", method))
    # Every method's libraries are imported before the start, so the peak is the export's own.
    import peft  # noqa: F401
    import safetensors.torch  # noqa: F401
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401
    before = _rss()
    _reset_peak_rss()
    start = time.perf_counter()
    if method == "merged_streaming":
        export_merged(adapter, hf_dir, out, max_shard_bytes=64 * 2**20)
    elif method == "merged_whole":
        _merged_whole(adapter, hf_dir, out)
    elif method == "peft_streaming":
        export_peft_adapter(adapter, hf_dir, out, layout="per-expert")
    else:
        _peft_whole(adapter, out)
    seconds = time.perf_counter() - start
    return {"method": method, "seconds": seconds, "rss_before": before, "peak": _peak_rss()}


def _checksum(directory: str) -> float:
    from safetensors import safe_open

    total = 0.0
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as f:
                total += sum(float(f.get_tensor(k).double().sum()) for k in f.keys())
    return total


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.workdir)))
        return 0
    work = args.workdir or tempfile.mkdtemp(prefix="hf_export_bench.")
    try:
        model_bytes = write_checkpoint(args, os.path.join(work, "hf"))
        adapter_bytes = write_adapter(args, os.path.join(work, "hf"), os.path.join(work, "adapter"))
        rows = []
        for method in METHODS:
            proc = subprocess.run([sys.executable, __file__, "--measure", method,
                                   "--workdir", work], capture_output=True, text=True, check=True)
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        merged = {m: _checksum(os.path.join(work, m)) for m in ("merged_streaming", "merged_whole")}
        if abs(merged["merged_streaming"] - merged["merged_whole"]) > 1e-6 * abs(
                merged["merged_whole"]) + 1e-3:
            raise SystemExit(f"merged outputs differ: {merged}")
        by = {r["method"]: r for r in rows}
        print(f"model {model_bytes / 2**20:.0f} MiB (bf16, {args.experts} experts x "
              f"{args.layers - 1} MoE layers), adapter {adapter_bytes / 2**20:.1f} MiB (fp32, r="
              f"{args.rank})")
        print(f"{'method':<18}{'seconds':>9}{'peak - start MiB':>18}{'ratio whole/stream':>20}")
        for r in rows:
            base = by[r["method"].split("_")[0] + "_streaming"]
            r["peak_above_start"] = r["peak"] - r["rss_before"]
            ratio = (r["peak"] - r["rss_before"]) / max(1, base["peak"] - base["rss_before"])
            r["ratio_to_streaming"] = ratio
            r.update(model_bytes=model_bytes, adapter_bytes=adapter_bytes)
            print(f"{r['method']:<18}{r['seconds']:>9.2f}{r['peak_above_start'] / 2**20:>18.0f}"
                  f"{ratio:>20.2f}")
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
