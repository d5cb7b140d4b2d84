"""Shared-outer expert LoRA under expert parallelism equals one rank, and resumes identically
(issue 42).

The small Stable Latent MoE GPT of the LoRA parity tests (4 routed experts, top-2) with LoRA on
every target, the experts in the shared-outer layout (``--expert-lora-layout shared-outer``: the
gate/up A and the down B shared by the layer's experts, replicated on every EP rank). One rank
saves the base weights and a random adapter; an EP=2 run (DP=2, each rank half the batch and
half the experts) loads both. Each run takes two steps through Megatron's schedule, DDP,
finalize_model_grads and its Adam optimizer (grad clipping on), saving a training checkpoint
(``training.checkpointing``) after the first. Compared with the single rank: the loss, every LoRA
gradient of the first step (the shared factors' are sums over both EP ranks' rows), the grad norm
the clipping used (shared factors counted once) and the adapter after the second step. A third
run resumes the EP=2 checkpoint at EP=2 and gives the uninterrupted run's adapter bitwise; a
fourth resumes it on one rank (the checkpoint moved between layouts) and gives the single rank's.
A PP=2 run (the MoE layer on the second stage) gives one rank's loss, gradients and adapter.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import gpt_case
from tests.helpers.ranks import run_ranks

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "shared_experts", "router",
           "latent"]
SHARED = ("decoder.layers.1.mlp.experts.linear_fc1.lora_A.weight",
          "decoder.layers.1.mlp.experts.linear_fc2.lora_B.weight")


def _lora_config():
    from megatron_slmoe.lora.config import LoRAConfig

    return LoRAConfig(rank=4, alpha=8.0, targets=TARGETS, expert_layout="shared-outer")


def _model():
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from megatron_slmoe.moe.specs import get_slmoe_decoder_block_spec
    from tests.helpers.lora_models import parallel_moe_config

    # The router's expert bias is a buffer no training checkpoint holds (a LoRA run freezes the
    # router): its update would make a resumed step route differently.
    config = parallel_moe_config(moe_router_bias_update_rate=0.0)
    model = GPTModel(config=config, transformer_layer_spec=get_slmoe_decoder_block_spec(config),
                     vocab_size=gpt_case.VOCAB, max_sequence_length=gpt_case.SEQ,
                     pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), position_embedding_type="rope")
    return config, model


def _randomize(model) -> None:
    """Random A and B, drawn per global tensor so any layout gets the same."""
    from megatron_slmoe.lora.inject import lora_modules

    with torch.no_grad():
        for module in lora_modules(model):
            for piece in module.lora_pieces():
                gen = torch.Generator().manual_seed(sum(map(ord, piece.name)) * 7919)
                full = torch.randn(piece.global_shape, generator=gen) * 0.2
                piece.local.copy_(full[piece.index])


def _gathered_grads(model) -> dict:
    """Every LoRA gradient (main_grad), unsharded by global name; the weights are kept."""
    from megatron_slmoe.lora.adapter import lora_state_dict
    from megatron_slmoe.lora.inject import lora_modules

    params = [p for m in lora_modules(model) for p in m.lora_parameters()]
    kept = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.copy_(p.main_grad)
        grads = lora_state_dict(model, dst=None)
        for p, k in zip(params, kept):
            p.copy_(k)
    return grads


def _step(ddp, optimizer) -> tuple[float, float]:
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = gpt_case.forward_backward(ddp)
    _, grad_norm, _ = optimizer.step()
    return loss, grad_norm


def _trainer(base_dir: str, adapter_dir: str):
    from megatron_slmoe.lora.adapter import load_adapter

    config, model = _model()
    gpt_case.load(model, base_dir)
    load_adapter(model, adapter_dir)  # injects the adapter's layout
    ddp = gpt_case.wrap_ddp(config, model)
    return model, ddp, gpt_case.build_optimizer(ddp, False)


def reference_rank(base_dir: str, adapter_dir: str) -> None:
    from megatron_slmoe.lora.adapter import save_adapter
    from megatron_slmoe.lora.inject import inject_lora

    _, model = _model()
    gpt_case.save(model, base_dir)
    inject_lora(model, _lora_config())
    _randomize(model)
    save_adapter(model, adapter_dir, _lora_config())


def training_rank(base_dir: str, adapter_dir: str, checkpoint_root: str | None) -> dict:
    """Two steps, a training checkpoint after the first (where a root is given)."""
    from megatron_slmoe.lora.adapter import lora_state_dict
    from megatron_slmoe.training.checkpointing import save_checkpoint

    model, ddp, optimizer = _trainer(base_dir, adapter_dir)
    loss, grad_norm = _step(ddp, optimizer)
    grads = _gathered_grads(ddp.module)
    from megatron_slmoe.lora.inject import lora_modules

    local = {}  # this rank's gradient of the shared factors (on the MoE layer's stage)
    for experts in (m for m in lora_modules(model) if m.lora_name.endswith(".experts")):
        local = {SHARED[0]: experts.fc1_lora_A.main_grad.clone(),
                 SHARED[1]: experts.fc2_lora_B.main_grad.clone()}
    if checkpoint_root is not None:
        save_checkpoint(checkpoint_root, 1, [model], optimizer, {}, keep_last=1)
    _step(ddp, optimizer)
    return {"loss": loss, "grad_norm": grad_norm, "grads": grads, "local": local,
            "after": lora_state_dict(model, dst=None)}


def resumed_rank(base_dir: str, adapter_dir: str, checkpoint: str) -> dict:
    from megatron_slmoe.lora.adapter import lora_state_dict
    from megatron_slmoe.training.checkpointing import load_checkpoint

    model, ddp, optimizer = _trainer(base_dir, adapter_dir)
    load_checkpoint(checkpoint, [model], optimizer)
    _step(ddp, optimizer)
    return {"after": lora_state_dict(model, dst=None)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared-outer")
    base_dir, adapter_dir = root / "base", str(root / "adapter")
    base_dir.mkdir()
    paths = dict(base_dir=str(base_dir), adapter_dir=adapter_dir)
    run_ranks(reference_rank, 1, **paths)
    (single,) = run_ranks(training_rank, 1, **paths, checkpoint_root=str(root / "single"))
    ep2 = run_ranks(training_rank, 2, ep=2, **paths, checkpoint_root=str(root / "ep2"))
    pp2 = run_ranks(training_rank, 2, pp=2, **paths, checkpoint_root=None)
    checkpoint = str(root / "ep2" / "iter_0000001")
    resumed_ep2 = run_ranks(resumed_rank, 2, ep=2, **paths, checkpoint=checkpoint)
    (resumed_one,) = run_ranks(resumed_rank, 1, **paths, checkpoint=checkpoint)
    return {"single": single, "ep2": ep2, "pp2": pp2, "resumed_ep2": resumed_ep2,
            "resumed_one": resumed_one}


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.norm().item()
    return (actual - expected).norm().item() / (scale if scale > 0 else 1.0)


def test_ep2_loss_gradients_and_grad_norm_equal_one_rank(runs):
    single, ep2 = runs["single"], runs["ep2"]
    for rank in ep2:
        assert rank["loss"] == pytest.approx(single["loss"], rel=1e-5)
        # Clipping's norm counts the shared factors once though both EP ranks hold them.
        assert rank["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)
    grads, expected = ep2[0]["grads"], single["grads"]
    assert sorted(grads) == sorted(expected)
    for name in SHARED:
        assert expected[name].abs().sum() > 0
        # Every EP rank holds the whole layer's gradient of a shared factor, the same on both.
        assert torch.equal(ep2[0]["local"][name], ep2[1]["local"][name])
        assert _relative(ep2[1]["local"][name], single["local"][name]) < 1e-5
    errors = {n: _relative(grads[n], expected[n]) for n in expected}
    bad = {n: e for n, e in errors.items() if e > 1e-4}
    assert not bad, f"EP=2 LoRA gradients differ from one rank: {bad}"


def test_pp2_trains_as_one_rank(runs):
    """The dense layer and the MoE layer (its shared factors) on two pipeline stages."""
    single, pp2 = runs["single"], runs["pp2"]
    (loss,) = [r["loss"] for r in pp2 if r["loss"] is not None]  # the last stage
    assert loss == pytest.approx(single["loss"], rel=1e-5)
    for rank in pp2:
        assert rank["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)
    assert not pp2[0]["local"] and set(pp2[1]["local"]) == set(SHARED)
    for name in SHARED:
        assert _relative(pp2[1]["local"][name], single["local"][name]) < 1e-5
    for what in ("grads", "after"):
        errors = {n: _relative(pp2[0][what][n], single[what][n]) for n in single[what]}
        assert max(errors.values()) < 1e-4, (what, errors)


def test_ep2_training_and_its_resumes_equal(runs):
    single, ep2 = runs["single"]["after"], runs["ep2"][0]["after"]
    moved = {n: _relative(ep2[n], single[n]) for n in single}
    assert max(moved.values()) < 1e-4, moved
    for rank, resumed in zip(runs["ep2"], runs["resumed_ep2"]):
        for name, tensor in rank["after"].items():
            assert torch.equal(resumed["after"][name], tensor), f"EP=2 resume differs: {name}"
    one = runs["resumed_one"]["after"]
    errors = {n: _relative(one[n], single[n]) for n in single}
    assert max(errors.values()) < 1e-4, errors
