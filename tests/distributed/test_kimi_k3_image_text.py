"""Kimi K3 image+text on gloo ranks (issue 43): a tiny K3 release checkpoint with its MoonViT3D
tower and projector (6 text layers, KDA and gated NoPE MLA on both sides of the stage boundary,
Attention Residual blocks of 2 so the bank crosses it mid-block), a ChatML tokenizer holding K3's
media tokens and the release's processor settings:

- under PP=2 (the tower on the first stage) its image+text logits and its video+text logits
  (clips' 4-frame chunks through the tower, time embedding and pooling) are one rank's, and
  under EP=2 its video+text logits;
- ``--task image-text --hf-checkpoint`` under EP=2 on the shapes questions, LoRA on K3's text
  modules, the tower's attention and the projector: the held-out loss before training is the
  plain references' (tests/helpers/kimi_k3_reference.py fed tests/helpers/moonvit3d_reference.py's
  features at the ``<|media_pad|>`` positions), four steps lower it, and the run's PEFT export
  (the release's names, the tower's and projector's LoRA included) loaded by PEFT onto the plain
  references gives the run's held-out loss after training and, decoding greedily in fp64 with the
  tower's features at the placeholders, the run's held-out answers after training (our
  generator, KV cache and the images in it) token for token.
"""

import copy
import json

import pytest
import torch
from torch import nn

from tests.distributed.test_finetune_hf import MEDIA_TOKENS, MICRO_BATCH, VOCAB, \
    _chatml_tokenizer_with
from tests.distributed.test_kimi_k3_finetune import TARGETS, _run
from tests.helpers import hf_models
from tests.helpers import k3_processor_reference as processor_ref
from tests.helpers import kimi_k3_reference as k3ref
from tests.helpers import moonvit3d_reference as vision_ref
from tests.helpers.ranks import run_ranks

SEQ = 128  # a shapes question in this tokenizer and its image's 4 merged patches
GLOBAL_BATCH, STEPS = 4, 4
ANSWERS = 2  # held-out questions answered, one per data-parallel rank at EP=2


@pytest.fixture(scope="module")
def k3_vl(tmp_path_factory):
    hf_dir = tmp_path_factory.mktemp("k3-vl") / "kimi-k3"
    hf_dir.mkdir()
    pad = _chatml_tokenizer_with(hf_dir, MEDIA_TOKENS).token_to_id("<|media_pad|>")
    text = k3ref.round_experts_to_mxfp4_(k3ref.build(k3ref.tiny_config(
        vocab_size=VOCAB, num_hidden_layers=6, attn_res_block_size=2,
        full_attn_layers=[3, 6], kda_layers=[1, 2, 4, 5])))
    vision, config = hf_models.k3_tower(text)
    hf_models.save_kimi_k3(text, hf_dir, vision=vision,
                           vision_config=hf_models.K3_VISION_CONFIG, image_token_id=pad)
    (hf_dir / "preprocessor_config.json").write_text(
        json.dumps({"media_proc_cfg": dict(processor_ref.RELEASE)}))
    state = {k: v.detach().clone() for k, v in vision.state_dict().items()}
    return hf_dir, text, state, config, pad


def _held_out_batches(hf_dir, dataset_dir) -> list[dict]:
    """The run's held-out micro-batches (one global batch of the val split, in order), made as
    the task makes them from the checkpoint's processor settings."""
    from megatron_slmoe.data.image_text import ImageTextDataset, collate_image_text
    from megatron_slmoe.data.sampler import micro_batches
    from megatron_slmoe.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(hf_dir))
    images = hf_models.kimi_image_input(str(hf_dir), tokenizer)
    valid = ImageTextDataset(str(dataset_dir), tokenizer, SEQ, images=images, split="val",
                             shuffle=False)
    return [collate_image_text([valid[i] for i in part])
            for part in micro_batches(range(GLOBAL_BATCH), MICRO_BATCH)]


def _reference_logits(text, vision_state, config, pad, batch) -> torch.Tensor:
    """The plain K3 text model (fp64) fed the plain tower's and projector's features at the
    placeholder positions (fp64)."""
    state = {k: v.double() for k, v in vision_state.items()}
    with torch.no_grad():
        features = vision_ref.projector(state, config, vision_ref.tower(
            state, config, batch["pixel_values"].double(), batch["image_grid_thw"]))
        tokens = batch["tokens"]
        image = tokens == pad
        embeds = text.language_model.model.embed_tokens(tokens.masked_fill(image, 0))
        embeds[image] = features
        return text(inputs_embeds=embeds).double()


