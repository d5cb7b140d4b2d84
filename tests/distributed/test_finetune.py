"""The LoRA fine-tuning job on real gloo ranks (torchrun), as users run it:

- 20 steps give the same loss curve on 1 rank and on 2 ranks with TP=2, EP=2, PP=2 and DP=2,
  routing-stability losses included, and the same held-out accuracy by generation (the EP=2 run
  is the one below whose rank is killed: the same job, launched once for both tests);
- a rank killed mid-run (kill -9) under torchrun's restart budget: every rank restarts by itself,
  resumes from the newest intact checkpoint and reproduces the uninterrupted losses; the log names
  the dead rank and the checkpoint; metrics.jsonl has each iteration once, and the restart;
- a checkpoint corrupted on purpose is refused with a clear message and the previous one is used;
  a larger --train-iters extends the learning-rate schedule; a rerun of a finished run changes
  nothing;
- base weights stay bitwise unchanged and only LoRA parameters get gradients and optimizer state.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.entry_point import REPO
from tests.helpers.entry_point import losses as _losses
from tests.helpers.entry_point import records as _records
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
def start(tmp_path_factory, tiny_base):
    """The session's tiny base checkpoint (linked as base/) and a starting adapter (one LoRA step
    on it), so every layout starts from the same weights."""
    root = tmp_path_factory.mktemp("finetune")
    (root / "base").symlink_to(tiny_base, target_is_directory=True)
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


SECRET = "slmoe-test-secret-7f3a9c"
EP2 = ["--expert-model-parallel-size", "2"]


def _pid_of(run: Path, attempt: int, rank: int) -> int:
    path = run / "attempts" / str(attempt) / f"rank_{rank:05d}.json"
    return json.loads(path.read_text())["pid"]


@pytest.fixture(scope="module")
def killed_ep2(start):
    """The EP=2 layout's 20 steps, with rank 1 killed (kill -9) once it is past the checkpoint of
    iteration 10, under torchrun's restart budget and with credentials in the environment: its
    output, the victim's pid, and the losses and summary as the finished job left them."""
    run = start / "killed"
    proc = _lora_run(start, "killed", 2, EP2, wait=False, restarts=2,
                     env={"AWS_SECRET_ACCESS_KEY": SECRET, "HF_TOKEN": SECRET})
    deadline = time.time() + 300
    while time.time() < deadline:  # kill rank 1 once it is past the checkpoint of iteration 10
        metrics = run / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 12:
            break
        time.sleep(0.2)
    victim = _pid_of(run, 0, 1)
    os.kill(victim, signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]  # finished by itself
    return {"run": run, "out": out, "victim": victim, "losses": _losses(run),
            "summary": json.loads((run / "summary.json").read_text())}


@pytest.mark.parametrize("name, flags", [
    ("tp2", ["--tensor-model-parallel-size", "2"]),
    ("ep2", None),  # the killed-rank job (killed_ep2): the same run, launched once
    ("pp2", ["--pipeline-model-parallel-size", "2"]),
    ("dp2", []),
])
def test_loss_curve_matches_single_rank(start, single_rank, request, name, flags):
    if flags is None:
        killed = request.getfixturevalue("killed_ep2")
        losses, summary = killed["losses"], killed["summary"]
    else:
        _lora_run(start, name, 2, flags)
        losses = _losses(start / name)
        summary = json.loads((start / name / "summary.json").read_text())
    assert sorted(losses) == list(range(1, 21))
    for it in range(1, 21):
        assert losses[it] == pytest.approx(single_rank[it], rel=1e-5, abs=1e-6), f"iteration {it}"
    assert losses[20] < losses[1]  # and it learns
    reference = json.loads((start / "single" / "summary.json").read_text())
    assert summary["accuracy_after"] == reference["accuracy_after"]


