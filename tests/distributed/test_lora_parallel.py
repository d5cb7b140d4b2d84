"""LoRA in parallel layouts equals LoRA on one rank, and adapters do not depend on the layout.

A small Stable Latent MoE GPT (a dense layer and an MoE layer with latent projections, a shared
expert and 4 routed experts) gets adapters on every target. One rank saves the base weights (a
Megatron dist checkpoint) and a random adapter; TP=2 (sequence parallel, expert TP 1), EP=2
(with DP=2) and PP=2 runs, the experts at a rank of their own (--moe-rank-scaling), load both through ``load_adapter`` and run one forward/backward through
Megatron's schedule, DDP and finalize_model_grads. Compared with the single rank: the loss, every
LoRA gradient (gathered unsharded with ``lora_state_dict``), the adapter they save again (bitwise),
and their whole-model dist checkpoints (LoRA tensors bitwise after loading into one rank).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import gpt_case
from tests.helpers.ranks import run_ranks

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "shared_experts", "router",
           "latent"]
BASE_INFO = {"model_config": "lora-parallel-test"}


# --- rank functions ------------------------------------------------------------------------------


def _lora_config():
    from megatron_slmoe.lora.config import LoRAConfig

    # The routed experts at a rank of their own, 4 // top-2 = 2 (scale 8 / 2; issue 42).
    return LoRAConfig(rank=4, alpha=8.0, targets=TARGETS, moe_rank_scaling=True)


def _config():
    from tests.helpers.lora_models import parallel_moe_config

    return parallel_moe_config()


def _model(config):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from megatron_slmoe.moe.specs import get_slmoe_decoder_block_spec

    return GPTModel(config=config, transformer_layer_spec=get_slmoe_decoder_block_spec(config),
                    vocab_size=gpt_case.VOCAB, max_sequence_length=gpt_case.SEQ,
                    pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage(), position_embedding_type="rope")


def _randomize(model) -> None:
    """Random LoRA A and B (B non-zero), drawn per global tensor so any layout gets the same."""
    from megatron_slmoe.lora.inject import lora_modules

    with torch.no_grad():
        for module in lora_modules(model):
            for piece in module.lora_pieces():
                seed = sum(map(ord, piece.name)) * 7919 + len(piece.name)
                gen = torch.Generator().manual_seed(seed)
                full = torch.randn(piece.global_shape, generator=gen) * 0.2
                piece.local.copy_(full[piece.index])


def _gathered_grads(model):
    """Every LoRA gradient, unsharded by global name (on rank 0): main_grad into the params."""
    from megatron_slmoe.lora.adapter import lora_state_dict
    from megatron_slmoe.lora.inject import lora_modules

    with torch.no_grad():
        for module in lora_modules(model):
            for param in module.lora_parameters():
                param.copy_(param.main_grad)
    return lora_state_dict(model, dst=0)


def reference_rank(base_dir: str, adapter_dir: str) -> dict:
    from megatron_slmoe.lora.adapter import save_adapter
    from megatron_slmoe.lora.inject import inject_lora

    config = _config()
    model = _model(config)
    gpt_case.save(model, base_dir)
    inject_lora(model, _lora_config())
    _randomize(model)
    save_adapter(model, adapter_dir, _lora_config(), BASE_INFO)
    ddp = gpt_case.wrap_ddp(config, model)
    loss = gpt_case.forward_backward(ddp)
    return {"loss": loss, "grads": _gathered_grads(model)}


def parallel_rank(base_dir: str, adapter_dir: str, resaved_dir: str, checkpoint_dir: str) -> dict:
    from megatron.core import dist_checkpointing

    from megatron_slmoe.lora.adapter import load_adapter, save_adapter

    config = _config()
    model = _model(config)
    gpt_case.load(model, base_dir)
    load_adapter(model, adapter_dir, base_info=BASE_INFO)  # injects the adapter's targets
    save_adapter(model, resaved_dir, _lora_config(), BASE_INFO)
    dist_checkpointing.save(model.sharded_state_dict(), checkpoint_dir)
    ddp = gpt_case.wrap_ddp(config, model)
    loss = gpt_case.forward_backward(ddp)
    return {"loss": loss, "grads": _gathered_grads(model)}


def single_rank_loads(base_dir: str, adapter_dirs: list[str], checkpoint_dirs: list[str]) -> dict:
    """One rank: each adapter via load_adapter, each whole-model checkpoint via Megatron's
    dist checkpointing; the LoRA tensors found, by source."""
    from megatron.core import dist_checkpointing

    from megatron_slmoe.lora.adapter import load_adapter, lora_state_dict
    from megatron_slmoe.lora.inject import inject_lora

    found = {}
    for directory in adapter_dirs:
        model = _model(_config())
        gpt_case.load(model, base_dir)
        load_adapter(model, directory)
        found[directory] = lora_state_dict(model)
    for directory in checkpoint_dirs:
        model = _model(_config())
        inject_lora(model, _lora_config())
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), directory))
        found[directory] = lora_state_dict(model)
    return found


# --- tests ---------------------------------------------------------------------------------------


# pp2: the dense layer and the MoE layer on different stages (router, latent, shared expert and
# expert targets match nothing on stage 0), global layer names in the adapter.
LAYOUTS = {"tp2-sequence-parallel": {"tp": 2, "etp": 1}, "ep2-dp2": {"ep": 2}, "pp2": {"pp": 2}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-parallel")
    base_dir, adapter_dir = root / "base", str(root / "adapter")
    base_dir.mkdir()
    (reference,) = run_ranks(reference_rank, 1, base_dir=str(base_dir), adapter_dir=adapter_dir)
    parallel = {}
    for name, layout in LAYOUTS.items():
        checkpoint_dir = root / f"{name}-checkpoint"
        checkpoint_dir.mkdir()
        results = run_ranks(parallel_rank, 2, **layout, base_dir=str(base_dir),
                            adapter_dir=adapter_dir, resaved_dir=str(root / f"{name}-adapter"),
                            checkpoint_dir=str(checkpoint_dir))
        parallel[name] = {"results": results, "adapter": str(root / f"{name}-adapter"),
                          "checkpoint": str(checkpoint_dir)}
    (loaded,) = run_ranks(single_rank_loads, 1, base_dir=str(base_dir),
                          adapter_dirs=[p["adapter"] for p in parallel.values()],
                          checkpoint_dirs=[p["checkpoint"] for p in parallel.values()])
    return {"reference": reference, "adapter": adapter_dir, "parallel": parallel,
            "loaded": loaded}


def _read(directory):
    from safetensors.torch import load_file

    return load_file(f"{directory}/adapter_model.safetensors")


def _assert_bitwise(actual: dict, expected: dict, what: str) -> None:
    assert sorted(actual) == sorted(expected), f"{what}: different tensor names"
    differ = [n for n in expected if actual[n].dtype != expected[n].dtype
              or not torch.equal(actual[n], expected[n])]
    assert not differ, f"{what}: tensors differ: {differ[:5]}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_loss_and_lora_grads_match_single_rank(runs, layout):
    reference = runs["reference"]
    results = runs["parallel"][layout]["results"]
    losses = [r["loss"] for r in results if r["loss"] is not None]  # last pipeline stage
    assert losses
    for loss in losses:
        assert loss == pytest.approx(reference["loss"], rel=LOSS_TOL)
    grads = results[0]["grads"]
    expected = reference["grads"]
    assert sorted(grads) == sorted(expected)
    assert any(name.endswith("lora_A.weight") and ".experts." in name for name in expected)
    errors = {}
    for name, ref in expected.items():
        scale = ref.norm().item()
        diff = (grads[name] - ref).norm().item()
        errors[name] = diff / scale if scale > 0 else diff
    bad = {n: e for n, e in errors.items() if e > GRAD_TOL}
    assert not bad, f"{layout}: LoRA gradients differ from one rank: {bad}"
    nonzero = [n for n, g in expected.items() if g.abs().sum() > 0]
    assert len(nonzero) > len(expected) // 2, "the reference gradients are mostly zero"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_adapter_saved_in_parallel_layout_is_bitwise_the_single_rank_one(runs, layout):
    original = _read(runs["adapter"])
    assert original["decoder.layers.1.mlp.experts.3.linear_fc1.lora_A.weight"].shape[0] == 2
    resaved_dir = runs["parallel"][layout]["adapter"]
    _assert_bitwise(_read(resaved_dir), original, f"{layout} adapter file")
    _assert_bitwise(runs["loaded"][resaved_dir], original, f"{layout} adapter loaded on 1 rank")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_whole_model_dist_checkpoint_moves_lora_between_layouts(runs, layout):
    original = _read(runs["adapter"])
    checkpoint = runs["parallel"][layout]["checkpoint"]
    _assert_bitwise(runs["loaded"][checkpoint], original, f"{layout} dist checkpoint")
