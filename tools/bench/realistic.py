#!/usr/bin/env python
"""Realistic shapes on one machine: a Qwen3-30B-A3B-shaped checkpoint fine-tuned with LoRA by this
engine and by transformers + PEFT, the OOM checklist against the memory planner, and the fused
LoRA expert op against the dense-GEMM limit, in one run.

The checkpoint has the real layer (hidden 2048, 128 experts of 768, top-8, GQA 32/4 with head 128,
vocabulary 151,936) and fewer layers (``--layers``, default 2: 1.9 B parameters), random weights
(``slmoe-make-hf-checkpoint``). ``--preset deepseek-v3``: DeepSeek-V3's layer (MLA, experts
7168x2048, a shared expert, grouped top-8) scaled to fit (``DEEPSEEK_V3``). Every system trains the same packed rows of the shipped digits
task (the checkpoint's ChatML tokenizer), LoRA rank 16 on attention and the routed experts, Adam,
fp32, ``--seq-length`` 1024, global batch 2.

- ``slmoe`` rows: ``slmoe-finetune --hf-checkpoint`` under torchrun, 2 processes of one thread
  each, one row per lever of the OOM checklist (EP=2; selective / full recomputation; the
  distributed optimizer; TP=2 instead of EP for the experts; full fine-tuning where the planner says
  it fits). Per rank: peak live tensor bytes of a step (the CPU stand-in for max_memory_allocated;
  the planner predicts the same quantity, its CPU framework overhead measured in the first row),
  the process's peak resident memory after the rank-local import against the bytes of the
  parameters the rank holds, tokens/s over the steps after the first, MFU (model FLOPs,
  ``plan.flops``, over the measured peak GEMM rate of the ranks' threads) and, for the first row,
  each stage's share of a step. Megatron-Core's FSDP (ZeRO-3) does not run on a CPU: the row says
  why, and the planner's estimate of it stands in.
- ``peft`` row: transformers 5 + PEFT in one process with both threads (``target_modules`` on
  q/k/v/o, ``target_parameters`` on the fused experts: PEFT materialises W + s B A of every expert
  each forward), same rows, AdamW. Ratios: slmoe over peft (tokens/s; memory per token).
- ``kernel`` rows: the fused LoRA expert op at 2048x768 and 768x2048 with 16-512 rows per expert
  (64 local experts, rank 16), forward and forward+backward, against one dense GEMM of the same
  base FLOPs (the limit on this CPU) and against a base GEMM per expert plus separate LoRA.
- ``layer`` rows: this engine's MoE layer against Megatron-Core's MoELayer with per-expert LoRA
  (``lora_step.py``) at the checkpoint's layer shape.

    python tools/bench/realistic.py --json runs/bench/realistic.json      # about an hour
    python tools/bench/realistic.py --quick --json /tmp/realistic.json    # scaled down: CI
    python tools/bench/realistic.py --preset deepseek-v3 --levers ep2 \
        --json runs/bench/realistic_deepseek_v3.json

Give the load average beside the figures: the runs use both cores.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from measured_run import read_ranks  # a sibling: tools/bench is the script's folder

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

REAL = dict(preset="qwen3-30b-a3b", layers=2, overrides=[], seq=1024, steps=6,
            kernel_rows=(16, 128, 512), kernel_shapes=((2048, 768), (768, 2048)),
            kernel_experts=64)
QUICK = dict(preset="qwen3-30b-a3b", layers=2, seq=128, steps=4,
             overrides=["hidden_size=256", "num_experts=8", "moe_intermediate_size=64",
                        "vocab_size=4096", "num_attention_heads=4", "num_key_value_heads=2",
                        "head_dim=64", "intermediate_size=512"],
             kernel_rows=(16, 64), kernel_shapes=((256, 64), (64, 256)), kernel_experts=8)
DEEPSEEK_V3 = dict(
    preset="deepseek-v3", layers=1, seq=1024, steps=4,
    # The real layer (MLA, experts 7168x2048, shared expert, top-8 of 4 groups out of 8) with 32
    # routed experts instead of 256 and a 32,768-entry vocabulary instead of 129,280: the 7168-wide
    # embedding and output layer are replicated on every rank and would not fit twice in 24 GiB.
    overrides=["n_routed_experts=32", "first_k_dense_replace=0", "vocab_size=32768"],
    kernel_rows=(16, 128, 512), kernel_shapes=((7168, 2048), (2048, 7168)), kernel_experts=16)
PRESET_SHAPES = {"qwen3-30b-a3b": REAL, "deepseek-v3": DEEPSEEK_V3}
PEFT_TARGETS = {  # preset -> PEFT's target_modules on the attention (the experts: fused 3D)
    "qwen3-30b-a3b": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "deepseek-v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
}
LORA = ["--lora-rank", "16", "--lora-alpha", "32", "--lora-target-modules", "linear_qkv",
        "linear_proj", "linear_fc1", "linear_fc2"]
GLOBAL_BATCH = 2
LEVERS = {  # name -> (flags, RunSettings fields)
    "ep2": (["--expert-model-parallel-size", "2"], dict(ep=2, dp=2)),
    "ep2-selective": (["--expert-model-parallel-size", "2", "--recompute-granularity",
                       "selective", "--recompute-modules", "core_attn", "moe"],
                      dict(ep=2, dp=2, recompute="selective",
                           recompute_modules=("core_attn", "moe"))),
    "ep2-full-recompute": (["--expert-model-parallel-size", "2", "--recompute-granularity",
                            "full"], dict(ep=2, dp=2, recompute="full")),
    "ep2-distopt": (["--expert-model-parallel-size", "2", "--use-distributed-optimizer"],
                    dict(ep=2, dp=2, distributed_optimizer=True)),
    "tp2": (["--tensor-model-parallel-size", "2"], dict(tp=2, dp=1)),
}
FSDP_NOT_ON_CPU = (
    "not run: Megatron-Core 0.16.1's FSDP (DistributedDataParallelConfig.use_megatron_fsdp, "
    "data_parallel_sharding_strategy optim / optim_grads / optim_grads_params) needs CUDA: "
    "megatron_fsdp.py compares its device with cuda:{torch.cuda.current_device()} and makes "
    "torch.cuda.Stream()s, its buffers use torch.cuda streams and an NCCL-only premul-sum "
    "reduction, and the adapter builds its DeviceMesh with device_type='cuda'; the planner's "
    "ZeRO stage estimates stand in for these rows")


def _env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "SLMOE_PREFLIGHT": "0",
            "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


# --- inputs ----------------------------------------------------------------------------------------


def make_checkpoint(work: str, shape: dict) -> str:
    path = os.path.join(work, f"checkpoint-{shape['preset']}")
    if os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
        return path
    command = [sys.executable, os.path.join(ROOT, "tools", "make_hf_checkpoint.py"), "--preset",
               shape["preset"], "--num-layers", str(shape["layers"]), "--output", path]
    for item in shape["overrides"]:
        command += ["--set", item]
    proc = subprocess.run(command, env=_env(2), cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:  # the command's own line (a bad --set), not a CalledProcessError
        print((proc.stderr.strip().splitlines() or [f"error: {command[1]} failed"])[-1],
              file=sys.stderr)
        sys.exit(proc.returncode)
    return path


def make_data(work: str) -> str:
    """The shipped digits task as prompt/response lines (the checkpoint's chat template renders
    them)."""
    from megatron_slmoe.data.assets import asset_path

    path = os.path.join(work, "digits.jsonl")
    with open(asset_path("digits_train.jsonl"), encoding="utf-8") as src, \
            open(path, "w", encoding="utf-8") as out:
        out.write(src.read())
    return path


def packed_rows(checkpoint: str, data: str, seq: int, count: int) -> list[dict]:
    """The first ``count`` packed rows of the data, as this engine's instruction dataset makes
    them (in its shuffled order): what PEFT trains on too."""
    from megatron_slmoe.data.instruction import InstructionDataset
    from megatron_slmoe.data.tokenizer import load_tokenizer

    dataset = InstructionDataset(data, load_tokenizer(checkpoint), seq, seed=1234,
                                 num_samples=count)
    return [dataset[i] for i in range(count)]


# --- the engine's runs ---------------------------------------------------------------------------


def finetune_flags(checkpoint: str, data: str, seq: int, steps: int) -> list[str]:
    return ["--hf-checkpoint", checkpoint, "--train-data", data, "--valid-data", data,
            "--seq-length", str(seq), "--micro-batch-size", "1", "--global-batch-size",
            str(GLOBAL_BATCH), "--train-iters", str(steps + 10), "--lr", "1e-3",
            "--lr-warmup-iters", "0", "--eval-iters", "1", "--eval-interval", "1000",
            "--save-interval", "1000", "--log-interval", "1000", "--no-tensorboard",
            "--eval-accuracy-samples", "0", "--no-plots", "--fp32", "--heartbeat-timeout", "0",
            "--no-hf-shape-check"]


def run_engine(name: str, flags: list[str], work: str, steps: int, profile: bool) -> list[dict]:
    out = os.path.join(work, name)
    os.makedirs(out, exist_ok=True)
    for stale in os.listdir(out):
        if stale.startswith("rank"):
            os.remove(os.path.join(out, stale))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(29600 + abs(hash(name)) % 300),
               os.path.join(HERE, "measured_run.py"), out, str(steps),
               *(["--profile"] if profile else []), "--", *flags, "--output-dir",
               os.path.join(out, "run")]
    proc = subprocess.run(command, capture_output=True, text=True, env=_env(1), cwd=ROOT)
    return read_ranks(out, proc, name)


# --- transformers + PEFT ---------------------------------------------------------------------------


def peft_worker(checkpoint: str, rows_path: str, steps: int, out_path: str, preset: str) -> None:
    """One process: the HF model with PEFT LoRA on the same modules, AdamW, the same rows."""
    from megatron_slmoe.plan.live_bytes import LiveTensorBytes

    live = LiveTensorBytes()
    live.__enter__()
    import resource

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    rows = torch.load(rows_path, weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules=PEFT_TARGETS[preset],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.0)
    record = {"threads": torch.get_num_threads(),
              "params_total": sum(p.numel() for p in model.parameters()),
              "params_trainable": sum(p.numel() for p in trainable), "steps": []}
    for step in range(steps):
        batch = rows[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
        tokens = torch.stack([r["tokens"] for r in batch])
        labels = torch.stack([r["labels"] for r in batch])
        mask = torch.stack([r["loss_mask"] for r in batch])
        before = live.current
        live.reset_peak()
        started = time.perf_counter()
        logits = model(input_ids=tokens).logits.float()
        losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                   reduction="none")
        loss = (losses * mask.flatten()).sum() / mask.sum().clamp_min(1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        record["steps"].append({"before": before, "peak": live.peak, "loss": loss.item(),
                                "seconds": time.perf_counter() - started})
    record["rss_peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(out_path, "w") as f:
        json.dump(record, f)


def run_peft(checkpoint: str, rows: list[dict], work: str, steps: int, preset: str) -> dict:
    import torch

    rows_path = os.path.join(work, "rows.pt")
    torch.save(rows, rows_path)
    out = os.path.join(work, "peft.json")
    command = [sys.executable, os.path.abspath(__file__), "--peft-worker", checkpoint,
               rows_path, str(steps), out, preset]
    proc = subprocess.run(command, capture_output=True, text=True, env=_env(2), cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"PEFT run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(out) as f:
        return json.load(f)


# --- the kernel ------------------------------------------------------------------------------------


def kernel_rows(shape: dict, reps: int) -> list[dict]:
    """The fused op and a base GEMM per expert + separate LoRA, against one dense GEMM of the same
    base work (forward: x W^T; forward+backward: dx too, W is frozen).

    Each variant is first checked against the fp64 reference (``lora_expert.checked_variants``). The
    times are then taken interleaved: every repetition runs the dense GEMM and each variant back to
    back, so that a change in the machine's speed during the run hits all of them alike, and
    ``of_dense`` is the median over repetitions of dense time / variant time."""
    sys.path.insert(0, HERE)
    import lora_expert  # noqa: E402  (the kernel benchmark's variants)

    rows = []
    for d_in, d_out in shape["kernel_shapes"]:
        for per_expert in shape["kernel_rows"]:
            inp, checked, variants = lora_expert.checked_variants(
                shape["kernel_experts"], per_expert, 16, d_in, d_out, "float32",
                ["fused", "separate"])
            x, grad, w = inp["x_TD"], inp["grad_y_TO"], inp["weight_EOD"][0]
            x_grad = x.detach().requires_grad_()
            timed = {"dense": (lambda: x @ w.t(), lambda: (x @ w.t(), grad @ w))}
            for name, variant in variants.items():
                timed[name] = (lambda v=variant: v.forward(x_grad),
                               lambda v=variant: lora_expert.step(v, x, grad))
            times = {(name, kind): [] for name in timed for kind in (0, 1)}
            for rep in range(reps + 1):  # the first round warms up
                for name, fns in timed.items():
                    for kind, fn in enumerate(fns):
                        start = time.perf_counter()
                        fn()
                        if rep:
                            times[name, kind].append(time.perf_counter() - start)
            for row in checked:
                row["system"] = "kernel"
                row["dense_fwd_ms"] = statistics.median(times["dense", 0]) * 1e3
                row["dense_fwd_bwd_ms"] = statistics.median(times["dense", 1]) * 1e3
                for kind, key in enumerate(("fwd", "fwd_bwd")):
                    mine = times.get((row["variant"], kind))
                    row[f"{key}_ms"] = statistics.median(mine) * 1e3 if mine else None
                    row[f"of_dense_{key}"] = (statistics.median(
                        d / m for d, m in zip(times["dense", kind], mine)) if mine else None)
                rows.append(row)
    return rows


# --- the layer against Megatron-Core's -----------------------------------------------------------


def layer_rows(model_shape, seq: int, work: str, quick: bool) -> list[dict]:
    """This engine's MoE layer against Megatron-Core's MoELayer with LoRA on every expert, at the
    checkpoint's layer shape (``lora_step.py``): one-layer GPT models, EP=2 over two processes of
    one thread, the same weights and data, losses checked equal before timing. The vocabulary is
    4096 so that the output layer does not hide the MoE layer; attention has hidden/head_dim heads
    (lora_step's attention has no separate query width), the same in every variant."""
    out = os.path.join(work, "layer.json")
    s = model_shape
    cmd = [sys.executable, os.path.join(HERE, "lora_step.py"), "--ranks", "2",
           "--experts", str(s.experts), "--topk", str(s.topk), "--hidden", str(s.hidden),
           "--latent", str(s.latent or 0), "--expert-ffn", str(s.expert_ffn),
           "--shared-ffn", str(s.shared_ffn), "--layers", "1",
           "--heads", str(s.hidden // s.kv_channels), "--vocab", "4096", "--seq-length", str(seq),
           "--micro-batch-size", "1", "--lora-rank", "16", "--reps", "1" if quick else "3",
           "--profile-steps", "0" if quick else "1", "--json", out]
    subprocess.run(cmd, check=True, env=_env(1))
    with open(out) as f:
        return [{**row, "system": "layer", "lever": row["variant"]} for row in json.load(f)]


# --- the plan -----------------------------------------------------------------------------------


def planned(shape_cfg, seq: int, fields: dict, overhead: int, full: bool = False):
    """The memory planner's estimate per stage for one lever (CPU: live tensor bytes)."""
    from megatron_slmoe.plan.devices import DeviceSpec
    from megatron_slmoe.plan.memory import estimate_memory
    from megatron_slmoe.plan.settings import RunSettings

    cpu = DeviceSpec("cpu (live tensor bytes)", memory_bytes=2**40, bf16_tflops=1.0,
                     intra_node_gbps=1.0, inter_node_gbps=1.0, devices_per_node=2,
                     framework_overhead=overhead, fragmentation=0.0)
    settings = RunSettings(**{"dtype": "fp32", "seq_length": seq, "global_batch_size":
                              GLOBAL_BATCH, "micro_batch_size": 1, "devices_per_node": 2,
                              "moe_imbalance": 1.25, "lora_rank": 16,
                              "lora_targets": ("linear_qkv", "linear_proj", "linear_fc1",
                                               "linear_fc2"), **fields})
    return estimate_memory(shape_cfg, settings, cpu), settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="scaled-down shapes (CI)")
    parser.add_argument("--preset", choices=sorted(PRESET_SHAPES), default="qwen3-30b-a3b",
                        help="the layer shape (--quick: qwen3-30b-a3b scaled down)")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seq-length", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--levers", nargs="+", choices=sorted(LEVERS), default=None)
    parser.add_argument("--parts", nargs="+", default=["engine", "peft", "layer", "kernel"],
                        choices=["engine", "peft", "layer", "kernel"])
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a config field of the checkpoint (e.g. vocab_size=4096: the layers "
                             "without the output layer's weight)")
    parser.add_argument("--work-dir", default=None, help="reused: its checkpoint stays")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    shape = dict(QUICK if args.quick else PRESET_SHAPES[args.preset])
    shape["layers"] = args.layers or shape["layers"]
    shape["overrides"] = [*shape["overrides"], *args.set]
    seq, steps = args.seq_length or shape["seq"], args.steps or shape["steps"]
    levers = args.levers or (["ep2", "ep2-distopt"] if args.quick else list(LEVERS))

    import torch

    from megatron_slmoe.hf.loader import open_hf_checkpoint
    from megatron_slmoe.plan.flops import token_flops
    from megatron_slmoe.plan.model_shape import ModelShape, census
    from megatron_slmoe.platform.peak import measure_cpu_gemm_flops
    from megatron_slmoe.utils.atomic import write_json_atomic

    load = os.getloadavg()
    work = args.work_dir
    if work is None:  # a folder of this run's only: gone with it, however it ends
        work = tempfile.mkdtemp(prefix="realistic-")
        atexit.register(shutil.rmtree, work, True)
    checkpoint = make_checkpoint(work, shape)
    data = make_data(work)
    model_shape = ModelShape.from_config(open_hf_checkpoint(checkpoint).model_config)
    params_total = census(model_shape)["total_params"]
    flops = token_flops(model_shape, seq, 16, ("linear_qkv", "linear_proj", "linear_fc1",
                                               "linear_fc2"))
    torch.set_num_threads(1)
    peak_1 = measure_cpu_gemm_flops(torch.float32)
    torch.set_num_threads(2)
    peak_2 = measure_cpu_gemm_flops(torch.float32)
    rows: list[dict] = []
    header = {"machine": {"cpu": _cpu(), "load_average_at_start": load, "threads": 2,
                          "peak_gemm_flops_1_thread": peak_1, "peak_gemm_flops_2_threads": peak_2},
              "model": {"checkpoint": checkpoint, "layers": shape["layers"],
                        "params_total": params_total, "seq_length": seq,
                        "global_batch_size": GLOBAL_BATCH, "steps": steps,
                        "training_flops_per_token": flops.training}}
    overhead = None
    if "engine" in args.parts:
        flags = finetune_flags(checkpoint, data, seq, steps)
        for number, lever in enumerate(levers):
            lever_flags, fields = LEVERS[lever]
            ranks = run_engine(lever, [*flags, *LORA, *lever_flags], work, steps,
                               profile=number == 0)
            if overhead is None:  # CPU framework overhead: live before a step, beyond the state
                overhead = max(r["steps"][1]["before"] - r["steps"][1]["held_by_state"]
                               for r in ranks)
            estimate, settings = planned(model_shape, seq, fields, overhead)
            # The first step warms up; a profiled last step is slower than the others.
            timed = [s["seconds"] for s in ranks[0]["steps"][1:len(ranks[0]["steps"]) - (
                number == 0)]]
            tokens_per_s = GLOBAL_BATCH * seq / statistics.mean(timed)
            for rank, result in enumerate(ranks):
                stage = estimate.stages[0]
                peak = max(s["peak"] for s in result["steps"][1:])
                rows.append({
                    "system": "slmoe", "lever": lever, "rank": rank,
                    "layout": settings.describe(), "predicted_peak_bytes": stage.peak,
                    "measured_peak_bytes": peak, "relative_error": (stage.peak - peak) / peak,
                    "tokens_per_s": tokens_per_s,
                    "mfu": tokens_per_s * flops.training / (2 * peak_1),
                    "params_total": params_total, "params_trainable": stage.trainable_params,
                    "rss_after_import_bytes": result["rss_after_setup_bytes"],
                    "shard_bytes": result["shard_bytes"],
                    "losses": [s["loss"] for s in result["steps"]],
                    "stage_share": _shares(result.get("stage_us"))})
        for sharding in ("optim_grads", "optim_grads_params"):  # ZeRO-2, ZeRO-3: planned only
            estimate, settings = planned(model_shape, seq, dict(ep=2, dp=2, sharding=sharding),
                                         overhead or 0)
            rows.append({"system": "slmoe", "lever": f"ep2-megatron-fsdp-{sharding}",
                         "status": FSDP_NOT_ON_CPU, "layout": settings.describe(),
                         "predicted_peak_bytes": estimate.stages[0].peak,
                         "measured_peak_bytes": None, "tokens_per_s": None,
                         "params_total": params_total,
                         "params_trainable": estimate.stages[0].trainable_params})
    if "peft" in args.parts:
        rows_data = packed_rows(checkpoint, data, seq, GLOBAL_BATCH * steps)
        result = run_peft(checkpoint, rows_data, work, steps, shape["preset"])
        timed = [s["seconds"] for s in result["steps"][1:]]
        tokens_per_s = GLOBAL_BATCH * seq / statistics.mean(timed)
        rows.append({"system": "peft", "lever": "lora (one process, 2 threads)",
                     "predicted_peak_bytes": None,
                     "measured_peak_bytes": max(s["peak"] for s in result["steps"][1:]),
                     "tokens_per_s": tokens_per_s,
                     "mfu": tokens_per_s * flops.training / peak_2,
                     "params_total": result["params_total"],
                     "params_trainable": result["params_trainable"],
                     "rss_peak_bytes": result["rss_peak_bytes"],
                     "losses": [s["loss"] for s in result["steps"]]})
    if "layer" in args.parts:
        rows += layer_rows(model_shape, seq, work, args.quick)
    if "kernel" in args.parts:
        rows += kernel_rows(shape, reps=2 if args.quick else 7)
    ratios = _ratios(rows)
    header["load_average_at_end"] = os.getloadavg()
    _print(header, rows, ratios)
    if args.json:
        write_json_atomic(args.json, {**header, "rows": rows, "ratios": ratios})
    return 0


