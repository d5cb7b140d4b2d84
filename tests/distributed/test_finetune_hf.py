"""LoRA fine-tuning from a Hugging Face checkpoint with ``--hf-checkpoint DIR``, as the entry point
runs it: the model is built from the checkpoint's config.json, every rank reads its own slices of
the weights, and the tokenizer (with its chat template) is the checkpoint's.

- under EP=2 (the trainer's own set-up on the rank pool), the held-out loss before training is
  transformers' loss of the same checkpoint on the same batches (LoRA starts at zero), so the
  weights and the tokenizer really are the checkpoint's; the adapter then trains;
- Kimi-K2.5 (a MoonViT tower and projector before a DeepSeek-V3 language model): ``--task text``
  fine-tunes its language model (held-out loss before training = transformers' on text, under
  EP=2), ``--task image-text`` is refused before start-up in one line;
- the entry point's checks before start-up pass on it; the launcher (``HF_CHECKPOINT``) refuses
  a truncated shard in one line, exit code 2, before torchrun starts (``--validate-only``).
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import hf_models
from tests.helpers.entry_point import REPO
from tests.helpers.ranks import run_ranks

VOCAB = 320  # holds the ChatML test tokenizer's ~300 tokens
SEQ, GLOBAL_BATCH, MICRO_BATCH, ITERS = 64, 8, 2, 2


def _args(hf_dir: Path, output: Path, *extra: str) -> list[str]:
    return ["--hf-checkpoint", str(hf_dir), "--seq-length", str(SEQ),
            "--global-batch-size", str(GLOBAL_BATCH), "--micro-batch-size", str(MICRO_BATCH),
            "--train-iters", str(ITERS), "--lr", "1e-2", "--lr-warmup-iters", "0",
            "--eval-iters", "1", "--lora-rank", "4", "--fp32", "--no-tensorboard",
            "--output-dir", str(output), *extra]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Qwen3-MoE checkpoint with a ChatML tokenizer, and the transformers model."""
    hf_dir = tmp_path_factory.mktemp("hf-finetune") / "qwen3-moe"
    model = hf_models.save_family("qwen3_moe", str(hf_dir), vocab_size=VOCAB,
                                  max_position_embeddings=SEQ)
    hf_models.save_chatml_tokenizer(hf_dir)
    return hf_dir, model


def finetune_steps(args: list[str]) -> dict:
    """The entry point's engine, in-process: set-up, held-out loss, ITERS steps, held-out loss."""
    import megatron_slmoe
    from megatron_slmoe.training.engine import Engine
    from megatron_slmoe.training.finetune import parse

    engine = Engine(parse(args).run, megatron_slmoe.PLATFORM)
    engine.setup()
    eval_before = engine.evaluate()
    losses = [engine.train_step()["loss"] for _ in range(ITERS)]
    eval_after = engine.evaluate()
    return {"eval_before": eval_before, "losses": losses, "eval_after": eval_after}


@pytest.fixture(scope="module")
def ep2_run(checkpoint):
    hf_dir, _ = checkpoint
    output = hf_dir.parent / "ep2"
    results = run_ranks(finetune_steps, 2, ep=2,
                        args=_args(hf_dir, output, "--expert-model-parallel-size", "2"))
    assert results[0] == results[1]  # every rank reports the reduced losses
    return output, results[0]


@pytest.fixture(scope="module")
def kimi_checkpoint(tmp_path_factory):
    hf_dir = tmp_path_factory.mktemp("hf-finetune") / "kimi-k25"
    model = hf_models.build_kimi(text_overrides=dict(vocab_size=VOCAB,
                                                     max_position_embeddings=SEQ))
    hf_models.save(model, str(hf_dir), layout="fused")
    hf_models.save_chatml_tokenizer(hf_dir)
    return hf_dir, model


def test_kimi_k25_language_model_fine_tunes_on_text(kimi_checkpoint):
    hf_dir, model = kimi_checkpoint
    output = hf_dir.parent / "kimi-ep2"
    results = run_ranks(finetune_steps, 2, ep=2,
                        args=_args(hf_dir, output, "--expert-model-parallel-size", "2"))
    assert results[0] == results[1]
    result = results[0]
    assert result["eval_before"] == pytest.approx(_transformers_held_out_loss(hf_dir, model),
                                                  rel=1e-5)
    assert result["losses"][1] != result["losses"][0]
    assert result["eval_after"] != result["eval_before"]


def _run_and_logits(args: list[str], adapter: str, hf_dir: str, inputs: dict):
    """The whole run (the entry point's engine), then this rank's logits on an image+text batch
    of the model the run trained: the checkpoint with the run's adapter, built afresh."""

    import megatron_slmoe
    from megatron_slmoe.hf.convert import build_model_in_layout
    from megatron_slmoe.hf.loader import load_hf_weights, open_hf_checkpoint
    from megatron_slmoe.hf.tower_model import hf_model_builder
    from megatron_slmoe.lora.adapter import load_adapter, read_adapter_config
    from megatron_slmoe.lora.inject import inject_lora
    from megatron_slmoe.training.engine import Engine
    from megatron_slmoe.training.finetune import parse

    assert Engine(parse(args).run, megatron_slmoe.PLATFORM).run() == 0
    hf = open_hf_checkpoint(hf_dir)
    model, _ = build_model_in_layout(hf.model_config, build=hf_model_builder(hf))
    load_hf_weights([model], hf_dir, hf)
    lora_config, _ = read_adapter_config(adapter)
    inject_lora([model], lora_config)
    load_adapter([model], adapter)
    return hf_models.megatron_logits(model, inputs["input_ids"],
                                     pixel_values=inputs["pixel_values"],
                                     image_grid_thw=inputs["image_grid_thw"])


