"""LoRA fine-tuning of Qwen3-VL-MoE on video questions, as the entry point runs it
(``--task image-text --hf-checkpoint`` on energon shards of clips made by
``tools/prepare_image_text.py``): the held-out loss before training is transformers' on the same
clips, and after five LoRA steps (language model, the tower's attention, the mergers) it is
transformers + PEFT's with the run's exported adapter (1e-4)."""

import pytest
import torch

from tests.helpers import video_clips
from tests.helpers.ranks import run_ranks

SEQ, GLOBAL_BATCH, MICRO_BATCH, ITERS = 192, 4, 2, 5
DIRECTIONS = ("right", "left", "down", "up")


def _dataset(folder, clips):
    """Video questions, one clip each (a square moving in the named direction), as a JSONL
    with LLaMA-Factory's ``videos`` field; the same four records are the held-out split."""
    import json

    from megatron_slmoe.data.image_text_prepare import prepare_from_llava_json

    clips.mkdir()
    records = []
    for i, direction in enumerate(DIRECTIONS):
        frames = video_clips.random_frames(6, 64, 64, seed=i)
        (clips / f"{i}.mp4").write_bytes(video_clips.encode_clip(frames))
        records.append({"messages": [{"role": "user", "content": "<video>Which way?"},
                                     {"role": "assistant", "content": direction}],
                        "videos": [f"{i}.mp4"]})
    jsonl = folder / "questions.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    prepare_from_llava_json(str(folder / "ds"), str(jsonl), str(clips), val_json=str(jsonl))
    return folder / "ds"


def _run(args: list[str], output: str) -> dict:
    import json
    import os

    import megatron_slmoe
    from megatron_slmoe.training.recipe import build_engine
    from megatron_slmoe.training.finetune import parse

    assert build_engine(parse(args).run, megatron_slmoe.PLATFORM).run() == 0
    with open(os.path.join(output, "summary.json"), encoding="utf-8") as f:
        return json.load(f)


def _held_out_batches(hf_dir, dataset) -> list[dict]:
    from tests.helpers import hf_models

    from megatron_slmoe.data.image_text import ImageTextDataset, collate_image_text
    from megatron_slmoe.data.sampler import micro_batches
    from megatron_slmoe.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(hf_dir))
    valid = ImageTextDataset(str(dataset), tokenizer, SEQ,
                             images=hf_models.kimi_image_input(str(hf_dir), tokenizer),
                             split="val", shuffle=False)
    return [collate_image_text([valid[i] for i in part])
            for part in micro_batches(range(GLOBAL_BATCH), MICRO_BATCH)]


def _transformers_loss(model, batches) -> float:
    """Mean over micro-batches of the masked token mean, with transformers' model."""
    config = model.config
    losses = []
    for batch in batches:
        ids = batch["tokens"]
        types = (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()
        with torch.no_grad():
            logits = model(input_ids=ids, pixel_values_videos=batch["pixel_values_videos"],
                           video_grid_thw=batch["video_grid_thw"],
                           mm_token_type_ids=types).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"],
                                                 reduction="none")
        mask = batch["loss_mask"].float()
        losses.append(float((loss * mask).sum() / mask.sum()))
    return sum(losses) / len(losses)


def test_video_lora_held_out_loss_equals_transformers_and_peft(tmp_path):
    from peft import PeftModel

    hf_dir = tmp_path / "qwen3-vl-moe"
    model = video_clips.save_qwen3_vl_video_checkpoint(hf_dir, SEQ)
    dataset = _dataset(tmp_path, tmp_path / "clips")
    output, peft_dir = tmp_path / "run", tmp_path / "peft"
    args = ["--hf-checkpoint", str(hf_dir), "--task", "image-text", "--train-data", str(dataset),
            "--valid-data", str(dataset), "--seq-length", str(SEQ),
            "--global-batch-size", str(GLOBAL_BATCH), "--micro-batch-size", str(MICRO_BATCH),
            "--train-iters", str(ITERS), "--lr", "1e-2", "--lr-warmup-iters", "0",
            "--eval-iters", "1", "--lora-rank", "4", "--fp32", "--no-tensorboard",
            "--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
            "vision_attention", "projector", "--export-hf", str(peft_dir),
            "--export-hf-layout", "fused", "--eval-answers", "0", "--output-dir", str(output)]
    summary, = run_ranks(_run, 1, args=args, output=str(output), timeout=400.0)
    batches = _held_out_batches(hf_dir, dataset)
    assert all(b["video_grid_thw"].shape[0] == MICRO_BATCH for b in batches)
    assert summary["eval_loss_before"] == pytest.approx(_transformers_loss(model, batches),
                                                        rel=1e-4)
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    peft_model = PeftModel.from_pretrained(model, str(peft_dir)).eval()
    assert summary["eval_loss_after"] == pytest.approx(_transformers_loss(peft_model, batches),
                                                       rel=1e-4)