def _reference_loss(text, vision_state, config, pad, batches) -> float:
    """The run's held-out loss: mean over micro-batches of the masked token mean."""
    per_micro_batch = []
    for batch in batches:
        logits = _reference_logits(text, vision_state, config, pad, batch)
        token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"],
                                                       reduction="none")
        mask = batch["loss_mask"].double()
        per_micro_batch.append(float((token_loss * mask).sum() / mask.sum()))
    return sum(per_micro_batch) / len(per_micro_batch)


def _reference_answer(text, vision_state, config, pad, prompt, ours: list[int], limit: int,
                      eos: int, vocab: int) -> list[int]:
    """The plain references' greedy answer (fp64) to one of the run's prompts (a
    ``GenerationPrompt``: the tower's and projector's features at its placeholders, generated
    tokens embedded as text) under the run's limit and eos (cut), never an id of the model's
    vocabulary padding (at or above ``vocab``), as far as it goes with ``ours``. One forward
    over the prompt and our answer, not one per token: the model is causal, so each position's
    greedy token given our tokens before it is the greedy loop's as long as the two agree, and
    the answer is taken up to the first token where they part."""
    state = {k: v.double() for k, v in vision_state.items()}
    ids = torch.tensor([prompt.tokens + ours])
    media = torch.nonzero(ids[0] == pad).flatten()
    media = media[media < len(prompt.tokens)]
    with torch.no_grad():
        features = vision_ref.projector(state, config, vision_ref.tower(
            state, config, prompt.images.double(), prompt.image_grid_thw))
        assert len(media) == len(features)
        embeds = text.language_model.model.embed_tokens(ids.index_fill(1, media, 0))
        embeds[0, media] = features
        predicted = text(inputs_embeds=embeds)[0, len(prompt.tokens) - 1:, :vocab].argmax(-1)
    answer = []
    for i, token in enumerate(predicted[:limit].tolist()):
        if token == eos:
            break
        answer.append(token)
        if i >= len(ours) or token != ours[i]:
            break
    return answer


def _modules_of(state: dict) -> nn.Module:
    """The tower's and projector's tensors as plain modules under their release names (every
    2-D ``*.weight`` an ``nn.Linear``, the rest plain parameters), for PEFT to adapt."""
    root = nn.Module()
    for name, tensor in state.items():
        *path, leaf = name.split(".")
        module = root
        for part in path[:-1]:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        if leaf == "weight" and tensor.dim() == 2 and not hasattr(module, path[-1]):
            module.add_module(path[-1], nn.Linear(tensor.shape[1], tensor.shape[0], bias=False))
        elif not hasattr(module, path[-1]):
            module.add_module(path[-1], nn.Module())
        owner = getattr(module, path[-1])
        if isinstance(owner, nn.Linear) and leaf == "weight":
            owner.weight.data.copy_(tensor)
        else:
            owner.register_parameter(leaf, nn.Parameter(tensor.clone()))
    return root


def _logits(hf_dir: str, batches: list[dict]) -> list:
    """This rank's logits of each batch (None off the last stage), one model loaded once."""
    model, _ = hf_models.load_kimi(hf_dir)
    return [hf_models.megatron_logits(model, b["input_ids"], pixel_values=b["pixel_values"],
                                      image_grid_thw=b["image_grid_thw"]) for b in batches]


