"""The emulated CUDA packed launchers (csrc/cuda/lora_expert_packed.cu) against the pure-torch oracle.

Run by csrc/cuda/emu/run.sh with the emulation built as a shared library (packed_shim.cpp):

    python csrc/cuda/emu/packed_oracle.py LIBRARY [--no-mutants]

Per case (MXFP4, INT4 in groups of 32/64/128 with bf16/fp16/fp32 scales, block FP8 with blocks of
unequal sides and partial edge blocks; x in bf16 and fp16; uneven groups with empty experts, and
no rows at all (null pointers, as torch gives empty tensors); the experts in one chunk, one at a
time, and in chunks of two and three):

1. decode: the decode kernel's tile equals ``PackedWeight.decode(dtype)`` (megatron_slmoe.ops.
   quantized_weights, the oracle of the checkpoint libraries' bytes) bit for bit;
2. packed == dense: y, h, dx, dA, dB of the packed launchers equal, bit for bit, those of the
   emulated dense launchers run on ``PackedWeight.decode(dtype)``;
3. the packed results against ``ops.lora_grouped_linear_reference`` (float64, autograd for the
   gradients) on the decoded weight, relative to the norm (bf16 1e-2, fp16 2e-3, as emu_test).

The packed bytes are drawn at random (every code of every nibble occurs), the scales from ranges
that keep the products finite; one extra case decodes E8M0 bytes 0..254 and every FP8 code.

Then every injected bug (SLMOE_MUTANT(n) in the kernel source) must make a check fail. Exit 1 on
any failure or uncaught bug.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..", "..")))

import torch  # noqa: E402

from megatron_slmoe.ops import lora_grouped_linear_reference  # noqa: E402
from megatron_slmoe.ops import quantized_weights as qw  # noqa: E402

DTYPES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}  # DType's order
FORMATS = {qw.MXFP4: 0, qw.INT4: 1, qw.BLOCK_FP8: 2}  # PackedFormat's order
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}

MUTANTS = {
    1: "MXFP4: low and high nibble swapped",
    2: "MXFP4: scale indexed per 16 inputs",
    3: "MXFP4: E8M0 bias 128",
    4: "INT4: nibbles of a word in reverse order",
    5: "INT4: the stored q+8 read as a two's-complement nibble",
    6: "INT4: groups of 32 whatever the group size",
    7: "INT4: q * scale not rounded to the scale's dtype",
    8: "FP8: subnormals decoded as normals",
    9: "FP8: block row index from the column block size",
    10: "chunks: every chunk's rows taken from row 0",
    11: "decode: the chunk's last expert left undecoded",
    12: "decode: experts with rows skipped, empty ones decoded",
}


class CheckFailed(Exception):
    pass


def load(path):
    lib = ctypes.CDLL(path)
    p, i64, i32, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    lib.slmoe_emu_set_mutation.argtypes = [i32]
    lib.slmoe_emu_decode.argtypes = [i32, p, p, i32, i64, i64, i32, i64, i64, i64, i64, p, p]
    lib.slmoe_emu_fwd.argtypes = [i32, i64, i64, i64, i64, i64, f64] + [p] * 9 + [i32, p, p, i32, i64, i64, p, i64]
    lib.slmoe_emu_bwd.argtypes = ([i32, i64, i64, i64, i64, i64, f64] + [p] * 13
                                  + [i32, p, p, i32, i64, i64, p, i64])
    return lib


def ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def padded(t):
    """A copy of ``t`` followed by as many zero bytes: an injected bug that indexes past the end
    reads those instead of another allocation."""
    buf = torch.zeros(2 * t.numel() * t.element_size(), dtype=torch.uint8)
    buf[:t.numel() * t.element_size()] = t.contiguous().flatten().view(torch.uint8)
    return buf


def random_weight(fmt, E, d_out, d_in, g, *, group=32, scale_dtype=torch.bfloat16, block=(16, 32),
                  extreme=False):
    """A PackedWeight of random bytes and scales; ``extreme``: every scale byte / FP8 code."""
    if fmt == qw.MXFP4:
        packed = torch.randint(0, 256, (E, d_out, d_in // 2), generator=g).to(torch.uint8)
        low, high = (0, 255) if extreme else (118, 126)  # 2^-9 .. 2^-2 around 1/sqrt(d_in)
        scale = torch.randint(low, high, (E, d_out, d_in // 32), generator=g).to(torch.uint8)
        return qw.PackedWeight(fmt, packed, scale, (d_out, d_in), (1, 32))
    if fmt == qw.INT4:
        words = torch.randint(-2**31, 2**31, (E, d_out, d_in // 8), generator=g, dtype=torch.int64)
        scale = (torch.randn(E, d_out, d_in // group, generator=g) / (4 * d_in**0.5)).to(scale_dtype)
        return qw.PackedWeight(fmt, words.to(torch.int32), scale, (d_out, d_in), (1, group))
    codes = torch.randint(0, 256, (E, d_out, d_in), generator=g)
    codes = torch.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes)  # no NaN codes
    br, bc = block
    rows, cols = -(-d_out // br), -(-d_in // bc)
    scale = torch.rand(E, rows, cols, generator=g) * (2.0 if extreme else 1e-2) / (448 * d_in**0.5) * 448
    return qw.PackedWeight(fmt, codes.to(torch.uint8).view(torch.float8_e4m3fn), scale, (d_out, d_in), block)


def bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t


def check_decode(lib, name, weight, dtype):
    E, d_out, d_in = weight.shape
    scratch = torch.full((E, d_out, d_in), float("nan"), dtype=dtype)
    scale_dtype = DTYPES.get(weight.scale.dtype, 0)
    pk, sc = padded(weight.packed), padded(weight.scale)  # alive through the call
    err = lib.slmoe_emu_decode(FORMATS[weight.format], ptr(pk), ptr(sc),
                               scale_dtype, weight.block[0], weight.block[1], DTYPES[dtype], d_out, d_in, 0, E,
                               None, ptr(scratch))
    if err:
        raise CheckFailed(f"{name}: decode launch error {err}")
    want = weight.decode(dtype)
    same = (bits(scratch) == bits(want)) | (scratch.isnan() & want.isnan())
    if not bool(same.all()):
        index = [int(i) for i in (~same).nonzero()[0]]
        raise CheckFailed(f"{name}: decode differs from PackedWeight.decode at {index}: "
                          f"{float(scratch[tuple(index)])} vs {float(want[tuple(index)])}")


def run(lib, name, weight, dtype, inputs, counts, scratch_experts, packed):
    """(y, h, dx, dA, dB) of the emulated launchers: packed, or dense on the decoded weight."""
    x, lora_x, mask, a, b, gy, s = inputs
    E, d_out, d_in = weight.shape
    T, r = x.shape[0], a.shape[1]
    c = torch.tensor(counts, dtype=torch.int64)
    ws = torch.full((2 * (E + 1),), -7, dtype=torch.int32)
    dense = None if packed else weight.decode(dtype)
    pk = padded(weight.packed) if packed else None
    sc = padded(weight.scale) if packed else None
    # No rows: nothing is decoded, and the launchers take no scratch (as the binding passes none).
    scratch = torch.full((scratch_experts, d_out, d_in), float("nan"), dtype=dtype) if packed and T else None
    fmt = (FORMATS[weight.format], ptr(pk), ptr(sc), DTYPES.get(weight.scale.dtype, 0), weight.block[0],
           weight.block[1], ptr(scratch), scratch_experts)
    y, h = torch.full((T, d_out), float("nan"), dtype=dtype), torch.full((T, r), float("nan"), dtype=dtype)
    if lib.slmoe_emu_fwd(DTYPES[dtype], T, E, d_in, d_out, r, s, ptr(x), ptr(lora_x), ptr(dense), ptr(a), ptr(b),
                         ptr(c), ptr(y), ptr(h), ptr(ws), *fmt):
        raise CheckFailed(f"{name}: {'packed' if packed else 'dense'} forward launch error")
    dx = torch.full((T, d_in), float("nan"), dtype=dtype)
    da = torch.full(a.shape, float("nan"), dtype=dtype)
    db = torch.full(b.shape, float("nan"), dtype=dtype)
    dh = torch.full((T, r), float("nan"), dtype=dtype)
    if lib.slmoe_emu_bwd(DTYPES[dtype], T, E, d_in, d_out, r, s, ptr(gy), ptr(lora_x if lora_x is not None else x),
                         ptr(dense), ptr(a), ptr(b), ptr(h), ptr(mask), ptr(c), ptr(dx), ptr(da), ptr(db), ptr(dh),
                         ptr(ws), *fmt):
        raise CheckFailed(f"{name}: {'packed' if packed else 'dense'} backward launch error")
    return y, h, dx, da, db


def reference(weight, dtype, inputs, counts):
    """float64 y, dx, dA, dB of ops.lora_grouped_linear_reference on the decoded weight."""
    x, _, mask, a, b, gy, s = inputs
    x64, a64, b64 = (t.double().requires_grad_() for t in (x, a, b))
    y = lora_grouped_linear_reference(x64, weight.decode(dtype).double(), a64, b64, torch.tensor(counts), s,
                                      None if mask is None else mask.double())
    y.backward(gy.double())
    return y.detach(), x64.grad, a64.grad, b64.grad


def rel_err(got, want):
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-300))


def check_case(lib, case, oracle=True):
    """Checks 2 and 3 of the module doc (check 1 is check_decode)."""
    name, weight, dtype, counts, r, chunks, dropout = (case[k] for k in
                                                       ("name", "weight", "dtype", "counts", "r", "chunks", "dropout"))
    E, d_out, d_in = weight.shape
    g = torch.Generator().manual_seed(7)
    T = sum(counts)

    def rand(*shape, fan_in=1):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) / fan_in**0.5).to(dtype)

    x, a, b, gy = rand(T, d_in), rand(E, r, d_in, fan_in=d_in), rand(E, d_out, r, fan_in=r), rand(T, d_out)
    mask = lora_x = None
    if dropout:
        mask = (torch.rand(T, d_in, generator=g) < 0.7).to(dtype) / 0.7
        lora_x = x * mask
    inputs = (x, lora_x, mask, a, b, gy, 2.0)
    dense = run(lib, name, weight, dtype, inputs, counts, E, packed=False)
    for chunk in chunks:
        got = run(lib, name, weight, dtype, inputs, counts, chunk, packed=True)
        for what, p, d in zip(("y", "h", "dx", "dA", "dB"), got, dense):
            if not torch.equal(bits(p), bits(d)):
                raise CheckFailed(f"{name} (chunks of {chunk}): packed {what} differs from the dense launcher's "
                                  f"on the decoded weight (max |diff| {float((p.double() - d.double()).abs().max())})")
    if oracle:
        y_ref, dx_ref, da_ref, db_ref = reference(weight, dtype, inputs, counts)
        y, _, dx, da, db = dense
        for what, got_, want in (("y", y, y_ref), ("dx", dx, dx_ref), ("dA", da, da_ref), ("dB", db, db_ref)):
            err = rel_err(got_, want)
            if not err <= TOLERANCE[dtype]:
                raise CheckFailed(f"{name}: {what} rel. error {err:.2e} vs the float64 reference "
                                  f"(tolerance {TOLERANCE[dtype]:.0e})")
        empty = [e for e, n in enumerate(counts) if n == 0]
        if any(bool((t[empty] != 0).any()) for t in (da, db)):
            raise CheckFailed(f"{name}: experts without rows got non-zero dA/dB")


def cases():
    g = torch.Generator().manual_seed(41)
    uneven = [0, 5, 0, 7, 3, 0]
    out = []
    for dtype in (torch.bfloat16, torch.float16):
        tag = "bf16" if dtype == torch.bfloat16 else "fp16"
        out += [
            dict(name=f"mxfp4_{tag}", weight=random_weight(qw.MXFP4, 6, 40, 64, g), counts=uneven),
            dict(name=f"int4_g32_bf16scale_{tag}", weight=random_weight(qw.INT4, 6, 40, 64, g), counts=uneven),
            dict(name=f"fp8_16x32_{tag}", weight=random_weight(qw.BLOCK_FP8, 6, 40, 72, g), counts=uneven),
        ]
        for c in out[-3:]:
            c["dtype"] = dtype
    out += [
        dict(name="int4_g64_fp16scale_fp16", weight=random_weight(qw.INT4, 3, 24, 128, g, group=64,
                                                                  scale_dtype=torch.float16),
             dtype=torch.float16, counts=[4, 0, 9]),
        dict(name="int4_g128_fp32scale_bf16", weight=random_weight(qw.INT4, 3, 24, 128, g, group=128,
                                                                   scale_dtype=torch.float32),
             dtype=torch.bfloat16, counts=[4, 6, 0]),
        dict(name="fp8_8x8_dropout_bf16", weight=random_weight(qw.BLOCK_FP8, 4, 20, 30, g, block=(8, 8)),
             dtype=torch.bfloat16, counts=[3, 0, 6, 2], dropout=True, chunks=[2, 3]),
        dict(name="mxfp4_130_rows_bf16", weight=random_weight(qw.MXFP4, 2, 136, 64, g),
             dtype=torch.bfloat16, counts=[130, 1]),
        dict(name="int4_no_rows_bf16", weight=random_weight(qw.INT4, 3, 24, 64, g),
             dtype=torch.bfloat16, counts=[0, 0, 0]),
    ]
    for c in out:
        c.setdefault("dropout", False)
        c["r"] = 8
        E = c["weight"].shape[0]
        c.setdefault("chunks", [1, E])  # one expert at a time, and all in one chunk
    return out


def extreme_decode_cases():
    g = torch.Generator().manual_seed(5)
    return [(f"{fmt}_extremes_{tag}", random_weight(fmt, 2, 16, 256, g, extreme=True), dtype)
            for fmt in (qw.MXFP4, qw.BLOCK_FP8)
            for tag, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16))]


def main(argv):
    if len(argv) < 2 or argv[1].startswith("-"):
        print(__doc__.strip().splitlines()[0])
        print("usage: packed_oracle.py LIBRARY [--no-mutants]")
        return 2
    lib = load(argv[1])
    mutants = "--no-mutants" not in argv
    start = time.time()
    all_cases = cases()
    extremes = extreme_decode_cases()
    failures = 0
    for name, weight, dtype in extremes:
        try:
            check_decode(lib, name, weight, dtype)
            print(f"ok   {name} (decode: every scale byte / FP8 code)")
        except CheckFailed as exc:
            failures += 1
            print(f"FAIL {exc}")
    for case in all_cases:
        try:
            check_decode(lib, case["name"], case["weight"], case["dtype"])
            check_case(lib, case)
            print(f"ok   {case['name']} E={case['weight'].shape[0]} counts={case['counts']} "
                  f"chunks={case['chunks']}")
        except CheckFailed as exc:
            failures += 1
            print(f"FAIL {exc}")
    print(f"packed oracle: {len(all_cases) + len(extremes) - failures} of {len(all_cases) + len(extremes)} "
          f"cases passed [{time.time() - start:.0f}s]")
    if failures:
        return 1
    if mutants:
        missed = []
        for n, what in MUTANTS.items():
            lib.slmoe_emu_set_mutation(n)
            why = None
            try:  # every decode first (no GEMM), then the launchers; the first failure ends it
                for case in all_cases:
                    check_decode(lib, case["name"], case["weight"], case["dtype"])
                for case in all_cases:
                    check_case(lib, case, oracle=False)
            except CheckFailed as exc:
                why = str(exc)
            if why is None:
                missed.append(n)
                print(f"mutant {n:2d} NOT caught: {what}")
            else:
                print(f"mutant {n:2d} caught: {what}\n           by: {why[:150]}")
        lib.slmoe_emu_set_mutation(0)
        print(f"packed injected bugs caught: {len(MUTANTS) - len(missed)} of {len(MUTANTS)} "
              f"[{time.time() - start:.0f}s]")
        if missed:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