def _cpu() -> str:
    from megatron_slmoe.platform.peak import _cpu_model

    return _cpu_model()


def _shares(stage_us) -> dict | None:
    if not stage_us:
        return None
    total = sum(stage_us.values())
    return {k: v / total for k, v in sorted(stage_us.items(), key=lambda kv: -kv[1])}


def _ratios(rows: list[dict]) -> dict:
    """slmoe's first lever over PEFT: tokens/s, and memory per token (per-rank peak x ranks); the
    layer over Megatron-Core's MoELayer with per-expert LoRA: tokens/s."""
    layer = {r["lever"]: r for r in rows if r["system"] == "layer"}
    ratios = {}
    if "slmoe" in layer and "megatron_lora" in layer:
        ratios["tokens_per_s_layer_slmoe_over_megatron_lora"] = (
            layer["slmoe"]["tokens_per_s"] / layer["megatron_lora"]["tokens_per_s"])
    ours = next((r for r in rows if r["system"] == "slmoe" and r.get("tokens_per_s")), None)
    peft = next((r for r in rows if r["system"] == "peft"), None)
    if not ours or not peft:
        return ratios
    ranks = [r for r in rows if r["system"] == "slmoe" and r["lever"] == ours["lever"]]
    ours_bytes = sum(r["measured_peak_bytes"] for r in ranks)
    return {**ratios,
            "tokens_per_s_slmoe_over_peft": ours["tokens_per_s"] / peft["tokens_per_s"],
            "peak_bytes_slmoe_all_ranks_over_peft": ours_bytes / peft["measured_peak_bytes"],
            "slmoe_lever": ours["lever"]}


