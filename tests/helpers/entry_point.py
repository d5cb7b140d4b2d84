"""Run the fine-tuning entry point as users run it (torchrun, a fresh process group) and read what
a run wrote; the tiny base checkpoint several test modules start from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TINY = ["--model-config", "tiny", "--seq-length", "64", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--eval-iters", "1", "--eval-interval", "1000", "--fp32",
        "--no-tensorboard", "--log-interval", "1", "--lr-warmup-iters", "0"]
# For a test that reads neither the held-out answers nor the run's pictures (the tests of those
# are tests/distributed/test_finetune.py and tests/unit/test_run_pictures.py): making them is a
# good part of a tiny run's time.
NO_ANSWERS_NO_PICTURES = ["--eval-accuracy-samples", "0", "--no-plots"]


def torchrun_command(nproc: int, args: list[str], restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), "--max-restarts", str(restarts), "-m",
            "megatron_slmoe.training.finetune", *args]


def restart_env(**extra: str) -> dict[str, str]:
    """The environment the launcher gives torchrun (pytorch#135712: a restarted group meets
    through a fresh store)."""
    return {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **extra}


def torchrun(nproc: int, args: list[str], wait: bool = True, restarts: int = 0,
             env: dict | None = None):
    """``torchrun --standalone --nproc-per-node N --max-restarts R -m
    megatron_slmoe.training.finetune ARGS`` with umask 0 (what a run writes must still not be
    world-writable): its output (asserting exit code 0), or with ``wait=False`` the running
    process (own session)."""
    proc = subprocess.Popen(torchrun_command(nproc, args, restarts), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=restart_env(**(env or {})),
                            preexec_fn=lambda: os.umask(0))
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    return out


def records(run_dir: Path) -> list[dict]:
    """metrics.jsonl: a record per step, and events (``"event": "restart"``)."""
    return [json.loads(line)
            for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    """Iteration -> loss (each iteration is in metrics.jsonl once, even across resumes)."""
    steps = [r for r in records(run_dir) if "event" not in r]
    assert [r["iteration"] for r in steps] == sorted({r["iteration"] for r in steps})
    return {r["iteration"]: r["loss"] for r in steps}


def stand_in_base(path: Path) -> Path:
    """A directory that passes the start-up check of a base checkpoint without holding weights
    (Megatron's two metadata files, no model recorded): for tests that only validate a LoRA run,
    which must name a base, of a model too large to save (the flagship)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (path / ".metadata").write_bytes(b"stand-in")
    return path


def make_tiny_base(root: Path) -> Path:
    """One full-training step of the tiny model on the shipped corpus, saved as a base."""
    proc = subprocess.run(
        torchrun_command(1, [*TINY, "--finetune-mode", "full", "--data-format", "pretrain",
                             "--train-iters", "1", "--output-dir", str(root / "run"),
                             "--save-base", str(root / "base")]),
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return root / "base"