def _media_batch(pad: int, rows: list, gen: torch.Generator) -> dict:
    """A batch of text and media: per row, its text lengths (before the first item and after
    each) and its items' patch grids ``(t, h, w)``; random text ids, one placeholder per 2 x 2
    merge of one frame (a video chunk's frames are pooled into one) and random pixels."""
    ids, grids = [], []
    for text_lengths, items in rows:
        row = [torch.randint(0, pad, (text_lengths[0],), generator=gen)]
        for (t, h, w), after in zip(items, text_lengths[1:]):
            row += [torch.full((h * w // 4,), pad), torch.randint(0, pad, (after,), generator=gen)]
            grids.append([t, h, w])
        ids.append(torch.cat(row))
    grids = torch.tensor(grids)
    return {"input_ids": torch.stack(ids), "image_grid_thw": grids,
            "pixel_values": torch.randn(int(grids.prod(-1).sum()), 3, 14, 14, generator=gen)}


def test_k3_image_and_video_text_logits_at_pp2_and_ep2_are_one_ranks(k3_vl):
    hf_dir, _, _, _, pad = k3_vl
    gen = torch.Generator().manual_seed(3)
    images = _media_batch(pad, [((2, 4), [(1, 4, 6)]), ((2, 4), [(1, 6, 4)])], gen)
    # Two clips as K3's processor cuts them: 9 frames of 2 x 4 patches in 4-frame chunks (the
    # last keeps the rest), and 4 frames of 4 x 6; the chunks' texts (timestamps) as plain ids.
    videos = _media_batch(pad, [((3, 2, 2, 3), [(4, 2, 4), (4, 2, 4), (1, 2, 4)]),
                                ((7, 3), [(4, 4, 6)])], gen)
    (expected,) = run_ranks(_logits, 1, hf_dir=str(hf_dir), batches=[images, videos])
    results = run_ranks(_logits, 2, pp=2, hf_dir=str(hf_dir), batches=[images, videos])
    assert results[0] == [None, None]
    for ours, theirs in zip(results[1], expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    # EP=2 (images there: the LoRA run below), on both replicas. Each expert's matmuls take
    # both replicas' tokens there, rounding otherwise: 1.5e-6 apart at most, held to 1e-5.
    for ours in run_ranks(_logits, 2, ep=2, hf_dir=str(hf_dir), batches=[videos]):
        torch.testing.assert_close(ours[0], expected[1], rtol=1e-5, atol=1e-5)


def test_k3_image_text_lora_and_its_peft_adapter_on_the_references(k3_vl, tmp_path):
    from peft import PeftModel

    from megatron_slmoe.data.shapes import ensure_shapes_task
    from megatron_slmoe.data.tokenizer import load_tokenizer

    hf_dir, text, vision_state, config, pad = k3_vl
    output, peft_dir = tmp_path / "run", tmp_path / "peft"
    args = ["--hf-checkpoint", str(hf_dir), "--task", "image-text", "--seq-length", str(SEQ),
            "--global-batch-size", str(GLOBAL_BATCH), "--micro-batch-size", str(MICRO_BATCH),
            "--train-iters", str(STEPS), "--lr", "1e-2", "--lr-warmup-iters", "0",
            "--eval-iters", "1", "--eval-interval", "1000", "--eval-answers", str(ANSWERS),
            "--lora-rank", "4", "--fp32", "--no-tensorboard", "--no-plots",
            "--expert-model-parallel-size", "2",
            "--lora-target-modules", *TARGETS, "vision_attention", "projector",
            "--export-hf", str(peft_dir), "--output-dir", str(output)]
    # The held-out batches come from the dataset the run makes in its folder: made here first
    # (deterministic), so the references need nothing from the run.
    ensure_shapes_task(str(output / "data" / "shapes"))
    batches = _held_out_batches(hf_dir, output / "data" / "shapes" / "vqa")
    assert all((b["tokens"] == pad).any() for b in batches)
    results = run_ranks(_run, 2, ep=2, args=args, timeout=600.0)
    answers = [row for r in results for row in r.pop("answers")]  # each DP rank's share
    assert results[0] == results[1]  # every rank reports the reduced losses
    run = results[0]
    assert sorted(run["losses"]) == list(range(1, STEPS + 1))
    assert run["before"] == pytest.approx(
        _reference_loss(copy.deepcopy(text).double(), vision_state, config, pad, batches), rel=1e-5)
    assert run["after"] < run["before"]

    model = nn.Module()  # the release's top level: language_model., vision_tower., mm_projector.
    reference = copy.deepcopy(text).double()
    model.language_model = reference.language_model
    model.prepare_inputs_for_generation = None  # PEFT's causal-LM wrapper keeps the hook
    for name, module in _modules_of({k: v.double() for k, v in vision_state.items()}
                                    ).named_children():
        model.add_module(name, module)
    peft_model = PeftModel.from_pretrained(model, str(peft_dir)).eval().double()
    adapted = [n for n, p in peft_model.named_parameters() if "lora_B" in n
               and n.split(".")[2] in ("vision_tower", "mm_projector") and p.abs().max() > 0]
    assert any("vision_tower" in n for n in adapted) and any("mm_projector" in n for n in adapted)
    merged = peft_model.merge_and_unload()
    state = {k: v for k, v in merged.state_dict().items() if not k.startswith("language_model.")}
    assert state.keys() == vision_state.keys()
    assert run["after"] == pytest.approx(
        _reference_loss(reference, state, config, pad, batches), rel=1e-5)
    # The held-out answers after training, each prompt with its image, are the adapted
    # references' greedy answers.
    tokenizer = load_tokenizer(str(hf_dir))
    assert len(answers) == ANSWERS and any(tokens for _, _, tokens in answers)
    for prompt, limit, ours in answers:
        assert (prompt.tokens.count(pad) > 0 and ours == _reference_answer(
            reference, state, config, pad, prompt, ours, limit, tokenizer.eos_id,
            tokenizer.vocab_size)), prompt.tokens
    # The tower's and projector's adapters matter to it (the same without them is far off).
    unadapted = {k: v.double() for k, v in vision_state.items()}
    assert abs(_reference_loss(reference, unadapted, config, pad, batches)
               - run["after"]) > 1e-4 * run["after"]
