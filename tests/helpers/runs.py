"""Starting fine-tuning runs from tests as users start them (torchrun, the entry point), and the
tiny base checkpoint several test modules start from."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TINY = ["--model-config", "tiny", "--seq-length", "64", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--eval-iters", "1", "--eval-interval", "1000", "--fp32",
        "--no-tensorboard", "--log-interval", "1", "--lr-warmup-iters", "0"]


def torchrun_command(nproc: int, args: list[str], restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), "--max-restarts", str(restarts), "-m",
            "megatron_slmoe.training.finetune", *args]


def restart_env(**extra: str) -> dict[str, str]:
    """The environment the launcher gives torchrun (pytorch#135712: a restarted group meets
    through a fresh store)."""
    return {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **extra}


def make_tiny_base(root: Path) -> Path:
    """One full-training step of the tiny model on the shipped corpus, saved as a base."""
    proc = subprocess.run(
        torchrun_command(1, [*TINY, "--finetune-mode", "full", "--data-format", "pretrain",
                             "--train-iters", "1", "--output-dir", str(root / "run"),
                             "--save-base", str(root / "base")]),
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return root / "base"
