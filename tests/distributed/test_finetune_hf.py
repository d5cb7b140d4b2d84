"""LoRA fine-tuning from a Hugging Face checkpoint with ``--hf-checkpoint DIR``, as the entry point
runs it: the model is built from the checkpoint's config.json, every rank reads its own slices of
the weights, and the tokenizer (with its chat template) is the checkpoint's.

- under EP=2 (the trainer's own set-up on the rank pool), the held-out loss before training is
  transformers' loss of the same checkpoint on the same batches (LoRA starts at zero), so the
  weights and the tokenizer really are the checkpoint's; the adapter then trains;
- Kimi-K2.5 (a MoonViT tower and projector before a DeepSeek-V3 language model): ``--task text``
  fine-tunes its language model (held-out loss before training = transformers' on text, under
  EP=2); ``--task image-text`` fine-tunes the whole model on image questions from the checkpoint
  as users get one (weights, tokenizer with Kimi's media tokens, ``preprocessor_config.json``):
  the held-out loss before training is transformers' on the same image+text batches, LoRA on the
  language model, the tower's attention and the projector trains, and PEFT's model with the
  exported adapter gives the trained model's image+text logits;
- Qwen3-VL-MoE (a Qwen3-VL tower with DeepStack before a Qwen3-MoE language model with M-RoPE)
  as users get it (tokenizer with Qwen's vision tokens, Qwen2-VL's image processor settings):
  the token ids are transformers', the held-out loss before training is transformers' under
  EP=2, ten LoRA steps train and PEFT's model with the exported adapter gives our logits; full
  recompute, DeepStack layers beyond the first pipeline stage and another processor's settings
  are refused in one line;
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
    from megatron_slmoe.training.recipe import build_engine
    from megatron_slmoe.training.finetune import parse

    engine = build_engine(parse(args).run, megatron_slmoe.PLATFORM)
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
    from megatron_slmoe.lora.adapter import load_adapter, read_adapter_config
    from megatron_slmoe.lora.inject import inject_lora
    from megatron_slmoe.training.recipe import build_engine
    from megatron_slmoe.training.finetune import parse

    assert build_engine(parse(args).run, megatron_slmoe.PLATFORM).run() == 0
    model, _ = hf_models.load_kimi(hf_dir)
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


MEDIA_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>")
IMAGE_TEXT_SEQ = 96  # a shapes question (~40 tokens of this small tokenizer) and its 32x32 image


def _kimi_image_text_model(image_token_id: int):
    return hf_models.build_kimi(text_overrides=dict(vocab_size=VOCAB,
                                                    max_position_embeddings=IMAGE_TEXT_SEQ),
                                image_token_id=image_token_id)


def _chatml_tokenizer_with(hf_dir: Path, special_tokens) -> "tokenizers.Tokenizer":
    """The ChatML test tokenizer saved into ``hf_dir`` with a model's special tokens added."""
    import tokenizers

    hf_models.save_chatml_tokenizer(hf_dir)
    backend = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    backend.add_special_tokens(list(special_tokens))
    backend.save(str(hf_dir / "tokenizer.json"))
    return backend


@pytest.fixture(scope="module")
def kimi_image_text_checkpoint(tmp_path_factory):
    """Kimi-K2.5 as users get it: the weights, a tokenizer holding Kimi's media tokens (the image
    placeholder is config.json's image_token_id) and the image processor's settings."""
    import json

    hf_dir = tmp_path_factory.mktemp("hf-image-text") / "kimi-k25"
    hf_dir.mkdir()
    backend = _chatml_tokenizer_with(hf_dir, MEDIA_TOKENS)
    model = _kimi_image_text_model(backend.token_to_id("<|media_pad|>"))
    hf_models.save(model, str(hf_dir), layout="fused")
    (hf_dir / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Kimi_K25ImageProcessor", "patch_size": 14, "merge_size": 2,
        "max_patches": 16384, "size": {"max_height": 512, "max_width": 512},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    return hf_dir, model


def _image_text_run(args: list[str], output: str, hf_dir: str, batch: dict):
    """The whole run (the entry point's engine); then its summary and this rank's image+text
    logits of the model it trained (the checkpoint with the run's adapter, built afresh)."""
    import json

    summary_path = os.path.join(output, "summary.json")
    logits = _run_and_logits(args, os.path.join(output, "adapter"), hf_dir, batch)
    with open(summary_path, encoding="utf-8") as f:
        return json.load(f), logits


def _held_out_batches(hf_dir: Path, dataset_dir: Path) -> list[dict]:
    """The held-out micro-batches of the run (one global batch of the shapes questions' val
    split, in order), as the task makes them from the checkpoint's processor settings."""
    from megatron_slmoe.data.image_text import ImageTextDataset, collate_image_text
    from megatron_slmoe.data.sampler import micro_batches
    from megatron_slmoe.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(hf_dir))
    images = hf_models.kimi_image_input(str(hf_dir), tokenizer)
    valid = ImageTextDataset(str(dataset_dir), tokenizer, IMAGE_TEXT_SEQ, images=images,
                             split="val", shuffle=False)
    return [collate_image_text([valid[i] for i in part])
            for part in micro_batches(range(GLOBAL_BATCH), MICRO_BATCH)], valid


