"""The native grouped LoRA expert op against the fp64 pure-torch reference: one matrix for every
device with a kernel (CPU always; CUDA skipped without a GPU), plus what is particular to a device
(the CPU's threaded schedule; CUDA's multi-tile shapes, alignment, streams and agreement with the
CPU kernel). ``pytest tests/kernels -k cuda`` runs the CUDA part alone."""

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
    native_kernels,
)
from megatron_slmoe.ops.lora_expert import lora_dropout_mask

# Empty experts first, in the middle and last; d_in, d_out not multiples of 8.
COUNTS = [0, 5, 0, 7, 3, 0]
D_IN, D_OUT = 13, 37
SCALING = 2.0
# Norm-relative bounds against fp64 from the same rounded inputs.
BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=requires_cuda)])
def device(request):
    return request.param


def make_case(counts=COUNTS, d_in=D_IN, d_out=D_OUT, r=4, dtype=torch.float64, device="cpu",
              seed=0):
    """Inputs drawn in fp64 on the CPU (the same numbers on every device), then cast and moved."""
    g = torch.Generator().manual_seed(seed)
    E, T = len(counts), sum(counts)

    def rand(*shape, fan_in=1):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) / fan_in**0.5).to(device, dtype)

    return dict(
        x_TD=rand(T, d_in),
        weight_EOD=rand(E, d_out, d_in, fan_in=d_in),
        lora_a_ERD=rand(E, r, d_in, fan_in=d_in),
        lora_b_EOR=rand(E, d_out, r, fan_in=r),
        tokens_per_expert_E=torch.tensor(counts, dtype=torch.int64),  # stays on the CPU
    )


def grad_y_for(case, dtype=None, seed=1):
    T, d_out = case["x_TD"].shape[0], case["weight_EOD"].shape[1]
    g = torch.Generator().manual_seed(seed)
    gy = torch.randn(T, d_out, generator=g, dtype=torch.float64)
    return gy.to(case["x_TD"].device, dtype or case["x_TD"].dtype)


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
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


# --- every device ------------------------------------------------------------------------------


def test_kernel_is_registered(device):
    report = native_kernels()
    assert report["extension"], "megatron_slmoe._C did not load"
    assert device in report["lora_grouped_linear"], f"no {device} kernel: {report}"
    assert choose_backend("lora_grouped_linear", device) == "native"


