"""The native CPU grouped LoRA expert op against the fp64 pure-torch reference."""

import pytest
import torch

from megatron_slmoe.ops import (
    KERNELS_ENV,
    LoRAGroupedLinear,
    LoRAGroupedWeights,
    choose_backend,
    lora_expert_mlp,
    lora_grouped_linear,
    lora_grouped_linear_reference,
)
from megatron_slmoe.ops.lora_expert import lora_dropout_mask

# Empty experts first, in the middle and last; d_in, d_out not multiples of 8.
COUNTS = [0, 5, 0, 7, 3, 0]
D_IN, D_OUT = 13, 37
SCALING = 2.0


def make_case(counts=COUNTS, d_in=D_IN, d_out=D_OUT, r=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, T = len(counts), sum(counts)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    return dict(
        x_TD=rand(T, d_in),
        weight_EOD=rand(E, d_out, d_in) / d_in**0.5,
        lora_a_ERD=rand(E, r, d_in) / d_in**0.5,
        lora_b_EOR=rand(E, d_out, r) / r**0.5,
        tokens_per_expert_E=torch.tensor(counts, dtype=torch.int64),
    )


def run(fn, case, grad_y_TO, lora_mask_TD=None):
    """y and (dx, dA, dB) of fn on fresh leaf copies of the case."""
    x = case["x_TD"].clone().requires_grad_()
    a = case["lora_a_ERD"].clone().requires_grad_()
    b = case["lora_b_EOR"].clone().requires_grad_()
    args = (x, case["weight_EOD"], a, b, case["tokens_per_expert_E"], SCALING)
    y = fn(*args) if lora_mask_TD is None else fn(*args, lora_mask_TD)
    y.backward(grad_y_TO)
    return y.detach(), (x.grad, a.grad, b.grad)


def fp64(case):
    return {k: (v.double() if v.is_floating_point() else v) for k, v in case.items()}


def rel_err(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("r", [4, 8, 16, 32])
def test_fp64_forward_and_grads_match_reference(r):
    case = make_case(r=r)
    grad_y = torch.randn(sum(COUNTS), D_OUT, dtype=torch.float64)
    y, grads = run(LoRAGroupedLinear.apply, case, grad_y)
    y_ref, grads_ref = run(lora_grouped_linear_reference, case, grad_y)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    for name, got, want in zip(("dx", "dA", "dB"), grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=name)


def test_empty_experts_get_exactly_zero_adapter_grads():
    case = make_case()
    _, (_, da, db) = run(LoRAGroupedLinear.apply, case, torch.randn(sum(COUNTS), D_OUT, dtype=torch.float64))
    empty = [e for e, c in enumerate(COUNTS) if c == 0]
    assert torch.all(da[empty] == 0) and torch.all(db[empty] == 0)


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("r", [8, 32])
def test_low_precision_within_norm_relative_bound(dtype, bound, r):
    case = make_case(r=r, dtype=dtype)
    grad_y = torch.randn(sum(COUNTS), D_OUT, dtype=torch.float64)
    y, grads = run(LoRAGroupedLinear.apply, case, grad_y.to(dtype))
    # fp64 reference from the same (rounded) inputs
    y_ref, grads_ref = run(lora_grouped_linear_reference, fp64(case), grad_y)
    assert y.dtype == dtype and all(g.dtype == dtype for g in grads)
    assert rel_err(y, y_ref) < bound
    for name, got, want in zip(("dx", "dA", "dB"), grads, grads_ref):
        assert rel_err(got, want) < bound, name


def test_gradcheck_fp64():
    case = make_case(counts=[2, 0, 3], d_in=5, d_out=4, r=2)
    w, tpe = case["weight_EOD"], case["tokens_per_expert_E"]
    inputs = tuple(case[k].clone().requires_grad_() for k in ("x_TD", "lora_a_ERD", "lora_b_EOR"))
    assert torch.autograd.gradcheck(lambda x, a, b: LoRAGroupedLinear.apply(x, w, a, b, tpe, 0.5), inputs)
    mask = lora_dropout_mask(case["x_TD"], 0.5)
    assert torch.autograd.gradcheck(lambda x, a, b: LoRAGroupedLinear.apply(x, w, a, b, tpe, 0.5, mask), inputs)


def test_dropout_mask_matches_reference():
    case = make_case(r=8)
    mask = lora_dropout_mask(case["x_TD"], 0.3)
    grad_y = torch.randn(sum(COUNTS), D_OUT, dtype=torch.float64)
    y, grads = run(LoRAGroupedLinear.apply, case, grad_y, mask)
    y_ref, grads_ref = run(lora_grouped_linear_reference, case, grad_y, mask)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_public_dropout_masks_only_the_lora_input():
    case = make_case(r=8)
    torch.manual_seed(7)
    y = lora_grouped_linear(*case.values(), SCALING, dropout=0.3)
    torch.manual_seed(7)
    mask = lora_dropout_mask(case["x_TD"], 0.3)
    y_ref = lora_grouped_linear_reference(*case.values(), SCALING, mask)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    # with B = 0 the LoRA term vanishes, so dropout must leave y untouched
    case["lora_b_EOR"] = torch.zeros_like(case["lora_b_EOR"])
    y_base = lora_grouped_linear(*case.values(), SCALING)
    torch.testing.assert_close(lora_grouped_linear(*case.values(), SCALING, dropout=0.9), y_base)


def test_only_requested_grads_are_computed():
    case = make_case()
    a = case["lora_a_ERD"].clone().requires_grad_()
    b = case["lora_b_EOR"].clone().requires_grad_()
    y = LoRAGroupedLinear.apply(case["x_TD"], case["weight_EOD"], a, b, case["tokens_per_expert_E"], SCALING)
    y.sum().backward()
    _, (_, da_ref, db_ref) = run(lora_grouped_linear_reference, case, torch.ones_like(y))
    torch.testing.assert_close(a.grad, da_ref)
    torch.testing.assert_close(b.grad, db_ref)


def test_non_contiguous_inputs():
    case = make_case(r=8)
    x_DT = case["x_TD"].T.contiguous()
    case_nc = dict(case, x_TD=x_DT.T)  # same values, transposed strides
    assert not case_nc["x_TD"].is_contiguous()
    grad_y = torch.randn(D_OUT, sum(COUNTS), dtype=torch.float64).T
    y, grads = run(LoRAGroupedLinear.apply, case_nc, grad_y)
    y_ref, grads_ref = run(lora_grouped_linear_reference, case, grad_y)
    torch.testing.assert_close(y, y_ref)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "counts",
    [[30, 600, 0, 20, 50], [100, 0, 90, 120, 80, 110, 0, 100]],
    ids=["one_big_expert", "uneven_small_experts"],
)
def test_threaded_schedule(threads, counts):
    # Big enough (> 2**20 multiply-adds) for the kernel to use threads: a dominant expert runs alone
    # with threaded GEMMs, the others are packed onto threads.
    case = make_case(counts=counts, d_in=64, d_out=48, r=8)
    grad_y = torch.randn(sum(counts), 48, dtype=torch.float64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y, grads = run(LoRAGroupedLinear.apply, case, grad_y)
    finally:
        torch.set_num_threads(before)
    y_ref, grads_ref = run(lora_grouped_linear_reference, case, grad_y)
    torch.testing.assert_close(y, y_ref)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("gated", [True, False])
def test_expert_mlp_matches_composed_references(gated):
    from megatron.core.activations import squared_relu

    counts, d, d_ff, r = [4, 0, 6, 1], 12, 10, 4
    fc1_rows = 2 * d_ff if gated else d_ff
    g = torch.Generator().manual_seed(1)
    E, T = len(counts), sum(counts)

    def rand(*shape):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) / shape[-1] ** 0.5).requires_grad_()

    fc1 = LoRAGroupedWeights(rand(E, fc1_rows, d).detach(), rand(E, r, d), rand(E, fc1_rows, r))
    fc2 = LoRAGroupedWeights(rand(E, d, d_ff).detach(), rand(E, r, d_ff), rand(E, d, r))
    x = rand(T, d)
    tpe = torch.tensor(counts)
    trainable = (x, fc1.lora_a, fc1.lora_b, fc2.lora_a, fc2.lora_b)

    if gated:
        y = lora_expert_mlp(x, tpe, fc1, fc2, SCALING)
    else:
        y = lora_expert_mlp(x, tpe, fc1, fc2, SCALING, activation_func=squared_relu, gated=False)
    grads = torch.autograd.grad(y.sum(), trainable)

    h = lora_grouped_linear_reference(x, *fc1, tpe, SCALING)
    if gated:
        act = torch.nn.functional.silu(h[:, :d_ff]) * h[:, d_ff:]
    else:
        act = torch.relu(h).pow(2)
    y_ref = lora_grouped_linear_reference(act, *fc2, tpe, SCALING)
    grads_ref = torch.autograd.grad(y_ref.sum(), trainable)
    torch.testing.assert_close(y, y_ref)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want)


