"""The grouped LoRA expert op over packed (quantised) frozen weights against the dense op on the
decoded weights: forward, the gradients of x, the LoRA factors and the router probabilities, for
every format, on the pure-torch twin and on the native CPU kernel; and autograd keeps no decoded
weight (a saved-tensors hook sees every tensor it keeps)."""

import pytest
import torch

from megatron_slmoe.ops import (
    KERNELS_ENV,
    LoRAGroupedWeights,
    PackedWeight,
    lora_expert_mlp,
    lora_grouped_linear,
    lora_grouped_linear_reference,
)
from megatron_slmoe.ops import quantized_weights as qw
from megatron_slmoe.ops._native import choose_backend, has_native_kernel

COUNTS = [0, 5, 0, 7, 3, 0]  # empty experts first, in the middle and last
D_IN, D_OUT, R = 64, 40, 4
SCALING = 2.0
# (format, encode keywords): FP8 in small blocks that cut the 40 rows into a partial last block.
FORMATS = [(qw.MXFP4, {}), (qw.INT4, {"group_size": 32}), (qw.BLOCK_FP8, {"block": (16, 32)})]

BACKENDS = ["reference", pytest.param("native", marks=pytest.mark.skipif(
    not has_native_kernel("lora_grouped_linear_packed", "cpu"),
    reason="the extension has no packed CPU kernel"))]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, request.param)
    return request.param


def make_case(fmt, kw, dtype, counts=COUNTS, d_in=D_IN, d_out=D_OUT, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, fan_in=1):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) / fan_in**0.5).to(dtype)

    E, T = len(counts), sum(counts)
    weight = PackedWeight.encode(rand(E, d_out, d_in, fan_in=d_in).float(), fmt, **kw)
    return dict(x=rand(T, d_in), weight=weight, a=rand(E, R, d_in, fan_in=d_in),
                b=rand(E, d_out, R, fan_in=R), tokens=torch.tensor(counts), probs=rand(T).abs())


def run(case, weight, dropout=0.0, with_probs=True, seed=3):
    """y and the gradients of x, A, B (and probs) of lora_grouped_linear with ``weight``."""
    x, a, b = (case[k].clone().requires_grad_() for k in ("x", "a", "b"))
    probs = case["probs"].clone().requires_grad_() if with_probs else None
    torch.manual_seed(seed)  # the same dropout mask for both weights
    y = lora_grouped_linear(x, weight, a, b, case["tokens"], SCALING, dropout, probs)
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y.backward(grad_y.to(y.dtype))
    grads = [x.grad, a.grad, b.grad] + ([probs.grad] if with_probs else [])
    return [y.detach()] + grads


def rel(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("dtype, bound", [(torch.float64, 1e-12), (torch.float32, 1e-6)],
                         ids=["fp64", "fp32"])
@pytest.mark.parametrize("fmt, kw", FORMATS, ids=[f for f, _ in FORMATS])
def test_packed_equals_dense_on_the_decoded_weight(backend, fmt, kw, dtype, bound, dropout):
    case = make_case(fmt, kw, dtype)
    dense = case["weight"].decode(dtype)  # the oracle: dequantise, then the dense op
    for got, want in zip(run(case, case["weight"], dropout), run(case, dense, dropout)):
        assert rel(got, want) <= bound


@pytest.mark.parametrize("fmt, kw", FORMATS, ids=[f for f, _ in FORMATS])
def test_bf16_packed_equals_the_dense_reference(backend, fmt, kw):
    case = make_case(fmt, kw, torch.bfloat16)
    dense = case["weight"].decode(torch.bfloat16)
    packed_out = run(case, case["weight"], with_probs=False)
    # The dense reference runs the same bf16 GEMMs per expert: equal up to bf16 rounding order.
    x, a, b = (case[k].clone().requires_grad_() for k in ("x", "a", "b"))
    y = lora_grouped_linear_reference(x, dense, a, b, case["tokens"], SCALING)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1),
                           dtype=torch.float64).to(y.dtype))
    for got, want in zip(packed_out, [y.detach(), x.grad, a.grad, b.grad]):
        assert rel(got, want) <= 1e-2