def test_killed_rank_restarts_in_job_and_reproduces_losses(start, single_rank, killed_ep2):
    run, out, victim = killed_ep2["run"], killed_ep2["out"], killed_ep2["victim"]
    losses = killed_ep2["losses"]
    assert sorted(losses) == list(range(1, 21))
    for it in range(1, 21):
        assert losses[it] == pytest.approx(single_rank[it], rel=1e-5, abs=1e-6), f"iteration {it}"
    timed = [r for r in _records(run) if "step_time" in r]  # per-rank compute, at log intervals
    assert timed and all(len(r["step_time"]["compute_s_by_rank"]) == 2 for r in timed)
    (restart,) = [r for r in _records(run) if r.get("event") == "restart"]
    assert restart["restart"] == 1 and restart["attempt"] == 1
    resumed = restart["resumed_from"]
    assert resumed in (str(run / "checkpoints" / "iter_0000010"),
                       str(run / "checkpoints" / "iter_0000005"))  # the newest promoted one
    silent = restart["previous_attempt"]["silent"]  # the others said why they stopped
    assert [(r["rank"], r["pid"]) for r in silent] == [(1, victim)]
    line = next(line for line in out.splitlines() if line.startswith("[restart]"))
    assert "torchrun restart 1 of 2" in line and "rank 1 on node" in line
    assert f"(pid {victim}) ended without a word" in line
    assert f"resuming from {resumed} at iteration {int(resumed[-7:])}" in line

    # Security hygiene: nothing written is world-writable (the job ran with umask 0), and the
    # credentials in its environment reached no file and no log line.
    for path in [run, *run.rglob("*")]:
        assert not path.stat().st_mode & 0o002, path
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    assert SECRET not in out

    # Corrupt the newest checkpoint: it is refused, by name and reason, and the previous used;
    # the run goes on to 22 steps with the schedule decaying over 22, not the old 20.
    newest = run / "checkpoints" / "iter_0000020"
    shard = next(newest.rglob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    out = _lora_run(start, "killed", 2, EP2, iters=22)
    assert "iter_0000020 is not usable" in out and "bytes, the manifest says" in out
    assert "resumed from" in out and "iter_0000015" in out
    assert "the learning rate now decays over 22 steps instead of 20" in out
    records = {r["iteration"]: r for r in _records(run) if "event" not in r}
    assert sorted(records) == list(range(1, 23))
    for it in (16, 21, 22):  # Megatron's cosine over 22 steps after 2 of warm-up, peak 1e-3
        expected = 1e-3 * 0.5 * (1 + math.cos(math.pi * (it - 2) / 20))
        assert records[it]["lr"] == pytest.approx(expected, rel=1e-6), it
    assert records[21]["lr"] > 0

    # A rerun of the finished run says so and changes nothing.
    summary = (run / "summary.json").read_bytes()
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    args = [*COMMON, "--base-checkpoint", str(start / "base"), "--adapter-init",
            str(start / "init" / "adapter"), "--train-iters", "22", "--save-interval", "5",
            "--output-dir", str(run), *EP2]
    rerun = subprocess.run([sys.executable, "-m", "megatron_slmoe.training.finetune", *args],
                           cwd=REPO, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "WORLD_SIZE": "2"})
    assert rerun.returncode == 0, rerun.stderr
    assert f"the run in {run} has finished all 22 steps" in rerun.stdout
    assert (run / "summary.json").read_bytes() == summary
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before


def frozen_base_run(args: list[str]) -> dict:
    """Train a few steps in-process; report what changed and what the optimizer holds."""
    from megatron_slmoe.training.recipe import build_engine
    from megatron_slmoe.training.finetune import parse

    import megatron_slmoe

    engine = build_engine(parse(args).run, megatron_slmoe.PLATFORM)
    ctx = engine.setup()
    named = dict(ctx.model.named_parameters())
    lora = {n for n in named if "lora" in n}
    base_before = {n: p.detach().clone() for n, p in named.items() if n not in lora}
    lora_before = {n: named[n].detach().clone() for n in lora}
    for _ in range(3):
        engine.train_step()
    # fp32: Megatron's optimizer steps the model parameters themselves.
    optimizer_params = {id(p) for group in ctx.optimizer.param_groups for p in group["params"]}
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