def test_kimi_k25_trained_adapter_in_peft_gives_our_image_text_logits(kimi_checkpoint, tmp_path):
    """Ten LoRA steps on text under EP=2 with the run's own PEFT export (--export-hf, fused
    experts): PEFT's Kimi_K25ForConditionalGeneration with it gives our image+text logits."""
    from peft import PeftModel

    hf_dir, model = kimi_checkpoint
    output, peft_dir = tmp_path / "run", tmp_path / "peft"
    args = [*_args(hf_dir, output, "--expert-model-parallel-size", "2", "--export-hf",
                   str(peft_dir), "--export-hf-layout", "fused")]
    args[args.index("--train-iters") + 1] = "10"
    inputs = hf_models.kimi_inputs()
    ours = run_ranks(_run_and_logits, 2, ep=2, args=args, adapter=str(output / "adapter"),
                     hf_dir=str(hf_dir), inputs=inputs, timeout=600.0)
    torch.testing.assert_close(ours[0], ours[1])
    peft_model = PeftModel.from_pretrained(
        hf_models.build_kimi(text_overrides=dict(vocab_size=VOCAB, max_position_embeddings=SEQ)),
        str(peft_dir)).eval()
    theirs = hf_models.kimi_hf_logits(peft_model, inputs)
    torch.testing.assert_close(theirs, ours[0], rtol=1e-5, atol=2e-5)
    assert (theirs - hf_models.kimi_hf_logits(model, inputs)).abs().max() > 1e-3  # it trained


def test_kimi_k25_image_text_task_is_refused_in_one_line(kimi_checkpoint, tmp_path, capsys):
    from megatron_slmoe.training.finetune import main

    hf_dir, _ = kimi_checkpoint
    assert main([*_args(hf_dir, tmp_path / "run"), "--task", "image-text",
                 "--validate-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--task image-text does not take --hf-checkpoint" in err[0], err
    assert not (tmp_path / "run").exists()


def _transformers_held_out_loss(hf_dir: Path, model) -> float:
    """The entry point's held-out loss (one global batch of the shipped eval set, mean over micro
    batches of the masked token mean), computed with transformers' model."""
    from megatron_slmoe.data.assets import asset_path
    from megatron_slmoe.data.instruction import InstructionDataset
    from megatron_slmoe.data.sampler import collate, micro_batches
    from megatron_slmoe.data.tokenizer import load_tokenizer

    valid = InstructionDataset(asset_path("digits_eval.jsonl"), load_tokenizer(str(hf_dir)), SEQ,
                               seed=1234, shuffle=False)
    per_micro_batch = []
    for part in micro_batches(range(GLOBAL_BATCH), MICRO_BATCH):
        batch = collate([valid[i % len(valid)] for i in part])
        with torch.no_grad():
            logits = model(input_ids=batch["tokens"]).logits.float()
        token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"],
                                                       reduction="none")
        mask = batch["loss_mask"].float()
        per_micro_batch.append(float((token_loss * mask).sum() / mask.sum()))
    return sum(per_micro_batch) / len(per_micro_batch)


def test_weights_and_tokenizer_are_the_checkpoints(ep2_run, checkpoint):
    hf_dir, model = checkpoint
    output, result = ep2_run
    assert result["eval_before"] == pytest.approx(_transformers_held_out_loss(hf_dir, model),
                                                  rel=1e-5)
    config = yaml.safe_load((output / "config.yaml").read_text())
    assert config["model"]["hf_checkpoint"] == str(hf_dir)
    assert config["data"]["tokenizer"] == str(hf_dir)  # the default, recorded


def test_the_adapter_trains(ep2_run):
    _, result = ep2_run
    assert all(torch.isfinite(torch.tensor(result["losses"])))
    assert result["losses"][1] != result["losses"][0]
    assert result["eval_after"] != result["eval_before"]


def test_entry_point_accepts_the_checkpoint_before_start_up(checkpoint, tmp_path, capsys):
    """``--validate-only`` (what the launcher runs before torchrun): config.json, every shard
    header and tensor shape, the checkpoint's tokenizer and the memory check, in-process."""
    from megatron_slmoe.training.finetune import main

    hf_dir, _ = checkpoint
    group_before = torch.distributed.is_initialized()  # other in-process tests may leave one
    assert main([*_args(hf_dir, tmp_path / "run"), "--validate-only"]) == 0, capsys.readouterr()
    assert torch.distributed.is_initialized() == group_before  # forms no process group
    assert not (tmp_path / "run").exists()


def test_launcher_refuses_a_truncated_shard_before_torchrun(checkpoint, tmp_path):
    hf_dir, _ = checkpoint
    broken = tmp_path / "broken"
    shutil.copytree(hf_dir, broken)
    shard = broken / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    marker = tmp_path / "torchrun-started"
    fake_torchrun = tmp_path / "torchrun"
    fake_torchrun.write_text(f"#!/bin/sh\ntouch {marker}\n")
    fake_torchrun.chmod(0o755)
    env = {**os.environ, "HF_CHECKPOINT": str(broken), "TORCHRUN": str(fake_torchrun),
           "NPROC_PER_NODE": "2", "SLMOE_PREFLIGHT": "0"}
    for name in ("NNODES", "NODE_RANK", "MASTER_ADDR", "RDZV_ENDPOINT", "NETWORK_PROFILE", "EP",
                 "TP", "MODEL_CONFIG", "BASE_CHECKPOINT"):
        env.pop(name, None)
    proc = subprocess.run(["bash", "scripts/pretrain_lora.sh", "--seq-length", str(SEQ),
                           "--output-dir", str(tmp_path / "run")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --hf-checkpoint: "), proc.stderr
    assert "model.safetensors" in lines[0] and "truncated" in lines[0]
    assert not marker.exists() and not (tmp_path / "run").exists()
