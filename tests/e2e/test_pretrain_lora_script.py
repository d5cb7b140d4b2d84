"""The main job as a user runs it: `bash scripts/pretrain_lora.sh` (torchrun, 2 CPU processes,
expert parallelism 2) trains, lowers the held-out loss and writes its summary."""

import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_pretrain_lora_script_trains_and_writes_summary(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        ["bash", "scripts/pretrain_lora.sh", "--train-iters", "30", "--output-dir", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ep=2" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 30
    # 30 steps take the tiny model well below a uniform guess on held-out sequences.
    assert summary["eval_loss_before"] > 0.9 * summary["uniform_loss"]
    assert summary["eval_loss_after"] < 0.5 * summary["eval_loss_before"]


def test_pretrain_lora_script_rejects_bad_flag_in_one_line(tmp_path):
    proc = subprocess.run(
        ["bash", "scripts/pretrain_lora.sh", "--train-iters", "0", "--output-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode != 0
    assert "--train-iters must be positive" in proc.stderr
    assert "Traceback" not in proc.stderr