def _transformers_ids(hf_dir: Path, messages: list[dict], grid: torch.Tensor) -> list[int]:
    """What transformers makes of a conversation with one image: the checkpoint's tokenizer and
    chat template (``apply_chat_template``), the image written as Kimi-K2.5 writes it, its
    placeholder repeated as ``Kimi_K25Processor`` repeats it (grid / 2x2 merge)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    image = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    text = tokenizer.apply_chat_template(
        [{**m, "content": m["content"].replace("<image>", image)} for m in messages],
        tokenize=False)
    text = text.replace("<|media_pad|>", "<|media_pad|>" * (int(grid.prod()) // 4))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _transformers_loss(model, batches: list[dict]) -> float:
    """Mean over micro-batches of the masked token mean, with transformers' model."""
    per_micro_batch = []
    for batch in batches:
        with torch.no_grad():
            logits = model(input_ids=batch["tokens"], pixel_values=batch["pixel_values"],
                           image_grid_thw=batch["image_grid_thw"]).logits.float()
        token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"],
                                                       reduction="none")
        mask = batch["loss_mask"].float()
        per_micro_batch.append(float((token_loss * mask).sum() / mask.sum()))
    return sum(per_micro_batch) / len(per_micro_batch)


def test_kimi_k25_fine_tunes_on_image_questions(kimi_image_text_checkpoint, tmp_path):
    """``--task image-text --hf-checkpoint`` under EP=2, ten steps on the shapes questions, LoRA
    on attention, experts, the tower's attention and the projector, exported for PEFT."""
    from peft import PeftModel

    hf_dir, model = kimi_image_text_checkpoint
    output, peft_dir = tmp_path / "run", tmp_path / "peft"
    args = _args(hf_dir, output, "--task", "image-text", "--expert-model-parallel-size", "2",
                 "--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1",
                 "linear_fc2", "vision_attention", "projector", "--export-hf", str(peft_dir),
                 "--export-hf-layout", "fused", "--eval-answers", "0")
    args[args.index("--seq-length") + 1] = str(IMAGE_TEXT_SEQ)
    args[args.index("--train-iters") + 1] = "10"
    # The held-out batches come from the dataset the run makes in its folder: made here first
    # (deterministic), so the reference needs nothing from the run.
    from megatron_slmoe.data.shapes import ensure_shapes_task

    ensure_shapes_task(str(output / "data" / "shapes"))
    batches, valid = _held_out_batches(hf_dir, output / "data" / "shapes" / "vqa")
    batch = batches[0]
    messages, _, _ = valid._read(0)
    ids = _transformers_ids(hf_dir, messages, batch["image_grid_thw"][0])
    n = len(ids) - 1
    assert batch["tokens"][0, :n].tolist() == ids[:-1]
    assert batch["labels"][0, :n].tolist() == ids[1:]
    inputs = {"input_ids": batch["tokens"], "pixel_values": batch["pixel_values"],
              "image_grid_thw": batch["image_grid_thw"]}
    results = run_ranks(_image_text_run, 2, ep=2, args=args, output=str(output),
                        hf_dir=str(hf_dir), batch=inputs, timeout=600.0)
    (summary, ours), (_, ours_1) = results
    torch.testing.assert_close(ours, ours_1)
    assert summary["eval_loss_before"] == pytest.approx(_transformers_loss(model, batches),
                                                        rel=1e-5)
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    peft_model = PeftModel.from_pretrained(_kimi_image_text_model(model.config.image_token_id),
                                           str(peft_dir)).eval()
    theirs = hf_models.kimi_hf_logits(peft_model, inputs)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=2e-5)
    assert (theirs - hf_models.kimi_hf_logits(model, inputs)).abs().max() > 1e-3  # it trained
    tower_adapters = [n for n, _ in peft_model.named_parameters()
                      if "vision_tower" in n and "lora_B" in n]
    assert tower_adapters and any(p.abs().max() > 0 for n, p in peft_model.named_parameters()
                                  if n in tower_adapters)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_kimi_k25_image_text_held_out_loss_in_other_layouts(kimi_image_text_checkpoint,
                                                            tmp_path, layout):
    """TP=2 (sequence parallel: the image embeddings go in before the sequence is split) and
    PP=2 (the tower on the first stage): the held-out loss before training is transformers'."""
    from megatron_slmoe.data.shapes import ensure_shapes_task

    hf_dir, model = kimi_image_text_checkpoint
    output = tmp_path / "run"
    flag = {"tp2": "--tensor-model-parallel-size", "pp2": "--pipeline-model-parallel-size"}
    args = _args(hf_dir, output, "--task", "image-text", flag[layout], "2",
                 "--eval-answers", "0")
    args[args.index("--seq-length") + 1] = str(IMAGE_TEXT_SEQ)
    ensure_shapes_task(str(output / "data" / "shapes"))
    batches, _ = _held_out_batches(hf_dir, output / "data" / "shapes" / "vqa")
    results = run_ranks(finetune_steps, 2, **{layout[:2]: 2}, etp=1, args=args)
    assert results[0] == results[1]
    assert results[0]["eval_before"] == pytest.approx(_transformers_loss(model, batches),
                                                      rel=1e-5)
    assert all(torch.isfinite(torch.tensor(results[0]["losses"])))


