#!/usr/bin/env python
"""How long the training loop is blocked per checkpoint save: synchronous vs asynchronous
(Megatron-Core's async dist-checkpoint save; a forked writer per save, and the persistent writer).

Each mode is a real fine-tuning run of the entry point (``megatron_slmoe.training.finetune``)
under ``torchrun --nproc-per-node 2`` with EP=2, training every parameter of a model written for
the benchmark (so that the trainable state, weights and both Adam moments, is large enough to
matter: about 300 MB per job by default) and saving every ``--save-interval`` steps. The trainer
measures, per checkpoint, the time its loop waited (``summary.json``: ``checkpoint.
blocked_s_by_save``): the save call, plus the polls and the final wait that promoted it. The last
save of a run is left out (nothing trains after it). Ratios are against the synchronous run of the
same invocation.

    python tools/bench/checkpoint.py --json runs/bench/checkpoint.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = {
    "sync": ["--no-async-save"],
    "async": ["--async-save"],
    "async-persistent": ["--async-save", "--use-persistent-ckpt-worker"],
}

MODEL = """\
# checkpoint benchmark model: small compute, large trainable state
model:
  num_layers: 4
  moe_layer_freq: [0, 1, 1, 1]
  hidden_size: {hidden}
  ffn_hidden_size: {ffn}
  num_attention_heads: 8
  num_query_groups: 4
  kv_channels: {kv}
  normalization: RMSNorm
  gated_linear_unit: true
  add_bias_linear: false
  hidden_dropout: 0.0
  attention_dropout: 0.0
  init_method_std: 0.02
  num_moe_experts: {experts}
  moe_router_topk: 2
  moe_ffn_hidden_size: {ffn}
  moe_latent_size: {latent}
  moe_shared_expert_intermediate_size: {ffn}
  moe_router_score_function: sigmoid
  moe_router_load_balancing_type: aux_loss
  moe_aux_loss_coeff: 1.0e-3
  moe_router_dtype: fp32
  vocab_size: 512
  max_sequence_length: 128
  position_embedding_type: rope
slmoe: {{}}
"""


def _run(mode: str, flags: list[str], model: str, args, work: str) -> dict:
    out = os.path.join(work, mode)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megatron_slmoe.training.finetune", "--model-config", model,
           "--finetune-mode", "full", "--data-format", "pretrain", "--fp32",
           "--expert-model-parallel-size", "2", "--seq-length", "128", "--micro-batch-size", "2",
           "--global-batch-size", "8", "--train-iters", str(args.iters), "--save-interval",
           str(args.save_interval), "--eval-interval", "100000", "--eval-iters", "1",
           "--log-interval", str(args.iters), "--lr-warmup-iters", "0", "--no-tensorboard",
           "--memory-check", "off", "--heartbeat-timeout", "0", "--output-dir", out, *flags]
    start = time.perf_counter()
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": threads})
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{mode}: the run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    blocked = summary["checkpoint"]["blocked_s_by_save"]
    sizes = []
    for name in sorted(os.listdir(os.path.join(out, "checkpoints"))):
        if name.startswith("iter_"):
            path = os.path.join(out, "checkpoints", name)
            sizes.append(sum(os.path.getsize(os.path.join(b, f))
                             for b, _, files in os.walk(path) for f in files))
    mid_run = blocked[:-1]
    return {"mode": mode, "saves": len(blocked), "mid_run_saves": len(mid_run),
            "blocked_s_per_save": statistics.mean(mid_run),
            "blocked_s_first": mid_run[0], "blocked_s_later_mean": statistics.mean(mid_run[1:])
            if len(mid_run) > 1 else mid_run[0],
            "blocked_s_by_save": blocked, "checkpoint_bytes": max(sizes) if sizes else 0,
            "run_wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="write the results here")
    parser.add_argument("--iters", type=int, default=16)
    parser.add_argument("--save-interval", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = parser.parse_args()
    if "sync" not in args.modes:
        parser.error("the synchronous run is the baseline: keep 'sync' in --modes")
    if args.iters // args.save_interval < 3:
        parser.error("need at least three saves (two mid-run ones) per run")

    with tempfile.TemporaryDirectory(prefix="slmoe-bench-ckpt-") as work:
        model = os.path.join(work, "bench_ckpt.yaml")
        with open(model, "w", encoding="utf-8") as f:
            f.write(MODEL.format(hidden=args.hidden, ffn=2 * args.hidden, kv=args.hidden // 8,
                                 experts=args.experts, latent=args.hidden // 2))
        rows = [_run(mode, MODES[mode], model, args, work) for mode in args.modes]
    base = next(r for r in rows if r["mode"] == "sync")["blocked_s_per_save"]
    for row in rows:
        row["ratio_vs_sync"] = row["blocked_s_per_save"] / base
    machine = f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()}, load " \
              f"{os.getloadavg()[0]:.1f})"
    print(f"checkpoint save: loop blocked per mid-run save, 2 ranks EP=2, full fine-tune "
          f"({rows[0]['checkpoint_bytes'] / 2**20:.0f} MiB per checkpoint), {machine}")
    print(f"{'mode':<18}{'saves':>6}{'blocked s/save':>16}{'first':>9}{'later':>9}"
          f"{'vs sync':>9}")
    for r in rows:
        print(f"{r['mode']:<18}{r['mid_run_saves']:>6}{r['blocked_s_per_save']:>16.3f}"
              f"{r['blocked_s_first']:>9.3f}{r['blocked_s_later_mean']:>9.3f}"
              f"{r['ratio_vs_sync']:>9.3f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    from megatron_slmoe.utils.atomic import write_json_atomic

    write_json_atomic(args.json, {"benchmark": "checkpoint", "machine": machine,
                                  "settings": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