def _print(header: dict, rows: list[dict], ratios: dict) -> None:
    m = header["model"]
    print(f"model: {m['layers']} layers, {m['params_total'] / 1e9:.2f} B parameters; seq "
          f"{m['seq_length']}, global batch {m['global_batch_size']}, {m['steps']} steps; "
          f"{header['machine']['cpu']}; load {header['machine']['load_average_at_start'][0]:.2f}"
          f" -> {header['load_average_at_end'][0]:.2f}; peak GEMM "
          f"{header['machine']['peak_gemm_flops_1_thread'] / 1e9:.1f} GFLOP/s per thread")
    print(f"{'system':<7}{'lever':<24}{'rank':>5}{'predicted GiB':>15}{'measured GiB':>14}"
          f"{'error':>8}{'tokens/s':>10}{'MFU':>7}")
    for r in rows:
        if r["system"] in ("kernel", "layer"):
            continue
        pred = r.get("predicted_peak_bytes")
        meas = r.get("measured_peak_bytes")
        print(f"{r['system']:<7}{r['lever'][:23]:<24}{r.get('rank', '-')!s:>5}"
              f"{pred / 2**30 if pred else float('nan'):>15.2f}"
              f"{meas / 2**30 if meas else float('nan'):>14.2f}"
              f"{r.get('relative_error', float('nan')):>+8.1%}"
              f"{r.get('tokens_per_s') or float('nan'):>10.1f}"
              f"{r.get('mfu') or float('nan'):>7.1%}")
    layer = [r for r in rows if r["system"] == "layer"]
    if layer:
        print(f"{'layer (1 MoE layer, EP=2)':<26}{'tokens/s':>10}{'experts ms':>12}"
              f"{'dispatch ms':>13}{'combine ms':>12}{'slmoe x':>9}")
        for r in layer:
            st = r.get("stages_ms") or {}
            print(f"{r['lever']:<26}{r['tokens_per_s'] or float('nan'):>10.1f}"
                  f"{st.get('experts', float('nan')):>12.0f}"
                  f"{st.get('dispatch', float('nan')):>13.0f}"
                  f"{st.get('combine', float('nan')):>12.0f}"
                  f"{r.get('slmoe_speedup') or float('nan'):>9.2f}")
    kernel = [r for r in rows if r["system"] == "kernel"]
    if kernel:
        print(f"{'kernel':<10}{'shape':>10}{'rows/e':>8}{'fwd ms':>9}{'of dense':>9}"
              f"{'f+b ms':>9}{'of dense':>9}")
        for r in kernel:
            print(f"{r['variant']:<10}{r['d_in']}x{r['d_out']:<5}{r['rows_per_expert']:>8}"
                  f"{r['fwd_ms'] or float('nan'):>9.2f}{r['of_dense_fwd'] or float('nan'):>9.2f}"
                  f"{r['fwd_bwd_ms'] or float('nan'):>9.2f}"
                  f"{r['of_dense_fwd_bwd'] or float('nan'):>9.2f}")
    for name, value in ratios.items():
        print(f"{name}: {value if isinstance(value, str) else f'{value:.2f}'}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--peft-worker":
        peft_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6])
    else:
        sys.exit(main())