def bad_inputs():
    case = make_case()
    return [
        ("sums to 14 but x has 15 rows", dict(tokens_per_expert_E=torch.tensor([0, 5, 0, 6, 3, 0]))),
        ("negative", dict(tokens_per_expert_E=torch.tensor([0, 6, -1, 7, 3, 0]))),
        ("tokens_per_expert must be int64", dict(tokens_per_expert_E=torch.tensor(COUNTS, dtype=torch.int32))),
        ("tokens_per_expert must have shape", dict(tokens_per_expert_E=torch.tensor(COUNTS[:-1]))),
        ("lora_a must have shape", dict(lora_a_ERD=case["lora_a_ERD"][..., :-1])),
        ("lora_b must have shape", dict(lora_b_EOR=case["lora_b_EOR"][:, :-1])),
        ("weight must be 3-D", dict(weight_EOD=case["weight_EOD"][0])),
        ("x must be 2-D", dict(x_TD=case["x_TD"][None])),
        ("lora_b has dtype", dict(lora_b_EOR=case["lora_b_EOR"].float())),
    ]


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("match, change", bad_inputs(), ids=[m for m, _ in bad_inputs()])
def test_bad_input_raises_clear_error(backend, match, change, monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, backend)
    case = dict(make_case(), **change)
    with pytest.raises((ValueError, TypeError), match=match):
        lora_grouped_linear(*case.values(), SCALING)