def _our_answers(hf_dir: str, dataset_dir: str, limit: int, new_tokens: int):
    """Greedy answers of the checkpoint's model (built and loaded as a run does, EP over the
    ranks) to the first held-out image questions, through the package's generator."""
    from megatron_slmoe.data.image_text import ImageTextDataset
    from megatron_slmoe.data.tokenizer import load_tokenizer
    from megatron_slmoe.inference.generator import TextGenerator

    tokenizer = load_tokenizer(hf_dir)
    valid = ImageTextDataset(dataset_dir, tokenizer, IMAGE_TEXT_SEQ, split="val", shuffle=False,
                             images=hf_models.kimi_image_input(hf_dir, tokenizer))
    prompts = [prompt for prompt, _ in valid.generation_examples(limit)]
    model, _ = hf_models.load_kimi(hf_dir)
    answers = TextGenerator(model, tokenizer.eos_id, VOCAB).generate(prompts, new_tokens)
    return answers, prompts, tokenizer.eos_id


def test_kimi_k25_answers_image_questions_as_transformers_does(kimi_image_text_checkpoint,
                                                               tmp_path):
    """Held-out answers of a checkpoint's own tower (prompts with one placeholder per image
    token, the images entering the KV cache with the prefill) under EP=2 equal transformers'
    greedy ``generate`` on the same prompts and images."""
    from megatron_slmoe.data.shapes import ensure_shapes_task

    hf_dir, model = kimi_image_text_checkpoint
    ensure_shapes_task(str(tmp_path / "shapes"))
    results = run_ranks(_our_answers, 2, ep=2, hf_dir=str(hf_dir),
                        dataset_dir=str(tmp_path / "shapes" / "vqa"), limit=4, new_tokens=6)
    (ours, prompts, eos), (ours_1, _, _) = results
    assert ours == ours_1 and len(ours) == 4
    assert sum(len(answer) for answer in ours) > 4  # tokens to compare, not only end-of-turns
    for prompt, answer in zip(prompts, ours):
        assert prompt.image_grid_thw is not None and prompt.images.shape[0] > 0
        input_ids = torch.tensor([prompt.tokens])
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, pixel_values=prompt.images,
                                 image_grid_thw=prompt.image_grid_thw, max_new_tokens=6,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos)
        theirs = out[0, input_ids.shape[1]:].tolist()
        theirs = theirs[:theirs.index(eos)] if eos in theirs else theirs
        assert answer == theirs


