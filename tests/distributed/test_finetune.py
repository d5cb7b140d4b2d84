"""The LoRA fine-tuning job on real gloo ranks (torchrun), as users run it:

- 20 steps give the same loss curve on 1 rank and on 2 ranks with TP=2, EP=2, PP=2 and DP=2,
  routing-stability losses included, and the same held-out accuracy by generation;
- a run killed mid-way resumes from its last checkpoint and reproduces the uninterrupted losses;
- a checkpoint corrupted on purpose is refused with a clear message and the previous one is used;
- base weights stay bitwise unchanged and only LoRA parameters get gradients and optimizer state.
"""

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.entry_point import losses as _losses
from tests.helpers.entry_point import torchrun as _torchrun
from tests.helpers.ranks import run_ranks

COMMON = ["--model-config", "tiny", "--seq-length", "64", "--global-batch-size", "8",
          "--micro-batch-size", "2", "--lr", "1e-3", "--lr-warmup-iters", "2", "--eval-iters", "1",
          "--eval-interval", "1000", "--log-interval", "5", "--lora-rank", "4", "--fp32",
          "--no-tensorboard", "--eval-accuracy-samples", "16", "--no-plots"]
# The routing-stability terms of LoRA runs (a reference pass per step, two attached losses) must
# give the same curves in every layout too.
STABILITY = ["--moe-routing-kl-coeff", "0.5", "--moe-routed-balance-coeff", "0.1"]


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A base checkpoint (2 full-training steps of the tiny model) and a starting adapter (one
    LoRA step on it), so every layout starts from the same weights."""
    root = tmp_path_factory.mktemp("finetune")
    _torchrun(1, [*COMMON, "--finetune-mode", "full", "--data-format", "pretrain",
                  "--train-iters", "2", "--lr-warmup-iters", "0", "--output-dir", str(root / "base-run"),
                  "--save-base", str(root / "base")])
    _torchrun(1, [*COMMON, "--base-checkpoint", str(root / "base"), "--train-iters", "1",
                  "--lr-warmup-iters", "0", "--output-dir", str(root / "init")])
    return root


def _lora_run(start: Path, name: str, nproc: int, extra: list[str], iters: int = 20, **kw):
    args = [*COMMON, *STABILITY, "--base-checkpoint", str(start / "base"), "--adapter-init",
            str(start / "init" / "adapter"), "--train-iters", str(iters), "--save-interval", "5",
            "--output-dir", str(start / name), *extra]
    return _torchrun(nproc, args, **kw)


@pytest.fixture(scope="module")
def single_rank(start):
    _lora_run(start, "single", 1, [])
    return _losses(start / "single")


@pytest.mark.parametrize("name, flags", [
    ("tp2", ["--tensor-model-parallel-size", "2"]),
    ("ep2", ["--expert-model-parallel-size", "2"]),
    ("pp2", ["--pipeline-model-parallel-size", "2"]),
    ("dp2", []),
])
def test_loss_curve_matches_single_rank(start, single_rank, name, flags):
    _lora_run(start, name, 2, flags)
    losses = _losses(start / name)
    assert sorted(losses) == list(range(1, 21))
    for it in range(1, 21):
        assert losses[it] == pytest.approx(single_rank[it], rel=1e-5, abs=1e-6), f"iteration {it}"
    assert losses[20] < losses[1]  # and it learns
    summary = json.loads((start / name / "summary.json").read_text())
    reference = json.loads((start / "single" / "summary.json").read_text())
    assert summary["accuracy_after"] == reference["accuracy_after"]


def test_killed_run_resumes_and_reproduces_losses(start, single_rank):
    run = start / "killed"
    proc = _lora_run(start, "killed", 2, ["--expert-model-parallel-size", "2"], wait=False)
    deadline = time.time() + 300
    while time.time() < deadline:  # kill it once it is past the checkpoint of iteration 10
        metrics = run / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 12:
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (run / "checkpoints" / "iter_0000010").is_dir()

    out = _lora_run(start, "killed", 2, ["--expert-model-parallel-size", "2"])
    assert "resumed from" in out
    losses = _losses(run)
    for it in range(1, 21):
        assert losses[it] == pytest.approx(single_rank[it], rel=1e-5, abs=1e-6), f"iteration {it}"

    # Corrupt the newest checkpoint: it is refused, by name and reason, and the previous used.
    newest = run / "checkpoints" / "iter_0000020"
    shard = next(newest.rglob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    out = _lora_run(start, "killed", 2, ["--expert-model-parallel-size", "2"], iters=22)
    assert "iter_0000020 is not usable" in out and "bytes, the manifest says" in out
    assert "resumed from" in out and "iter_0000015" in out


def frozen_base_run(args: list[str]) -> dict:
    """Train a few steps in-process; report what changed and what the optimizer holds."""
    from megatron_slmoe.training.finetune import Trainer, parse

    import megatron_slmoe

    trainer = Trainer(parse(args).run, megatron_slmoe.PLATFORM)
    trainer.setup()
    named = dict(trainer.model.named_parameters())
    lora = {n for n in named if "lora" in n}
    base_before = {n: p.detach().clone() for n, p in named.items() if n not in lora}
    lora_before = {n: named[n].detach().clone() for n in lora}
    for step in range(3):
        trainer.train_step(step * 8)
    # fp32: Megatron's optimizer steps the model parameters themselves.
    optimizer_params = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    return {
        "lora": sorted(lora),
        "base_changed": [n for n, b in base_before.items() if not torch.equal(named[n], b)],
        "base_with_grad": [n for n, p in named.items() if n not in lora
                           and (p.requires_grad or getattr(p, "main_grad", None) is not None)],
        "lora_changed": sorted(n for n in lora if not torch.equal(named[n], lora_before[n])),
        "in_optimizer": sorted(n for n, p in named.items() if id(p) in optimizer_params),
    }


def test_base_weights_stay_bitwise_unchanged(start, tmp_path):
    args = [*COMMON, "--base-checkpoint", str(start / "base"), "--train-iters", "3",
            "--expert-model-parallel-size", "2", "--output-dir", str(tmp_path)]
    for rank, result in enumerate(run_ranks(frozen_base_run, 2, ep=2, args=args)):
        assert result["lora"], "no LoRA parameters"
        assert result["base_changed"] == [], f"rank {rank}"
        assert result["base_with_grad"] == [], f"rank {rank}"
        assert result["lora_changed"], f"rank {rank}: LoRA did not train"
        assert result["in_optimizer"] == result["lora"], f"rank {rank}"
