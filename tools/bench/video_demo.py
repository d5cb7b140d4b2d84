"""The video demo: LoRA fine-tuning on the synthetic motion task (``data/motion.py``: which way a
shape moves on a wrapping canvas; no single frame answers it) with a tiny random-weight
Qwen3-VL-MoE made by the tests' maker (``tests/helpers/video_clips.py``: 2-layer tower, 2-layer
MoE language model, Qwen3-VL's video processor at 2 fps, two frames per temporal patch). The
language model is ``--hidden`` wide, 128 by default: at the tests' 32, with its final norm and
output layer frozen, no hidden state makes any one token much likelier than a third, so LoRA
cannot learn to write an answer at all.

Two runs of the entry point (``slmoe-finetune --task image-text``) with the same model, settings
and questions: on the clips (``video``), and on each clip's middle frame (``single_frame``, the
baseline: the same questions, one image). Each row gives the held-out exact match of greedy
answers before and after training (chance is 1/4) and the held-out loss before and after.

    python tools/bench/video_demo.py --json runs/bench/video_demo.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_slmoe.platform import apply_adaptor

apply_adaptor()

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_slmoe.data import motion  # noqa: E402
from megatron_slmoe.utils.atomic import write_json_atomic  # noqa: E402

SEQ = 96


def finetune(hf_dir: str, dataset: str, output: str, args) -> dict:
    warmup = min(10, args.iters // 10)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
            "-m", "megatron_slmoe.training.finetune", "--hf-checkpoint", hf_dir,
            "--task", "image-text", "--train-data", dataset, "--valid-data", dataset,
            "--seq-length", str(SEQ), "--global-batch-size", str(args.batch),
            "--micro-batch-size", str(args.batch), "--train-iters", str(args.iters),
            "--lr", str(args.lr), "--lr-warmup-iters", str(warmup),
            "--lr-decay-style", args.lr_decay,
            "--eval-iters", str(args.eval_iters), "--eval-interval", str(args.iters),
            "--fp32", "--no-tensorboard", "--eval-answers", str(args.held_out),
            "--seed", str(args.seed), "--output-dir", output]
    if args.full:  # every weight, the tower's too
        argv += ["--finetune-mode", "full", "--train-vision-tower"]
    else:
        argv += ["--lora-rank", str(args.rank), "--lora-target-modules", "linear_qkv",
                 "linear_proj", "linear_fc1", "linear_fc2", "vision_attention", "projector"]
    with open(output + ".log", "w", encoding="utf-8") as log:
        if subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"the {dataset} run failed: see {output}.log")
    with open(os.path.join(output, "summary.json"), encoding="utf-8") as f:
        return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", type=int, default=512, help="training questions")
    p.add_argument("--held-out", type=int, default=64, help="held-out questions")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    # Constant: the loss sits at chance for about a thousand steps, then falls within a hundred
    # or two; a decaying rate has mostly gone by then.
    p.add_argument("--lr-decay", default="constant", choices=("constant", "cosine", "linear"))
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--hidden", type=int, default=128, help="the language model's width")
    p.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    p.add_argument("--eval-iters", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--keep", help="keep the data, checkpoint and runs in this new folder")
    args = p.parse_args(argv)

    from tests.helpers import video_clips  # the tests' maker of the tiny checkpoint

    if args.keep and os.path.exists(args.keep):
        print(f"error: --keep {args.keep} already exists (choose a new folder)", file=sys.stderr)
        return 2
    work = args.keep or tempfile.mkdtemp(prefix="video_demo_")
    os.makedirs(work, exist_ok=not args.keep)
    data = motion.generate(os.path.join(work, "data"), train=args.train, held_out=args.held_out)
    hf_dir = Path(work) / "qwen3-vl-moe-tiny"
    video_clips.save_qwen3_vl_video_checkpoint(hf_dir, SEQ, hidden_size=args.hidden)
    rows = []
    for name in ("video", "single_frame"):
        start = time.perf_counter()
        summary = finetune(str(hf_dir), data[name], os.path.join(work, f"run_{name}"), args)
        rows.append({"input": name, "accuracy_before": summary["accuracy_before"],
                     "accuracy_after": summary["accuracy_after"],
                     "loss_before": summary["eval_loss_before"],
                     "loss_after": summary["eval_loss_after"],
                     "seconds": round(time.perf_counter() - start, 1)})
    load = open("/proc/loadavg").read().split()[:3]
    print(f"\n{args.train} training / {args.held_out} held-out questions, {args.iters} steps of "
          f"{args.batch}, {'full fine-tuning' if args.full else f'LoRA rank {args.rank}'}, "
          f"lr {args.lr:g}; load average {' '.join(load)}")
    print("| input | exact match before | after | held-out loss before | after | seconds |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['input']} | {r['accuracy_before']:.3f} | {r['accuracy_after']:.3f} | "
              f"{r['loss_before']:.3f} | {r['loss_after']:.3f} | {r['seconds']} |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        write_json_atomic(args.json, {"rows": rows, "settings": vars(args), "loadavg": load})
    return 0


if __name__ == "__main__":
    sys.exit(main())