@pytest.mark.parametrize("r", [4, 8, 16, 32])
def test_fp64_forward_and_grads_match_reference(device, r):
    case = make_case(r=r, device=device)
    grad_y = grad_y_for(case)
    y, grads = run(LoRAGroupedLinear.apply, case, grad_y)
    y_ref, grads_ref = run(lora_grouped_linear_reference, case, grad_y)
    assert y.device.type == device and all(g.device.type == device for g in grads)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    for name, got, want in zip(("dx", "dA", "dB"), grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_empty_experts_get_exactly_zero_adapter_grads(device, dtype):
    case = make_case(r=8, dtype=dtype, device=device)
    _, (_, da, db) = run(LoRAGroupedLinear.apply, case, grad_y_for(case))
    empty = [e for e, c in enumerate(COUNTS) if c == 0]
    assert torch.all(da[empty] == 0) and torch.all(db[empty] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("r", [4, 8, 16, 32])
def test_low_precision_within_norm_relative_bound(device, dtype, r):
    case = make_case(r=r, dtype=dtype, device=device)
    grad_y = grad_y_for(case, torch.float64)
    y, grads = run(LoRAGroupedLinear.apply, case, grad_y.to(dtype))
    y_ref, grads_ref = run(lora_grouped_linear_reference, fp64(case), grad_y)
    assert y.dtype == dtype and all(g.dtype == dtype for g in grads)
    assert rel_err(y, y_ref) < BOUNDS[dtype]
    for name, got, want in zip(("dx", "dA", "dB"), grads, grads_ref):
        assert rel_err(got, want) < BOUNDS[dtype], name


def test_gradcheck_fp64(device):
    case = make_case(counts=[2, 0, 3], d_in=5, d_out=4, r=2, device=device)
    w, tpe = case["weight_EOD"], case["tokens_per_expert_E"]
    inputs = tuple(case[k].clone().requires_grad_() for k in ("x_TD", "lora_a_ERD", "lora_b_EOR"))
    assert torch.autograd.gradcheck(lambda x, a, b: LoRAGroupedLinear.apply(x, w, a, b, tpe, 0.5), inputs)
    mask = lora_dropout_mask(case["x_TD"], 0.5)
    assert torch.autograd.gradcheck(lambda x, a, b: LoRAGroupedLinear.apply(x, w, a, b, tpe, 0.5, mask), inputs)
    probs = torch.rand(5, dtype=torch.float64, device=device).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x, a, b, p: LoRAGroupedLinear.apply(x, w, a, b, tpe, 0.5, mask, p), (*inputs, probs))


def _run_with_probs(fn, case, grad_y_TO, probs_T, lora_mask_TD=None):
    """y and (dx, dA, dB, dprobs) of fn with output rows scaled by probs."""
    x = case["x_TD"].clone().requires_grad_()
    a = case["lora_a_ERD"].clone().requires_grad_()
    b = case["lora_b_EOR"].clone().requires_grad_()
    p = probs_T.clone().requires_grad_()
    y = fn(x, case["weight_EOD"], a, b, case["tokens_per_expert_E"], SCALING, lora_mask_TD, p)
    y.backward(grad_y_TO)
    return y.detach(), (x.grad, a.grad, b.grad, p.grad)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("dropout", [False, True])
def test_probs_scale_output_rows_with_their_gradients(device, dtype, dropout):
    case = make_case(counts=[0, 30, 200, 0, 9], d_in=64, d_out=40, r=8, dtype=dtype, device=device)
    T = case["x_TD"].shape[0]
    probs = torch.rand(T, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    probs[::7] = 0.0  # padded rows carry probability 0 and still get d(probs)
    mask = lora_dropout_mask(case["x_TD"], 0.3) if dropout else None
    grad_y = grad_y_for(case)
    y, grads = _run_with_probs(LoRAGroupedLinear.apply, case, grad_y, probs.to(device, dtype), mask)
    y_ref, grads_ref = _run_with_probs(lora_grouped_linear_reference, fp64(case), grad_y.double(),
                                       probs, None if mask is None else mask.double())
    bound = 1e-10 if dtype == torch.float64 else BOUNDS[dtype]
    assert rel_err(y, y_ref) < bound
    for name, got, want in zip(("dx", "dA", "dB", "dprobs"), grads, grads_ref):
        assert got.dtype == dtype and rel_err(got, want) < bound, name


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dropout_mask_matches_reference(device, dtype):
    case = make_case(counts=[0, 30, 200, 0, 9], d_in=64, d_out=40, r=8, dtype=dtype, device=device)
    mask = lora_dropout_mask(case["x_TD"], 0.3)
    grad_y = grad_y_for(case)
    y, grads = run(LoRAGroupedLinear.apply, case, grad_y, mask)
    y_ref, grads_ref = run(lora_grouped_linear_reference, fp64(case), grad_y.double(), mask.double())
    bound = 1e-10 if dtype == torch.float64 else BOUNDS[dtype]
    assert rel_err(y, y_ref) < bound
    for name, got, want in zip(("dx", "dA", "dB"), grads, grads_ref):
        assert rel_err(got, want) < bound, name


def test_public_dropout_masks_only_the_lora_input(device):
    case = make_case(r=8, device=device)
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


def test_only_requested_grads_are_computed(device):
    case = make_case(device=device)
    a = case["lora_a_ERD"].clone().requires_grad_()
    b = case["lora_b_EOR"].clone().requires_grad_()
    y = LoRAGroupedLinear.apply(case["x_TD"], case["weight_EOD"], a, b, case["tokens_per_expert_E"], SCALING)
    y.sum().backward()
    _, (_, da_ref, db_ref) = run(lora_grouped_linear_reference, case, torch.ones_like(y))
    torch.testing.assert_close(a.grad, da_ref)
    torch.testing.assert_close(b.grad, db_ref)


def test_non_contiguous_inputs(device):
    case = make_case(r=8, device=device)
    case_nc = dict(case, x_TD=case["x_TD"].T.contiguous().T)  # same values, transposed strides
    assert not case_nc["x_TD"].is_contiguous()
    grad_y = grad_y_for(case).T.contiguous().T
    y, grads = run(LoRAGroupedLinear.apply, case_nc, grad_y)
    y_ref, grads_ref = run(lora_grouped_linear_reference, case, grad_y)
    torch.testing.assert_close(y, y_ref)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want)


def test_no_rows_and_rank_zero(device):
    case = make_case(counts=[0, 0, 0], r=8, dtype=torch.bfloat16, device=device)
    y, (dx, da, db) = run(LoRAGroupedLinear.apply, case, grad_y_for(case))
    assert y.shape == (0, D_OUT) and dx.shape == (0, D_IN)
    assert torch.all(da == 0) and torch.all(db == 0)
    case = make_case(counts=[3, 0, 4], r=0, dtype=torch.float64, device=device)
    grad_y = grad_y_for(case)
    y, (dx, _, _) = run(LoRAGroupedLinear.apply, case, grad_y)
    y_ref, (dx_ref, _, _) = run(lora_grouped_linear_reference, case, grad_y)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(dx, dx_ref)


@pytest.mark.parametrize("gated", [True, False], ids=["swiglu", "squared_relu"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_expert_mlp_matches_composed_references(device, dtype, gated):
    from megatron.core.activations import squared_relu

    counts, d, d_ff, r = [40, 0, 61, 1], 48, 40, 8
    fc1_rows = 2 * d_ff if gated else d_ff
    g = torch.Generator().manual_seed(1)
    E, T = len(counts), sum(counts)

    def rand(*shape):
        t = torch.randn(*shape, generator=g, dtype=torch.float64) / shape[-1] ** 0.5
        return t.to(device, dtype).requires_grad_()

    fc1 = LoRAGroupedWeights(rand(E, fc1_rows, d).detach(), rand(E, r, d), rand(E, fc1_rows, r))
    fc2 = LoRAGroupedWeights(rand(E, d, d_ff).detach(), rand(E, r, d_ff), rand(E, d, r))
    x = rand(T, d)
    probs = (torch.rand(T, generator=g, dtype=torch.float64) * T ** 0.5).to(device).requires_grad_()
    tpe = torch.tensor(counts)
    trainable = (x, fc1.lora_a, fc1.lora_b, fc2.lora_a, fc2.lora_b, probs)

    if gated:
        y = lora_expert_mlp(x, tpe, fc1, fc2, SCALING, probs_T=probs)
    else:
        y = lora_expert_mlp(x, tpe, fc1, fc2, SCALING, activation_func=squared_relu, gated=False,
                            probs_T=probs)
    grads = torch.autograd.grad(y.sum(), trainable)

    def composed(x, fc1, fc2, probs):
        """The base experts' math: the probability scales the activation before fc2."""
        h = lora_grouped_linear_reference(x, *fc1, tpe, SCALING)
        if gated:
            act = torch.nn.functional.silu(h[:, :d_ff]) * h[:, d_ff:]
        else:
            act = torch.relu(h).pow(2)
        return lora_grouped_linear_reference(act * probs.unsqueeze(1), *fc2, tpe, SCALING)

    as64 = [t.detach().double().requires_grad_() for t in trainable]
    fc1_64 = LoRAGroupedWeights(fc1.weight.double(), as64[1], as64[2])
    fc2_64 = LoRAGroupedWeights(fc2.weight.double(), as64[3], as64[4])
    y_ref = composed(as64[0], fc1_64, fc2_64, as64[5])
    grads_ref = torch.autograd.grad(y_ref.sum(), as64)
    bound = 1e-10 if dtype == torch.float64 else 3e-2
    assert rel_err(y, y_ref) < bound
    for got, want in zip(grads, grads_ref):
        assert rel_err(got, want) < bound


def _bad_inputs():
    case = make_case()
    T = case["x_TD"].shape[0]
    return [
        ("probs must have shape", dict(probs_T=torch.rand(T - 1, dtype=torch.float64))),
        ("probs has dtype", dict(probs_T=torch.rand(T, dtype=torch.float32))),
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
@pytest.mark.parametrize("match, change", _bad_inputs(), ids=[m for m, _ in _bad_inputs()])
def test_bad_input_raises_clear_error(device, backend, match, change, monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, backend)
    case = {k: (v.to(device) if v.is_floating_point() else v)
            for k, v in dict(make_case(), **change).items()}
    probs = case.pop("probs_T", None)
    with pytest.raises((ValueError, TypeError), match=match):
        if probs is None:
            lora_grouped_linear(*case.values(), SCALING)
        else:  # the public function casts probs to x's dtype: call the op and the reference
            fn = LoRAGroupedLinear.apply if backend == "auto" else lora_grouped_linear_reference
            fn(*case.values(), SCALING, None, probs)


def test_trainable_weight_and_bad_dropout_are_rejected(device):
    case = make_case(device=device)
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


# --- CPU: the threaded schedule ----------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "counts",
    [[30, 600, 0, 20, 50], [100, 0, 90, 120, 80, 110, 0, 100]],
    ids=["one_big_expert", "uneven_small_experts"],
)
def test_cpu_threaded_schedule(threads, counts):
    # Big enough (> 2**20 multiply-adds) for the kernel to use threads: a dominant expert runs alone
    # with threaded GEMMs, the others are packed onto threads.
    case = make_case(counts=counts, d_in=64, d_out=48, r=8)
    grad_y = grad_y_for(case)
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


# --- CUDA: tiles, alignment, streams, agreement with the CPU kernel ------------------------------


# Several row tiles per expert (128 rows each), several column and k tiles, skewed groups with
# empty experts; 16-byte aligned rows (the cp.async path) and not (element loads).
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "counts, d_in, d_out, r",
    [
        ([0, 1, 300, 17, 0, 1024, 5], 256, 384, 16),
        ([129, 0, 128, 127, 1], 200, 136, 64),
        ([40, 0, 333], 197, 263, 8),
        ([7] * 40 + [0] * 20 + [500], 96, 64, 32),
    ],
    ids=["skewed_aligned", "tile_edges_r64", "unaligned", "many_experts"],
)
def test_cuda_multi_tile_shapes(dtype, counts, d_in, d_out, r):
    case = make_case(counts=counts, d_in=d_in, d_out=d_out, r=r, dtype=dtype, device="cuda")
    grad_y = grad_y_for(case, torch.float64)
    y, grads = run(LoRAGroupedLinear.apply, case, grad_y.to(dtype))
    y_ref, grads_ref = run(lora_grouped_linear_reference, fp64(case), grad_y)
    assert rel_err(y, y_ref) < BOUNDS[dtype]
    for name, got, want in zip(("dx", "dA", "dB"), grads, grads_ref):
        assert rel_err(got, want) < BOUNDS[dtype], name


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_cuda_matches_cpu_kernel(dtype):
    counts = [3, 0, 130, 9, 0, 64]
    cpu = make_case(counts=counts, d_in=72, d_out=41, r=16, dtype=dtype, device="cpu")
    gpu = {k: (v.to("cuda") if v.is_floating_point() else v) for k, v in cpu.items()}
    grad_y = grad_y_for(cpu)
    y_cpu, grads_cpu = run(LoRAGroupedLinear.apply, cpu, grad_y)
    y_gpu, grads_gpu = run(LoRAGroupedLinear.apply, gpu, grad_y.to("cuda"))
    bound = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert rel_err(y_gpu.cpu(), y_cpu) < bound
    for name, got, want in zip(("dx", "dA", "dB"), grads_gpu, grads_cpu):
        assert rel_err(got.cpu(), want) < bound, name


@requires_cuda
def test_cuda_misaligned_storage_offset():
    # x and grad_y are row slices of bigger buffers: contiguous, but 2 bytes past a 16-byte
    # boundary, so the kernel must load them element-wise (cp.async needs 16-byte alignment).
    case = make_case(counts=[40, 0, 25], d_in=64, d_out=48, r=16, dtype=torch.bfloat16,
                     device="cuda")
    grad_y = grad_y_for(case)

    def offset_copy(t):
        big = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        out = big[1:].view_as(t)
        out.copy_(t)
        assert out.is_contiguous() and out.data_ptr() % 16 != 0
        return out

    w, a, b, tpe = (case[k] for k in ("weight_EOD", "lora_a_ERD", "lora_b_EOR", "tokens_per_expert_E"))
    fwd, bwd = torch.ops.slmoe.lora_grouped_linear_fwd, torch.ops.slmoe.lora_grouped_linear_bwd
    y_ref, h_ref = fwd(case["x_TD"], w, a, b, tpe, SCALING, None)
    y, h = fwd(offset_copy(case["x_TD"]), w, a, b, tpe, SCALING, None)
    assert torch.equal(y, y_ref) and torch.equal(h, h_ref)
    grads_ref = bwd(grad_y, case["x_TD"], w, a, b, h_ref, tpe, SCALING, None, [True, True, True])
    grads = bwd(offset_copy(grad_y), offset_copy(case["x_TD"]), w, a, b, offset_copy(h_ref), tpe, SCALING, None,
                [True, True, True])
    for got, want in zip(grads, grads_ref):
        assert torch.equal(got, want)


@requires_cuda
def test_cuda_side_stream_and_determinism():
    case = make_case(counts=[100, 0, 257, 3], d_in=128, d_out=96, r=16, dtype=torch.bfloat16,
                     device="cuda")
    grad_y = grad_y_for(case)
    first = run(LoRAGroupedLinear.apply, case, grad_y)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        second = run(LoRAGroupedLinear.apply, case, grad_y)
    torch.cuda.current_stream().wait_stream(stream)
    # No atomics anywhere: the same inputs give bitwise the same outputs, on any stream.
    assert torch.equal(first[0], second[0])
    for got, want in zip(first[1], second[1]):
        assert torch.equal(got, want)


@requires_cuda
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_cuda_bad_placement_raises_clear_error(backend, monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, backend)
    case = make_case(device="cuda")
    with pytest.raises(ValueError, match="tokens_per_expert must be a CPU tensor"):
        lora_grouped_linear(*dict(case, tokens_per_expert_E=case["tokens_per_expert_E"].to("cuda")).values(), SCALING)
    with pytest.raises(ValueError, match="lora_a is on cpu but x is on cuda"):
        lora_grouped_linear(*dict(case, lora_a_ERD=case["lora_a_ERD"].cpu()).values(), SCALING)