def _without_processor_config(hf_dir: Path, tmp_path: Path) -> Path:
    bare = tmp_path / "no-processor"
    shutil.copytree(hf_dir, bare)
    (bare / "preprocessor_config.json").unlink()
    return bare


def _without_media_tokens(hf_dir: Path, tmp_path: Path) -> Path:
    plain = tmp_path / "plain-tokenizer"
    shutil.copytree(hf_dir, plain)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (plain / name).unlink()
    hf_models.save_chatml_tokenizer(plain)
    return plain


@pytest.mark.parametrize("case, message", [
    ("no processor settings", "preprocessor_config.json: missing"),
    ("tokenizer without media tokens", "renders 0 tokens of config.json's image_token_id"),
    ("our tower's flags", "--img-h is a setting of our own multimodal model"),
    ("a language model", "qwen3_moe checkpoint has no image input"),
])
def test_kimi_k25_image_text_refusals_in_one_line(kimi_image_text_checkpoint, checkpoint,
                                                  tmp_path, capsys, case, message):
    from megatron_slmoe.training.finetune import main

    hf_dir, extra = kimi_image_text_checkpoint[0], []
    if case == "no processor settings":
        hf_dir = _without_processor_config(hf_dir, tmp_path)
    elif case == "tokenizer without media tokens":
        hf_dir = _without_media_tokens(hf_dir, tmp_path)
    elif case == "our tower's flags":
        extra = ["--img-h", "64"]
    else:
        hf_dir = checkpoint[0]
    args = _args(hf_dir, tmp_path / "run", "--task", "image-text", "--validate-only", *extra)
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()


def _blank_image_gradients(hf_dir: str):
    """This rank's tower with LoRA on its attention, in training: a micro-batch without images
    still gives every adapter of the tower a gradient (zero), as Megatron's DDP waits for."""
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.inject import inject_lora

    model, _ = hf_models.load_kimi(hf_dir)
    inject_lora([model], LoRAConfig(rank=2, targets=["linear_qkv", "vision_attention"]))
    model.train()
    tokens = torch.randint(0, 100, (2, IMAGE_TEXT_SEQ))
    positions = torch.arange(IMAGE_TEXT_SEQ).expand(2, -1)
    empty = dict(pixel_values=torch.zeros(0, 3, 14, 14), image_grid_thw=torch.zeros(0, 3))
    results = {}
    for name, images in (("none", {}), ("empty", empty)):
        model.zero_grad(set_to_none=True)
        model.embed(tokens, positions, **images).sum().backward()
        tower = {n: p for n, p in model.vision.named_parameters() if p.requires_grad}
        results[name] = (len(tower), all(p.grad is not None and not p.grad.any()
                                         for p in tower.values()))
    return results


def test_kimi_k25_tower_keeps_gradients_without_images(kimi_image_text_checkpoint):
    hf_dir, _ = kimi_image_text_checkpoint
    results = run_ranks(_blank_image_gradients, 2, ep=2, hf_dir=str(hf_dir))
    for result in results:
        assert result["none"][0] > 0 and result["none"] == result["empty"] == (
            result["none"][0], True)


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


def _start_up_openings(args: list[str]) -> dict:
    """The entry point's whole run on this rank, counting each opening of the HF checkpoint
    (``HFCheckpoint.open``, under every way in) and of a tokenizer (``Tokenizer``): how many by
    the end of the engine's set-up, and in all."""
    from megatron_slmoe.data.tokenizer import Tokenizer
    from megatron_slmoe.hf.checkpoint import HFCheckpoint
    from megatron_slmoe.training.engine import Engine
    from megatron_slmoe.training.finetune import main

    opened = {"checkpoint": [], "tokenizer": []}
    at_setup = {}
    open_checkpoint, make_tokenizer, setup = HFCheckpoint.open.__func__, Tokenizer.__init__, \
        Engine.setup

    def counted_open(cls, directory):
        opened["checkpoint"].append(str(directory))
        return open_checkpoint(cls, directory)

    def counted_tokenizer(self, *args, **kwargs):
        opened["tokenizer"].append(kwargs.get("path"))
        make_tokenizer(self, *args, **kwargs)

    def counted_setup(self):
        ctx = setup(self)
        at_setup.update({what: len(names) for what, names in opened.items()})
        return ctx

    HFCheckpoint.open, Tokenizer.__init__ = classmethod(counted_open), counted_tokenizer
    Engine.setup = counted_setup
    try:
        code = main(args)
    finally:
        HFCheckpoint.open, Tokenizer.__init__ = classmethod(open_checkpoint), make_tokenizer
        Engine.setup = setup
    return {"code": code, "at_setup": at_setup, "opened": opened}