def test_autograd_keeps_no_decoded_weight(backend):
    case = make_case(qw.MXFP4, {}, torch.float32)
    weight = case["weight"]
    saved = []

    def pack(t):
        saved.append(t)
        return t

    x, a, b = (case[k].clone().requires_grad_() for k in ("x", "a", "b"))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = lora_grouped_linear(x, weight, a, b, case["tokens"], SCALING, 0.25, case["probs"])
    tile = D_OUT * D_IN
    assert x.numel() < tile  # so that a float tensor of a tile's size can only be a decoded weight
    assert saved and all(not t.is_floating_point() or t.numel() < tile for t in saved), \
        [(t.dtype, tuple(t.shape)) for t in saved]
    # What backward needs of W is the packed bytes and the scales themselves, not copies.
    ptrs = {t.data_ptr() for t in saved}
    assert weight.packed.data_ptr() in ptrs and weight.scale.data_ptr() in ptrs
    y.sum().backward()
    assert a.grad is not None and x.grad is not None


@pytest.mark.parametrize("fmt, kw", FORMATS, ids=[f for f, _ in FORMATS])
def test_expert_mlp_and_expert_shards(backend, fmt, kw):
    # fc1 (gate|up) and fc2 packed, the experts of rank 1 of 2 (EP) cut from the stacked weight.
    g = torch.Generator().manual_seed(5)
    E, local, F = 6, 3, 32
    fc1_full = PackedWeight.encode(torch.randn(E, 2 * F, D_IN, generator=g) / 8, fmt, **kw)
    fc2_full = PackedWeight.encode(torch.randn(E, D_IN, F, generator=g) / 6, fmt, **kw)
    fc1, fc2 = fc1_full.narrow(0, local, local), fc2_full.narrow(0, local, local)
    counts = torch.tensor([4, 0, 6])
    x = torch.randn(int(counts.sum()), D_IN, generator=g, dtype=torch.float64)
    probs = torch.rand(x.shape[0], generator=g, dtype=torch.float64)
    lora = [torch.randn(local, R, D_IN, generator=g, dtype=torch.float64) / 8,
            torch.randn(local, 2 * F, R, generator=g, dtype=torch.float64) / 2,
            torch.randn(local, R, F, generator=g, dtype=torch.float64) / 6,
            torch.randn(local, D_IN, R, generator=g, dtype=torch.float64) / 2]
    y = lora_expert_mlp(x, counts, LoRAGroupedWeights(fc1, *lora[:2]),
                        LoRAGroupedWeights(fc2, *lora[2:]), SCALING, probs_T=probs)
    want = lora_expert_mlp(x, counts, LoRAGroupedWeights(fc1_full.decode(torch.float64)[local:], *lora[:2]),
                           LoRAGroupedWeights(fc2_full.decode(torch.float64)[local:], *lora[2:]),
                           SCALING, probs_T=probs)
    assert rel(y, want) <= 1e-12


def test_packed_weight_of_another_shape_is_refused(backend):
    case = make_case(qw.INT4, {"group_size": 32}, torch.float32)
    with pytest.raises(ValueError, match=r"weight must have shape \[E, d_out, d_in\] = \[6, 40, 32\], "
                                         r"got \(6, 40, 64\)"):
        lora_grouped_linear(case["x"][:, :32], case["weight"], case["a"][..., :32], case["b"],
                            case["tokens"], SCALING)


requires_native = pytest.mark.skipif(not has_native_kernel("lora_grouped_linear_packed", "cpu"),
                                     reason="the extension has no packed CPU kernel")


@requires_native
@pytest.mark.parametrize("fmt, kw", FORMATS, ids=[f for f, _ in FORMATS])
def test_native_threaded_schedule(fmt, kw, monkeypatch):
    # One expert big enough to run alone with its decode spread over the threads, the small ones
    # binned onto threads with a scratch tile each (csrc/cpu/expert_schedule.h).
    monkeypatch.setenv(KERNELS_ENV, "native")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        case = make_case(fmt, kw, torch.float64, counts=[200, 3, 0, 5, 4, 2], d_in=256, d_out=128)
        dense = case["weight"].decode(torch.float64)
        for got, want in zip(run(case, case["weight"]), run(case, dense)):
            assert rel(got, want) <= 1e-12
    finally:
        torch.set_num_threads(threads)