def test_trainable_weight_and_bad_dropout_are_rejected():
    case = make_case()
    with pytest.raises(ValueError, match="dropout must be in"):
        lora_grouped_linear(*case.values(), SCALING, dropout=1.0)
    case["weight_EOD"].requires_grad_()
    with pytest.raises(ValueError, match="weight must be frozen"):
        lora_grouped_linear(*case.values(), SCALING)
    with torch.no_grad():  # inference may pass unfrozen weights
        lora_grouped_linear(*case.values(), SCALING)
    # the autograd function alone refuses too, once a backward would need dW
    y = LoRAGroupedLinear.apply(*case.values(), SCALING)
    with pytest.raises(ValueError, match="weight must be frozen"):
        y.sum().backward()


def test_backend_choice(monkeypatch):
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    assert choose_backend("lora_grouped_linear", "cpu") == "native"
    assert choose_backend("lora_grouped_linear", "meta") == "reference"
    monkeypatch.setenv(KERNELS_ENV, "reference")
    assert choose_backend("lora_grouped_linear", "cpu") == "reference"
    monkeypatch.setenv(KERNELS_ENV, "native")
    with pytest.raises(RuntimeError, match="no native lora_grouped_linear for meta"):
        choose_backend("lora_grouped_linear", "meta")
    monkeypatch.setenv(KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="SLMOE_KERNELS must be one of"):
        choose_backend("lora_grouped_linear", "cpu")
