"""An image-text LoRA run of the entry point's trainer (Engine.run on 2 pool ranks, EP 2) on an
energon dataset with bad records in its shards: the run finishes, names each bad record with its
shard and key in the log, counts them in metrics.jsonl and summary.json (each distinct record
once, whichever rank met it), and reports the held-out loss and answer accuracy before and after
(with every answer in answers_{before,after}_training.jsonl).
(The torchrun launch itself is the text runs' test; `bash scripts/pretrain_lora.sh --task
image-text` is the demo.)"""

import json
import random
from pathlib import Path

from tests.helpers.ranks import run_ranks

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


def run_entry_point(args: list[str]) -> list[str]:
    """The entry point's whole run (Engine.run), in-process on a pool rank; its log lines."""
    import logging

    import megatron_slmoe
    from megatron_slmoe.training.recipe import build_engine
    from megatron_slmoe.training.finetune import parse

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("megatron_slmoe")
    handler, level = Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        assert build_engine(parse(args).run, megatron_slmoe.PLATFORM).run() == 0
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return lines


def test_image_text_lora_run_reports_bad_samples_and_accuracy(tmp_path):
    data = _dataset(tmp_path)
    out = tmp_path / "run"
    args = ["--task", "image-text", "--train-data", str(data), "--eval-answers", "4",
            "--max-answer-tokens", "2", "--expert-model-parallel-size", "2", "--seq-length", "48",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
            "--lr-warmup-iters", "1", "--eval-iters", "1", "--log-interval", "2",
            "--save-interval", "4", "--lora-rank", "4", "--fp32", "--no-tensorboard",
            "--output-dir", str(out)]
    logs = run_ranks(run_entry_point, 2, ep=2, args=args)
    log = "\n".join(line for lines in logs for line in lines)
    for reason, keys in BAD.items():
        for key in keys:
            shard = "train/shard-000000.tar" if key.startswith("train") else "val/shard-000000.tar"
            assert any(shard in line and repr(key) in line and f"skipped {reason}" in line
                       for line in log.splitlines()), (key, log[-3000:])
    expected = {"undecodable image": 2, "image count mismatch": 1, "path escapes dataset": 0,
                "malformed record": 0, "too long": 0, "undecodable video": 0,
                "video count mismatch": 0}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["bad_samples"] == expected
    summary = json.loads((out / "summary.json").read_text())
    assert summary["bad_samples"] == expected
    assert summary["task"] == "image-text"
    for key in ("accuracy_before", "accuracy_after"):
        assert 0.0 <= summary[key] <= 1.0
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    assert "held-out answer accuracy" in log
    # Every held-out answer (both data-parallel ranks' share; one record is undecodable), scored
    # as the summary's accuracy.
    from megatron_slmoe.data.shapes import score_answers

    for when in ("before", "after"):
        path = out / f"answers_{when}_training.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(rows) == 4 and all(set(r) == {"prompt", "answer", "reference"} for r in rows)
        correct, total = score_answers(str(path))["all"]
        assert correct / total == summary[f"accuracy_{when}"]
