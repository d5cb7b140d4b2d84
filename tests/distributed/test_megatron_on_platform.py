"""Megatron-Core's own GPTModel with MoE, DDP, optimizer, schedules and dist checkpointing run
on this platform (gloo ranks on CPU) after ``import megatron_slmoe``, and a parallel layout
reproduces the single-rank run: same loss, same gradients, same optimizer step."""

import pytest

from tests.helpers import gpt_case
from tests.helpers.ranks import run_ranks

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4


def _reference(tmp_path_factory, variant):
    root = tmp_path_factory.mktemp(f"reference-{variant}")
    dirs = {name: str(root / name) for name in ("weights_dir", "grads_dir", "stepped_dir")}
    for d in dirs.values():
        (root / d).mkdir()
    (result,) = run_ranks(gpt_case.reference_run, 1, variant=variant, **dirs)
    return dirs, result["loss"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _reference(tmp_path_factory, "megatron")


@pytest.fixture(scope="module")
def slmoe_reference(tmp_path_factory):
    return _reference(tmp_path_factory, "slmoe")


def _check(results, reference_loss, check_grads=True):
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert losses, "no rank reported a loss"
    for loss in losses:
        assert loss == pytest.approx(reference_loss, rel=LOSS_TOL)
    for rank, result in enumerate(results):
        if check_grads:
            bad = {n: e for n, e in result["grad_errors"].items() if e > GRAD_TOL}
            assert not bad, f"rank {rank}: gradients differ from the single-rank run: {bad}"
        bad = {n: e for n, e in result["step_errors"].items() if e > GRAD_TOL}
        assert not bad, f"rank {rank}: weights after the optimizer step differ: {bad}"


@pytest.mark.parametrize("layout", [
    pytest.param({"tp": 2}, id="tp2-sequence-parallel"),
    pytest.param({"pp": 2}, id="pp2"),
    pytest.param({"ep": 2}, id="ep2-dp2"),
])
def test_parallel_layout_matches_single_rank(reference, layout):
    dirs, reference_loss = reference
    results = run_ranks(gpt_case.parallel_run, 2, **layout, **dirs)
    _check(results, reference_loss)


def test_distributed_optimizer_step_matches_single_rank(reference):
    dirs, reference_loss = reference
    results = run_ranks(gpt_case.parallel_run, 2, **dirs, distributed_optimizer=True)
    # Each rank's grad buffer is reduce-scattered: only its own shard is the full gradient, so
    # the comparison is on the weights after the step, which the optimizer all-gathers.
    _check(results, reference_loss, check_grads=False)


def test_dist_checkpoint_saved_in_one_layout_loads_in_another(reference, tmp_path):
    dirs, _ = reference
    tp2_dir = tmp_path / "tp2"
    tp2_dir.mkdir()
    run_ranks(gpt_case.resave_run, 2, tp=2, source_dir=dirs["weights_dir"], target_dir=str(tp2_dir))
    results = run_ranks(gpt_case.compare_run, 2, pp=2, expected_dir=dirs["weights_dir"],
                        actual_dir=str(tp2_dir))
    for rank, errors in enumerate(results):
        assert errors, f"rank {rank} compared nothing"
        assert all(e == 0.0 for e in errors.values()), f"rank {rank}: {errors}"


@pytest.mark.parametrize("layout", [
    pytest.param({"tp": 2, "etp": 1}, id="tp2-sequence-parallel"),
    pytest.param({"ep": 2}, id="ep2-dp2"),
])
def test_slmoe_gpt_parallel_layout_matches_single_rank(slmoe_reference, layout):
    """Our layer (latent width, shared expert, sigmoid routing with expert bias) inside Megatron's
    GPTModel: same loss, gradients and step on 2 ranks; its expert shards load across EP sizes."""
    dirs, reference_loss = slmoe_reference
    results = run_ranks(gpt_case.parallel_run, 2, **layout, **dirs, variant="slmoe")
    _check(results, reference_loss)
