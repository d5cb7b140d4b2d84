"""The multimodal model trains with LoRA the same on one rank and in parallel layouts.

Megatron's LLaVAModel with a CLIP ViT, its MLP projector and a Stable Latent MoE language model (a
dense and an MoE layer: latent projections, shared expert, 4 routed experts), LoRA on the language
model's attention and experts, the vision attention and the projector. One rank saves the base
weights (a Megatron dist checkpoint); 2-rank runs with TP=2 (sequence parallel), EP=2 (with DP=2),
PP=2 (vision tower on the first stage) with full recomputation load them, inject the same
adapter (its initialisation does not depend on the layout) and train 4 steps through Megatron's
schedule, DDP, finalize_model_grads and Adam. Micro-batches hold 0, 1 or 2 images per sample at
varying places. Compared with the single rank: every step's loss, every LoRA gradient (gathered
unsharded by global name) at the first and the last step, and the adapter after the last step.
(4 steps keep the file within CI's time; with STEPS = 10 it passes at the same tolerances.)

Then the trained model answers image+text prompts greedily through the package's one generation
path (``inference.TextGenerator``: Megatron-Core's KV cache, images entering the cache with the
prompt), in every layout: the tokens equal the reference's (Megatron's forward-only schedule
recomputing the whole sequence at every step, tests/helpers/multimodal_generation.py) and the
single rank's.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tests.helpers import gpt_case
from tests.helpers.ranks import run_ranks

STEPS = 4
SEQ = 32
VOCAB = 64
GLOBAL_BATCH = 8
MICRO_BATCH = 2
# Measured on CPU (fp32): losses agree to 6e-8, gradients to 2e-6, adapters to 6e-6 (relative).
LOSS_TOL = 1e-6
GRAD_TOL = 1e-5
PARAM_TOL = 5e-5
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "vision_attention",
           "projector"]


# --- rank functions ------------------------------------------------------------------------------


def _vision():
    from megatron_slmoe.model.config import VisionConfig

    return VisionConfig(img_h=16, img_w=16, patch_dim=8, num_layers=1, hidden_size=32,
                        num_attention_heads=4, ffn_hidden_size=64, projector_ffn_hidden_size=64)


def _model(recompute: bool = False):
    from megatron.core import parallel_state as ps

    from megatron_slmoe.model.model_file import ModelConfig
    from megatron_slmoe.model.multimodal import build_multimodal_model
    from tests.helpers.lora_models import parallel_moe_config

    extra = dict(recompute_granularity="full", recompute_method="uniform",
                 recompute_num_layers=1) if recompute else {}
    config = parallel_moe_config(**extra)
    model_config = ModelConfig(name="multimodal-parity", source="test", transformer={},
                               vocab_size=VOCAB, max_sequence_length=SEQ)
    model = build_multimodal_model(model_config, config, _vision(),
                                   pre_process=ps.is_pipeline_first_stage(),
                                   post_process=ps.is_pipeline_last_stage())
    return model, config


def _global_batch(step: int) -> list[dict]:
    """GLOBAL_BATCH samples: text with 0, 1 or 2 image placeholders, loss on the answer part."""
    vision = _vision()
    width = vision.num_image_embeddings
    gen = torch.Generator().manual_seed(1000 + step)
    samples = []
    for i in range(GLOBAL_BATCH):
        images = (i + step) % 3
        length = int(torch.randint(10, SEQ - images * (width - 1) + 1, (1,), generator=gen))
        row = torch.randint(6, VOCAB, (length + 1,), generator=gen)
        places = torch.randperm(length // 2, generator=gen)[:images] + 1
        row[places] = vision.image_token_index
        targets = torch.zeros(length + 1)
        targets[length // 2 + 1:] = 1.0
        tokens = torch.zeros(SEQ, dtype=torch.int64)
        labels = torch.zeros(SEQ, dtype=torch.int64)
        loss_mask = torch.zeros(SEQ)
        tokens[:length], labels[:length], loss_mask[:length] = row[:-1], row[1:], targets[1:]
        samples.append({
            "tokens": tokens, "labels": labels, "loss_mask": loss_mask,
            "images": torch.randn(images, 3, vision.img_h, vision.img_w, generator=gen),
            "num_image_tiles": torch.ones(images, dtype=torch.int32)})
    return samples


def _microbatches(step: int) -> list[dict]:
    from megatron.core import parallel_state as ps

    from megatron_slmoe.data.image_text import collate_image_text
    from megatron_slmoe.data.sampler import micro_batches

    samples = _global_batch(step)
    parts = micro_batches(range(GLOBAL_BATCH), MICRO_BATCH, ps.get_data_parallel_rank(),
                          ps.get_data_parallel_world_size())
    return [collate_image_text([samples[i] for i in part]) for part in parts]


def _train_step(ddp, optimizer, step: int, want_grads: bool):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_slmoe.training.tasks.image_text import forward_step

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    microbatches = _microbatches(step)
    losses = get_forward_backward_func()(
        forward_step_func=partial(forward_step, torch.device("cpu")),
        data_iterator=iter(microbatches), model=ddp, num_microbatches=len(microbatches),
        seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False)
    loss = torch.zeros(1, dtype=torch.float64)
    if ps.is_pipeline_last_stage():
        loss += torch.stack([entry["loss"].double() for entry in losses]).mean()
    torch.distributed.all_reduce(loss, group=ps.get_pipeline_model_parallel_group())
    torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
    grads = _gathered_grads(ddp.module) if want_grads else None
    optimizer.step()
    return loss.item() / ps.get_data_parallel_world_size(), grads


def _gathered_grads(model) -> dict:
    """Every LoRA gradient, unsharded by global name (on rank 0); the parameters are unchanged."""
    from megatron_slmoe.lora.adapter import lora_state_dict
    from megatron_slmoe.lora.inject import lora_modules

    params = [p for m in lora_modules(model) for p in m.lora_parameters()]
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for param in params:
            param.copy_(param.main_grad)
    grads = lora_state_dict(model, dst=0)
    with torch.no_grad():
        for param, value in zip(params, saved):
            param.copy_(value)
    return grads


def train_rank(base_dir: str, save_base: bool, recompute: bool = False) -> dict:
    from megatron_slmoe.lora.adapter import lora_state_dict
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.inject import inject_lora

    model, config = _model(recompute)
    if save_base:
        gpt_case.save(model, base_dir)
    else:
        gpt_case.load(model, base_dir)
    adapted = inject_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=TARGETS))
    ddp = gpt_case.wrap_ddp(config, model)
    optimizer = gpt_case.build_optimizer(ddp, distributed_optimizer=False)
    losses, grads = [], {}
    for step in range(STEPS):
        loss, step_grads = _train_step(ddp, optimizer, step, want_grads=step in (0, STEPS - 1))
        losses.append(loss)
        if step_grads is not None:
            grads[step] = step_grads
    return {"losses": losses, "grads": grads, "adapter": lora_state_dict(model, dst=0),
            "adapted": adapted, "answers": _answers(ddp)}


ANSWER_TOKENS, EOS = 5, 1


def _generation_prompts() -> list:
    """Prompts of different lengths with one image each, at different places."""
    from megatron_slmoe.data.image_text import GenerationPrompt

    vision = _vision()
    gen = torch.Generator().manual_seed(7)
    prompts = []
    for i in range(5):
        tokens = torch.randint(6, VOCAB, (6 + 2 * i,), generator=gen).tolist()
        tokens[1 + i % 3] = vision.image_token_index
        prompts.append(GenerationPrompt(tokens, torch.randn(1, 3, vision.img_h, vision.img_w,
                                                            generator=gen),
                                        torch.ones(1, dtype=torch.int32)))
    return prompts


def _answers(ddp) -> dict:
    from megatron_slmoe.inference import TextGenerator
    from tests.helpers.multimodal_generation import greedy_generate

    prompts, vision = _generation_prompts(), _vision()
    cached = TextGenerator(ddp, EOS, VOCAB, max_batch_size=3).generate(prompts, ANSWER_TOKENS)
    recomputed = TextGenerator(ddp, EOS, VOCAB, max_batch_size=3,
                               use_kv_cache=False).generate(prompts, ANSWER_TOKENS)
    ddp.eval()
    with torch.no_grad():
        reference = greedy_generate(
            ddp, prompts, max_new_tokens=ANSWER_TOKENS, seq_length=SEQ,
            micro_batch_size=MICRO_BATCH, pad_id=0, eos_id=EOS,
            image_token_index=vision.image_token_index,
            tokens_per_tile=vision.num_image_embeddings, device=torch.device("cpu"))
    ddp.train()
    return {"cached": cached, "recomputed": recomputed, "reference": reference}


# --- tests ---------------------------------------------------------------------------------------


LAYOUTS = {
    "tp2-sequence-parallel": {"tp": 2, "etp": 1},
    "ep2-dp2": {"ep": 2},
    "pp2-recompute-full": {"pp": 2, "recompute": True},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base_dir = tmp_path_factory.mktemp("multimodal-parallel") / "base"
    base_dir.mkdir()
    (reference,) = run_ranks(train_rank, 1, base_dir=str(base_dir), save_base=True)
    parallel = {}
    for name, layout in LAYOUTS.items():
        layout = dict(layout)
        recompute = layout.pop("recompute", False)
        parallel[name] = run_ranks(train_rank, 2, **layout, base_dir=str(base_dir),
                                   save_base=False, recompute=recompute)
    return reference, parallel


def _relative_errors(actual: dict, expected: dict) -> dict:
    assert sorted(actual) == sorted(expected)
    errors = {}
    for name, ref in expected.items():
        scale = ref.norm().item()
        diff = (actual[name] - ref).norm().item()
        errors[name] = diff / scale if scale > 0 else diff
    return errors


def test_reference_adapts_every_part_and_learns(runs):
    reference, _ = runs
    adapted = reference["adapted"]
    assert any(n.startswith("vision_model.") and n.endswith("linear_qkv") for n in adapted)
    assert any(n.startswith("vision_projection.") for n in adapted)
    assert any(n.startswith("language_model.") and n.endswith(".experts") for n in adapted)
    assert not any(n.startswith("vision_model.") and ".mlp." in n for n in adapted)
    losses = reference["losses"]
    assert losses[-1] < losses[0], losses
    last = reference["grads"][STEPS - 1]  # at step 0 B = 0, so A has no gradient yet
    zero = [n for n, g in last.items() if g.abs().sum() == 0]
    assert not zero, f"LoRA tensors without gradient at the last step: {zero[:5]}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_gradients_and_adapter_match_single_rank(runs, layout):
    reference, parallel = runs
    for rank_result in parallel[layout]:
        assert rank_result["losses"] == pytest.approx(reference["losses"], rel=LOSS_TOL)
    rank0 = parallel[layout][0]
    for step, expected in reference["grads"].items():
        errors = _relative_errors(rank0["grads"][step], expected)
        bad = {n: e for n, e in errors.items() if e > GRAD_TOL}
        assert not bad, f"{layout} step {step}: LoRA gradients differ from one rank: {bad}"
    errors = _relative_errors(rank0["adapter"], reference["adapter"])
    bad = {n: e for n, e in errors.items() if e > PARAM_TOL}
    assert not bad, f"{layout}: adapter after {STEPS} steps differs from one rank: {bad}"


def test_generation_with_images_matches_the_recomputing_reference_in_every_layout(runs):
    reference, parallel = runs
    single = reference["answers"]
    assert single["cached"] == single["reference"] == single["recomputed"]
    assert any(len(tokens) > 1 for tokens in single["cached"])  # not all stopped at once
    for layout, ranks in parallel.items():
        for rank_result in ranks:
            answers = rank_result["answers"]
            assert answers["cached"] == answers["reference"] == single["cached"], layout
