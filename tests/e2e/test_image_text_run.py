"""An image-text LoRA run as users start it (torchrun, 2 processes, EP 2) on an energon dataset
with bad records in its shards: the run finishes, names each bad record with its shard and key in
the log, counts them in metrics.jsonl and summary.json (each distinct record once, whichever rank
met it), and reports the held-out loss and answer accuracy before and after."""

import io
import json
import random
import subprocess
import sys
from pathlib import Path

from PIL import Image

REPO = Path(__file__).resolve().parents[2]
BAD = {"undecodable image": ["train_00000003", "val_00000001"],
       "image count mismatch": ["train_00000007"]}


def _dataset(root: Path) -> Path:
    """20 training and 6 held-out shape questions; three records broken inside the shards."""
    from megatron_slmoe.data.image_text_prepare import (ShardRecord, index_energon_dataset,
                                                        write_shards)
    from megatron_slmoe.data.shapes import draw_scene, make_scene, question

    def records(split, count):
        out = []
        for i in range(count):
            rng = random.Random(f"e2e:{split}:{i}")
            scene = make_scene(rng)
            user, answer = question(scene, rng)
            png = draw_scene(scene, rng)
            key = f"{split}_{i:08d}"
            if key in BAD["undecodable image"]:
                png = png[: len(png) // 2]
            if key in BAD["image count mismatch"]:
                user = f"<image> and <image> {user}"
            messages = [{"role": "user", "content": f"<image>\n{user}" if "<image>" not in user
                         else user}, {"role": "assistant", "content": answer}]
            out.append(ShardRecord({"id": key, "messages": messages}, [("png", png)]))
        return out

    path = root / "shapes"
    write_shards(records("train", 20), str(path), "train", 8)
    write_shards(records("val", 6), str(path), "val", 8)
    index_energon_dataset(str(path), "chat")
    return path


def test_image_text_lora_run_reports_bad_samples_and_accuracy(tmp_path):
    import megatron_slmoe  # noqa: F401

    data = _dataset(tmp_path)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megatron_slmoe.training.finetune", "--task", "image-text",
           "--train-data", str(data), "--eval-answers", "4", "--max-answer-tokens", "2",
           "--expert-model-parallel-size", "2", "--seq-length", "48", "--micro-batch-size", "2",
           "--global-batch-size", "4", "--train-iters", "4", "--lr-warmup-iters", "1",
           "--eval-iters", "1", "--log-interval", "2", "--save-interval", "4", "--lora-rank", "4",
           "--fp32", "--no-tensorboard", "--output-dir", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    for reason, keys in BAD.items():
        for key in keys:
            shard = "train/shard-000000.tar" if key.startswith("train") else "val/shard-000000.tar"
            assert any(shard in line and repr(key) in line and f"skipped {reason}" in line
                       for line in log.splitlines()), (key, log[-3000:])
    expected = {"undecodable image": 2, "image count mismatch": 1, "path escapes dataset": 0,
                "malformed record": 0, "too long": 0}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["bad_samples"] == expected
    summary = json.loads((out / "summary.json").read_text())
    assert summary["bad_samples"] == expected
    assert summary["task"] == "image-text"
    for key in ("accuracy_before", "accuracy_after"):
        assert 0.0 <= summary[key] <= 1.0
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    assert "held-out answer accuracy" in log
