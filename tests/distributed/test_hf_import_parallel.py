"""Rank-local HF import under TP=2 (sequence parallel), EP=2 and PP=2: for every family, the
imported Megatron model's logits equal transformers' on the same tiny random checkpoint (Kimi-K2.5
and Qwen3-VL-MoE on image+text batches), and each
rank read only its own slices (EP ranks read half the experts, TP ranks half the sharded rows).
The dist checkpoint ``convert_hf import`` writes under EP=2 loads under PP=2 with the same logits.

One pair of rank processes (the rank pool of tests/helpers/ranks.py) serves all layouts and
families, one case per layout."""

import pytest
import torch

from tests.helpers import hf_models
from tests.helpers.ranks import run_ranks

LAYOUTS = {"tp2-sp": dict(tp=2), "ep2": dict(ep=2), "pp2": dict(pp=2)}


def _load_converted(directory: str, input_ids: torch.Tensor):
    from megatron.core import dist_checkpointing

    from megatron_slmoe.hf.convert import build_model_in_layout
    from megatron_slmoe.model.model_file import load_model_config

    # Built as the fine-tuning entry point builds it from --model-config, loaded as
    # --base-checkpoint loads it.
    model, _ = build_model_in_layout(load_model_config(f"{directory}/model_config.yaml"))
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), directory))
    return hf_models.megatron_logits(model, input_ids)


def _one_layout(layout: str, checkpoints: dict, input_ids: torch.Tensor, converted: str,
                kimi_dir: str, kimi_inputs: dict, qwen3_vl_dir: str,
                qwen3_vl_inputs: dict) -> dict:
    from megatron_slmoe.hf.convert import import_to_dist_checkpoint
    from megatron_slmoe.hf.loader import open_hf_checkpoint

    results = {}
    for name, hf_dir in checkpoints.items():
        logits, report = hf_models.import_and_run(hf_dir, input_ids)
        results[layout, name] = (logits, report.bytes_read)
    logits, report = hf_models.kimi_import_and_run(kimi_dir, kimi_inputs)
    results[layout, "kimi_k25"] = (logits, report.bytes_read)
    logits, report = hf_models.kimi_import_and_run(qwen3_vl_dir, qwen3_vl_inputs)
    results[layout, "qwen3_vl_moe"] = (logits, report.bytes_read)
    if layout == "ep2":
        import_to_dist_checkpoint(open_hf_checkpoint(checkpoints["deepseek_v3"]), converted)
    if layout == "pp2":
        results["converted"] = _load_converted(converted, input_ids)
    return results


@pytest.fixture(scope="module")
def parallel_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-parallel")
    input_ids = hf_models.tokens()
    checkpoints, references = {}, {}
    for name in hf_models.FAMILY_NAMES:
        model = hf_models.save_family(name, str(root / name))
        checkpoints[name] = str(root / name)
        references[name] = hf_models.hf_logits(model, input_ids)
    # One family in transformers 5's fused-expert layout as well.
    model = hf_models.save_family("qwen3_moe", str(root / "qwen3_moe-fused"), layout="fused")
    checkpoints["qwen3_moe-fused"] = str(root / "qwen3_moe-fused")
    references["qwen3_moe-fused"] = hf_models.hf_logits(model, input_ids)
    # Kimi-K2.5 on an image+text batch: the vision tower and projector on the first stage.
    kimi, kimi_inputs = hf_models.build_kimi(), hf_models.kimi_inputs()
    hf_models.save(kimi, str(root / "kimi_k25"), layout="fused")
    references["kimi_k25"] = hf_models.kimi_hf_logits(kimi, kimi_inputs)
    # Qwen3-VL-MoE: DeepStack into the first decoder layer, 3D rotary positions on every stage.
    qwen3_vl, qwen3_vl_inputs = hf_models.build_qwen3_vl_moe(), hf_models.qwen3_vl_inputs()
    hf_models.save(qwen3_vl, str(root / "qwen3_vl_moe"), layout="fused")
    image = qwen3_vl_inputs["input_ids"] == hf_models.QWEN3_VL_IMAGE_TOKEN
    with torch.no_grad():
        references["qwen3_vl_moe"] = qwen3_vl(**qwen3_vl_inputs,
                                              mm_token_type_ids=image.int()).logits.float()
    per_rank = [{} for _ in range(2)]
    for layout, sizes in LAYOUTS.items():  # in this order: pp2 loads what ep2 converted
        for rank, results in enumerate(run_ranks(
                _one_layout, 2, etp=1, timeout=300.0, **sizes, layout=layout,
                checkpoints=checkpoints, input_ids=input_ids, converted=str(root / "converted"),
                kimi_dir=str(root / "kimi_k25"), kimi_inputs=kimi_inputs,
                qwen3_vl_dir=str(root / "qwen3_vl_moe"), qwen3_vl_inputs=qwen3_vl_inputs)):
            per_rank[rank].update(results)
    return per_rank, references


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_import_matches_transformers(parallel_results, layout):
    per_rank, references = parallel_results
    for name, reference in references.items():
        outputs = [rank[layout, name][0] for rank in per_rank]
        produced = [out for out in outputs if out is not None]
        assert produced, f"{layout} {name}: no rank produced logits"
        for logits in produced:
            torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5,
                                       msg=f"{layout} {name}")


def test_checkpoint_converted_under_ep2_loads_under_pp2(parallel_results):
    per_rank, references = parallel_results
    produced = [rank["converted"] for rank in per_rank if rank["converted"] is not None]
    assert len(produced) == 1
    torch.testing.assert_close(produced[0], references["deepseek_v3"], rtol=1e-5, atol=1e-5)


def test_ranks_read_only_their_slices(parallel_results):
    """Under TP and EP each rank reads less than the whole checkpoint; the ranks of a layout
    together read at least all of it (everything replicated is read by both)."""
    per_rank, _ = parallel_results
    for layout in ("tp2-sp", "ep2", "pp2"):
        for name in (*hf_models.FAMILY_NAMES, "kimi_k25", "qwen3_vl_moe"):
            read = [rank[layout, name][1] for rank in per_rank]
            assert all(r > 0 for r in read)
            assert max(read) < sum(read), (layout, name, read)