def test_start_up_opens_the_checkpoint_and_its_tokenizer_once(checkpoint, tmp_path):
    """The entry point's run (checks, then the engine given the prepared run) from an HF
    checkpoint and a PEFT adapter converted at start-up: the checkpoint and the tokenizer are
    each opened once on the rank, by the checks; set-up, the conversion, the run and the PEFT
    export at its end reuse them."""
    from peft import LoraConfig, get_peft_model

    hf_dir, _ = checkpoint
    base = hf_models.build("qwen3_moe", vocab_size=VOCAB, max_position_embeddings=SEQ)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                        init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(str(tmp_path / "peft"))
    args = _args(hf_dir, tmp_path / "run", "--adapter-init", str(tmp_path / "peft"),
                 "--export-hf", str(tmp_path / "exported"), "--export-hf-layout", "fused")
    args[args.index("--train-iters") + 1] = "1"
    result = run_ranks(_start_up_openings, 1, args=args)[0]
    assert result["code"] == 0
    assert (tmp_path / "exported" / "adapter_config.json").is_file()
    assert result["opened"]["checkpoint"] == [str(hf_dir)]
    assert result["at_setup"] == {"checkpoint": 1, "tokenizer": 1}
    assert len(result["opened"]["tokenizer"]) == 1


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


# --- Qwen3-VL-MoE: Qwen2-VL's image processor, DeepStack, M-RoPE --------------------------------

QWEN_VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


def _qwen3_vl_image_text_model(image_token_id: int):
    return hf_models.build_qwen3_vl_moe(vocab_size=VOCAB,
                                        max_position_embeddings=IMAGE_TEXT_SEQ,
                                        image_token_id=image_token_id)