@requires_native
@pytest.mark.parametrize("change, match", [
    (dict(format="nvfp4-pack-quantized"), r"unknown quantised format 'nvfp4-pack-quantized'"),
    (dict(packed=lambda p: p[..., :-1]), r"packed must have shape .* = \[6, 40, 32\], got \[6, 40, 31\]"),
    (dict(block=[1, 16]), r"blocks are \[1, 32\], got \[1, 16\]"),
], ids=["format", "truncated", "block"])
def test_native_op_refuses_bad_packed_weights_in_one_line(change, match):
    case = make_case(qw.MXFP4, {}, torch.float32)
    w = case["weight"]
    args = dict(packed=w.packed, scale=w.scale, format=w.format, block=list(w.block))
    for key, value in change.items():
        args[key] = value(args[key]) if callable(value) else value
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match) as info:
        torch.ops.slmoe.lora_grouped_linear_packed_fwd(
            case["x"], case["a"], case["b"], case["tokens"], SCALING, None, None, args["packed"],
            args["scale"], args["format"], args["block"], list(w.matrix_shape))
    assert "\n" not in str(info.value).strip()


@requires_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_native_decode_is_bit_exact(dtype):
    # The kernel's tile read back through its own GEMM: with x = I and B = 0 the output is W^T
    # exactly (each entry one product with 1, plus zeros). MXFP4: every packed byte under every
    # scale from 2^-119 to 2^125 (no subnormal, no overflow); INT4 and FP8: random bytes.
    mx_scales = torch.arange(8, 253, dtype=torch.uint8)
    weights = [
        PackedWeight(qw.MXFP4, torch.arange(256, dtype=torch.uint8).repeat(len(mx_scales), 1),
                     mx_scales.unsqueeze(1).repeat(1, 16), (len(mx_scales), 512), (1, 32)),
        PackedWeight.encode(torch.randn(96, 512, generator=torch.Generator().manual_seed(2)), qw.INT4,
                            group_size=32),
        PackedWeight.encode(torch.randn(96, 512, generator=torch.Generator().manual_seed(3)),
                            qw.BLOCK_FP8, block=(32, 128)),
    ]
    for w in weights:
        stacked = PackedWeight.stack([w])
        out, cols = w.matrix_shape
        x = torch.eye(cols, dtype=dtype)
        y = torch.ops.slmoe.lora_grouped_linear_packed_fwd(
            x, torch.zeros(1, 1, cols, dtype=dtype), torch.zeros(1, out, 1, dtype=dtype),
            torch.tensor([cols]), 1.0, None, None, stacked.packed, stacked.scale, w.format,
            list(w.block), list(w.matrix_shape))[0]
        assert torch.equal(y.T, w.decode(dtype)), w.format


# --- CUDA (skipped without a GPU; tools/bench/gpu_check.sh runs them where one is lent) -----------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@requires_cuda
def test_cuda_packed_kernel_is_registered():
    assert choose_backend("lora_grouped_linear_packed", "cuda") == "native"


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("fmt, kw", FORMATS + [(qw.INT4, {"group_size": 64})],
                         ids=[f for f, _ in FORMATS] + ["int4-g64"])
def test_cuda_packed_equals_dense_on_the_decoded_weight(fmt, kw, dtype, monkeypatch):
    # The CUDA packed op decodes into a scratch and runs the dense launchers on it: its y and
    # gradients equal, bit for bit, the dense CUDA op's on PackedWeight.decode (the oracle), with
    # dropout and the router probabilities; and in fp64 the CPU reference within 1e-12.
    monkeypatch.setenv(KERNELS_ENV, "native")
    case = make_case(fmt, kw, dtype, counts=[0, 5, 0, 70, 3, 0, 140, 1])
    case = {k: (v.to("cuda") if k != "tokens" else v) for k, v in case.items()}
    dense = case["weight"].decode(dtype)
    for got, want in zip(run(case, case["weight"], 0.25), run(case, dense, 0.25)):
        assert got.device.type == "cuda" and torch.equal(got, want)
    if dtype == torch.float64:
        on_cuda = run(case, case["weight"])
        cpu = {k: v.to("cpu") for k, v in case.items()}
        monkeypatch.setenv(KERNELS_ENV, "reference")
        for got, want in zip(on_cuda, run(cpu, cpu["weight"].decode(dtype))):
            assert rel(got.cpu(), want) <= 1e-12
