"""The main job as a user runs it: `bash scripts/pretrain_lora.sh` with no arguments pretrains
the tiny base (2 CPU processes, EP 2), LoRA fine-tunes it on the shipped task, and the summary
reports the held-out accuracy the README states, routing health and the pictures it wrote. One
flag that is not a base (`--output-dir` alone) is refused in one line instead of LoRA-tuning
random weights."""

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

README_ACCURACY = 199 / 200
"""The demo's held-out exact match after training, as the README's table states it."""


def _run(args, env_extra, timeout=900):
    env = {**os.environ, **env_extra}
    return subprocess.run(["bash", "scripts/pretrain_lora.sh", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_demo_reaches_the_accuracy_the_readme_states(tmp_path):
    proc = _run([], {"SLMOE_DEMO_DIR": str(tmp_path / "demo")}, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = sorted((tmp_path / "demo").glob("lora-*"))
    assert len(runs) == 1
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert summary["steps"] == 300
    assert summary["accuracy_before"] == 0.0
    assert summary["accuracy_after"] >= README_ACCURACY, summary
    assert summary["eval_loss_after"] < 0.1 * summary["eval_loss_before"], summary
    adapter = Path(summary["adapter_dir"])
    assert adapter.is_absolute() and (adapter / "adapter_model.safetensors").is_file()
    assert (adapter / "adapter_config.json").is_file()
    assert (runs[0] / "metrics.jsonl").is_file() and (runs[0] / "checkpoints" / "latest").is_file()
    assert summary["collapse_warnings"] == 0 and summary["dead_experts_end"] == 0, summary
    assert {Path(p).name for p in summary["plots"]} >= {"loss.png", "accuracy.png",
                                                        "expert_load.png", "routing_drift.png"}
    assert all(Path(p).is_absolute() and Path(p).is_file() for p in summary["plots"])
    assert f"pictures: {runs[0] / 'plots'}" in proc.stdout


def test_lora_without_a_base_is_refused_in_one_line(tmp_path):
    proc = _run(["--output-dir", str(tmp_path / "x")], {})
    assert proc.returncode == 2
    (line,) = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
    assert "Traceback" not in proc.stderr
    assert "LoRA needs a trained base model" in line and "--base-checkpoint" in line
    assert "scripts/pretrain_lora.sh" in line and "--finetune-mode full" in line
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_bad_flag_is_one_line_before_any_process_starts(tmp_path):
    proc = _run(["--train-iters", "0", "--output-dir", str(tmp_path)], {})
    assert proc.returncode == 2
    assert "--train-iters must be positive" in proc.stderr
    assert "Traceback" not in proc.stderr