@pytest.fixture(scope="module")
def qwen3_vl_image_text_checkpoint(tmp_path_factory):
    """Qwen3-VL-MoE as users get it: the weights, a tokenizer holding Qwen's vision tokens (the
    image placeholder is config.json's image_token_id) and Qwen2-VL's image processor
    settings (the shapes' 32x32 images are scaled up to 64x64: 4x4 patches, 4 image tokens)."""
    import json

    hf_dir = tmp_path_factory.mktemp("hf-image-text") / "qwen3-vl-moe"
    hf_dir.mkdir()
    backend = _chatml_tokenizer_with(hf_dir, QWEN_VISION_TOKENS)
    model = _qwen3_vl_image_text_model(backend.token_to_id("<|image_pad|>"))
    hf_models.save(model, str(hf_dir), layout="fused")
    (hf_dir / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2,
        "size": {"shortest_edge": 64 * 64, "longest_edge": 128 * 128},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    return hf_dir, model


def _qwen3_vl_logits(model, inputs: dict) -> torch.Tensor:
    image = inputs["input_ids"] == model.config.image_token_id
    with torch.no_grad():
        return model(**inputs, mm_token_type_ids=image.int()).logits.float()


def test_qwen3_vl_moe_fine_tunes_on_image_questions(qwen3_vl_image_text_checkpoint, tmp_path):
    """``--task image-text --hf-checkpoint`` on Qwen3-VL-MoE under EP=2: the token ids are
    transformers' (its chat template, each image written <|vision_start|><|image_pad|>
    <|vision_end|> with the placeholder repeated per merged patch); the held-out loss before
    training is transformers'; ten steps of LoRA on the language model, the tower's attention
    and the mergers train, and PEFT's model with the exported adapter gives our logits."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from megatron_slmoe.data.image_text import ImageTextDataset, collate_image_text
    from megatron_slmoe.data.sampler import micro_batches
    from megatron_slmoe.data.shapes import ensure_shapes_task
    from megatron_slmoe.data.tokenizer import load_tokenizer

    hf_dir, model = qwen3_vl_image_text_checkpoint
    output, peft_dir = tmp_path / "run", tmp_path / "peft"
    args = _args(hf_dir, output, "--task", "image-text", "--expert-model-parallel-size", "2",
                 "--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1",
                 "linear_fc2", "vision_attention", "projector", "--export-hf", str(peft_dir),
                 "--export-hf-layout", "fused", "--eval-answers", "0")
    args[args.index("--seq-length") + 1] = str(IMAGE_TEXT_SEQ)
    args[args.index("--train-iters") + 1] = "10"
    ensure_shapes_task(str(output / "data" / "shapes"))
    tokenizer = load_tokenizer(str(hf_dir))
    images = hf_models.kimi_image_input(str(hf_dir), tokenizer)
    valid = ImageTextDataset(str(output / "data" / "shapes" / "vqa"), tokenizer,
                             IMAGE_TEXT_SEQ, images=images, split="val", shuffle=False)
    batches = [collate_image_text([valid[i] for i in part])
               for part in micro_batches(range(GLOBAL_BATCH), MICRO_BATCH)]
    batch = batches[0]
    assert batch["image_grid_thw"][0].tolist() == [1, 4, 4]
    messages, _, _ = valid._read(0)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    text = hf_tokenizer.apply_chat_template(
        [{**m, "content": m["content"].replace(
            "<image>", "<|vision_start|><|image_pad|><|vision_end|>")} for m in messages],
        tokenize=False).replace("<|image_pad|>", "<|image_pad|>" * 4)
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert batch["tokens"][0, :len(ids) - 1].tolist() == ids[:-1]
    inputs = {"input_ids": batch["tokens"], "pixel_values": batch["pixel_values"],
              "image_grid_thw": batch["image_grid_thw"]}
    results = run_ranks(_image_text_run, 2, ep=2, args=args, output=str(output),
                        hf_dir=str(hf_dir), batch=inputs, timeout=600.0)
    (summary, ours), (_, ours_1) = results
    torch.testing.assert_close(ours, ours_1)
    theirs_before = []
    for b in batches:
        logits = _qwen3_vl_logits(model, {"input_ids": b["tokens"],
                                          "pixel_values": b["pixel_values"],
                                          "image_grid_thw": b["image_grid_thw"]})
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), b["labels"],
                                                 reduction="none")
        mask = b["loss_mask"].float()
        theirs_before.append(float((loss * mask).sum() / mask.sum()))
    assert summary["eval_loss_before"] == pytest.approx(
        sum(theirs_before) / len(theirs_before), rel=1e-5)
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    peft_model = PeftModel.from_pretrained(
        _qwen3_vl_image_text_model(model.config.image_token_id), str(peft_dir)).eval()
    theirs = _qwen3_vl_logits(peft_model, inputs)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=2e-5)
    assert (theirs - _qwen3_vl_logits(model, inputs)).abs().max() > 1e-3  # it trained


@pytest.mark.parametrize("case,message", [
    ("full recompute", "a full recompute would recompute without them"),
    ("DeepStack beyond the first stage", "the first stage would hold 1 decoder layers"),
    ("Kimi's processor settings", "is not Qwen2-VL's"),
])
def test_qwen3_vl_moe_refusals_in_one_line(qwen3_vl_image_text_checkpoint, tmp_path, capsys,
                                           monkeypatch, case, message):
    import json

    from megatron_slmoe.training.finetune import main

    hf_dir, extra = qwen3_vl_image_text_checkpoint[0], []
    if case == "full recompute":
        extra = ["--recompute-granularity", "full"]
    elif case == "DeepStack beyond the first stage":
        bare = tmp_path / "deepstack"
        shutil.copytree(hf_dir, bare)
        config = json.loads((bare / "config.json").read_text())
        config["vision_config"]["deepstack_visual_indexes"] = [0, 1]
        (bare / "config.json").write_text(json.dumps(config))
        # (the second DeepStack merger's weights are not there: the check comes before)
        hf_dir, extra = bare, ["--pipeline-model-parallel-size", "2", "--no-hf-shape-check"]
        monkeypatch.setenv("WORLD_SIZE", "2")
    else:
        bare = tmp_path / "kimi-processor"
        shutil.copytree(hf_dir, bare)
        (bare / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "Kimi_K25ImageProcessor", "patch_size": 14}))
        hf_dir = bare
    args = _args(hf_dir, tmp_path / "run", "--task", "image-text", "--validate-only", *extra)
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()
