"""The quantised weight codecs (ops.quantized_weights) against the bytes of the libraries that
write these checkpoints: compressed-tensors' own observer (``calculate_qparams``) and compressors
(``MXFP4PackedCompressor``, ``PackedQuantizationCompressor``) make and decompress the MXFP4 and INT4
weights, and its block-strategy FP8 ``quantize``/``dequantize`` the block-FP8 ones. Our decode must
equal their decompression bit for bit and our encode their compression byte for byte."""

import pytest
import torch

pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors import MXFP4PackedCompressor, PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

from megatron_slmoe.ops import quantized_weights as qw  # noqa: E402
from megatron_slmoe.ops.quantized_weights import PackedWeight, QuantizedWeightError  # noqa: E402

MXFP4_SCHEME = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
    num_bits=4, type="float", symmetric=True, strategy="group", group_size=32,
    scale_dtype=torch.uint8, zp_dtype=torch.uint8))


def int4_scheme(group_size=32):  # Kimi-K2.5/K2.6's config_groups weights
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size))


FP8_ARGS = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block",
                            block_structure=[128, 128])


def weight(out=48, cols=256, dtype=torch.bfloat16, seed=0):
    """Rows of magnitudes from 1e-3 to 10, an all-zero group, a -0.0 and small negatives (which
    round to -0.0): the corners of the formats."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, cols, generator=g) * torch.logspace(-3, 1, out).unsqueeze(1)
    w[0, :32] = 0.0
    w[1, 3] = -0.0
    w[2, 32:64] = torch.linspace(-1e-4, 1.0, 32)
    return w.to(dtype)


def ct_qparams(w, scheme):
    groups = w.unflatten(-1, (-1, scheme.weights.group_size))
    return calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)


def ct_mxfp4(w, scale=None):
    """compressed-tensors' MXFP4 state dict of ``w``: its observer's scales unless given."""
    if scale is None:
        scale, _ = ct_qparams(w, MXFP4_SCHEME)
    return MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, MXFP4_SCHEME)


def ct_int4(w, group_size=32):
    scheme = int4_scheme(group_size)
    scale, zero_point = ct_qparams(w, scheme)
    return PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


# --- MXFP4 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_encode_equals_compressed_tensors(dtype):
    w = weight(dtype=dtype)
    ct = ct_mxfp4(w)
    packed, scale = qw.encode_mxfp4(w, rule="compressed-tensors")
    assert torch.equal(scale, ct["weight_scale"])
    assert torch.equal(packed, ct["weight_packed"])
    # The OCP rule chooses other exponents for some groups; given them, their compressor packs
    # the same bytes as ours.
    ocp_packed, ocp_scale = qw.encode_mxfp4(w, rule="ocp")
    assert not torch.equal(ocp_scale, scale)
    factors = torch.tensor(qw._E8M0_FACTORS)[ocp_scale.long()].to(dtype)
    ct = ct_mxfp4(w, factors)
    assert torch.equal(ocp_scale, ct["weight_scale"])
    assert torch.equal(ocp_packed, ct["weight_packed"])


def test_mxfp4_decode_is_bit_exact_for_every_byte_and_scale():
    # Every packed byte under every finite E8M0 scale (0 .. 254).
    packed = torch.arange(256, dtype=torch.uint8).repeat(255, 1)
    scale = torch.arange(255, dtype=torch.uint8).unsqueeze(1).repeat(1, 16)
    want = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale},
                                            MXFP4_SCHEME)["weight"]
    got = PackedWeight.from_state_dict({"weight_packed": packed, "weight_scale": scale},
                                       qw.MXFP4).decode(want.dtype)
    assert torch.equal(bits(got), bits(want))
    # fp32 is exact too: the bf16 values are the fp32 ones.
    assert torch.equal(bits(qw.decode_mxfp4(packed, scale).to(want.dtype)), bits(want))


def test_mxfp4_ocp_rule_gives_back_the_scales_it_made():
    w = weight(dtype=torch.float32)
    packed, scale = qw.encode_mxfp4(w, rule="ocp")
    decoded = qw.decode_mxfp4(packed, scale)
    again_packed, again_scale = qw.encode_mxfp4(decoded, rule="ocp")
    assert torch.equal(again_scale, scale)
    # The same values; only -0.0 codes (8) come back as 0, as compressed-tensors encodes -0.0.
    assert torch.equal(qw.decode_mxfp4(again_packed, again_scale), decoded)
    assert torch.equal(again_packed & 0x77, packed & 0x77)


# --- INT4 pack-quantized ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_encode_and_decode_equal_compressed_tensors(dtype, group_size):
    w = weight(dtype=dtype)
    ct = ct_int4(w, group_size)
    assert set(ct) == {"weight_packed", "weight_scale", "weight_shape"}
    packed, scale = qw.encode_int4(w, group_size)
    assert torch.equal(scale, ct["weight_scale"]) and scale.dtype == dtype
    assert torch.equal(packed, ct["weight_packed"])
    want = PackedQuantizationCompressor.decompress(ct, int4_scheme(group_size))["weight"]
    got = PackedWeight.from_state_dict(ct, qw.INT4, group_size=group_size).decode(want.dtype)
    assert torch.equal(bits(got), bits(want))


def test_int4_codes_follow_compressed_tensors_offset_and_nibble_order():
    # q = -8 .. 7 in order along a row: stored q + 8, element i at bits 4*(i % 8) of word i // 8.
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(2).unsqueeze(0)  # one row of 32
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    words = pack_to_int32(q, 4)
    assert torch.equal(qw.int4_codes(words), q)
    assert words[0, 0].item() == 0x76543210  # q+8 = 0..7, element 0 in the low nibble


# --- block FP8 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(256, 384), (200, 300)], ids=["whole-blocks", "edge-blocks"])
def test_block_fp8_equals_compressed_tensors_block_strategy(shape):
    w = weight(*shape, dtype=torch.float32)
    values, scale = qw.encode_block_fp8(w, (128, 128))
    assert tuple(scale.shape) == tuple(-(-n // 128) for n in shape)
    # compressed-tensors pads to whole blocks; its quantize with our scales gives our bytes ...
    assert torch.equal(bits(quantize(w, scale, None, FP8_ARGS, dtype=torch.float8_e4m3fn).float()),
                       bits(values.float()))
    # ... and its dequantize our decode.
    want = dequantize(values, scale, None, FP8_ARGS, dtype=torch.float32)
    got = PackedWeight.from_state_dict({"weight": values, "weight_scale_inv": scale}, qw.BLOCK_FP8,
                                       block=(128, 128)).decode()
    assert torch.equal(bits(got), bits(want))


def test_block_fp8_slice_rule_is_the_whole_weight_rule():
    # The checkpoint reader dequantises slices; a slice is the same block of the whole decode.
    w = weight(300, 260, dtype=torch.float32)
    values, scale = qw.encode_block_fp8(w, (128, 128))
    whole = qw.decode_block_fp8(values, scale, (128, 128))
    rows, cols = slice(130, 290), slice(100, 257)
    part = qw.dequantize_block_fp8(values[rows, cols], scale[1:3, 0:3], rows, cols, (128, 128))
    assert torch.equal(part, whole[rows, cols])


# --- the typed value -------------------------------------------------------------------------------


def test_packed_weight_stacks_and_cuts_without_decoding():
    experts = [weight(64, 256, seed=e) for e in range(3)]
    for fmt, kw in ((qw.MXFP4, {}), (qw.INT4, {"group_size": 32}), (qw.BLOCK_FP8, {"block": (32, 64)})):
        stacked = PackedWeight.stack([PackedWeight.encode(w, fmt, **kw) for w in experts])
        dense = stacked.decode()
        assert stacked.logical_shape == (3, 64, 256)
        assert torch.equal(stacked[1].decode(), dense[1])
        assert torch.equal(stacked.narrow(0, 1, 2).decode(), dense[1:3])
        assert torch.equal(stacked.narrow(1, 32, 32).decode(), dense[:, 32:64])
        assert torch.equal(stacked.narrow(2, 128, 128).decode(), dense[:, :, 128:])
        assert stacked.nbytes < qw.bf16_bytes(stacked) * (0.6 if fmt == qw.BLOCK_FP8 else 0.3)


def _bad(fmt, **change):
    w = weight(64, 128)
    if fmt == qw.BLOCK_FP8:
        values, scale = qw.encode_block_fp8(w.float(), (128, 128))
        tensors = {"weight": values, "weight_scale_inv": scale}
    elif fmt == qw.MXFP4:
        tensors = ct_mxfp4(w)
    else:
        tensors = ct_int4(w)
    tensors = dict(tensors)
    for key, value in change.items():
        if value is None:
            del tensors[key]
        else:
            tensors[key] = value(tensors[key])
    kw = {qw.INT4: {"group_size": 32}, qw.BLOCK_FP8: {"block": (128, 128)}}.get(fmt, {})
    return lambda: PackedWeight.from_state_dict(tensors, fmt, name="layers.1.experts.3.w1", **kw)


def _set(index, value):
    def change(t):
        t = t.clone()
        t[index] = value
        return t
    return change


BAD = [
    ("truncated in the file", _bad(qw.MXFP4, weight_packed=lambda t: t[:, :-1]),
     r"weight_packed \[64, 63\] and weight_scale \[64, 4\] disagree"),
    ("truncated int4", _bad(qw.INT4, weight_packed=lambda t: t[:, :-1]),
     r"must have shape \[64, 16\], got \[64, 15\]"),
    ("missing scale", _bad(qw.MXFP4, weight_scale=None), r"missing weight_scale$"),
    ("missing scale_inv", _bad(qw.BLOCK_FP8, weight_scale_inv=None), r"missing weight_scale_inv$"),
    ("missing weight_shape", _bad(qw.INT4, weight_shape=None), r"missing weight_shape$"),
    ("NaN E8M0 scale", _bad(qw.MXFP4, weight_scale=_set((5, 2), 255)),
     r"NaN byte 255 at \[5, 2\]"),
    ("NaN int4 scale", _bad(qw.INT4, weight_scale=_set((7, 1), float("nan"))),
     r"NaN or inf at \[7, 1\]"),
    ("inf fp8 scale", _bad(qw.BLOCK_FP8, weight_scale_inv=_set((0, 0), float("inf"))),
     r"NaN or inf at \[0, 0\]"),
    ("scale of the wrong shape", _bad(qw.BLOCK_FP8, weight_scale_inv=lambda t: t.repeat(2, 1)),
     r"scale of a \[64, 128\] weight in blocks of \[128, 128\] must have shape \[1, 1\], got \[2, 1\]"),
    ("mxfp4 scale of the wrong shape", _bad(qw.MXFP4, weight_scale=lambda t: t[:, :2]),
     r"weight_packed \[64, 64\] and weight_scale \[64, 2\] disagree"),
    ("scale of the wrong dtype", _bad(qw.MXFP4, weight_scale=lambda t: t.float()),
     r"scale must be torch.uint8, got torch.float32"),
    ("unknown format", lambda: PackedWeight.from_state_dict({}, "nvfp4-pack-quantized"),
     r"unknown quantised format 'nvfp4-pack-quantized'"),
    ("unsupported group size", lambda: PackedWeight.encode(weight(8, 96), qw.INT4, group_size=48),
     r"group size 48 is not supported"),
]


@pytest.mark.parametrize("make, match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_packed_weights_are_refused_in_one_line(make, match):
    with pytest.raises(QuantizedWeightError, match=match) as info:
        make()
    assert "\n" not in str(info.value)


def test_cuts_inside_a_scale_block_are_refused():
    stacked = PackedWeight.encode(weight(256, 256, dtype=torch.float32), qw.BLOCK_FP8)
    with pytest.raises(QuantizedWeightError, match=r"cannot cut rows 64:192 inside its scale blocks of 128"):
        stacked.narrow(0, 64, 128)
    mx = PackedWeight.encode(weight(8, 128), qw.MXFP4)
    with pytest.raises(QuantizedWeightError, match=r"cannot cut columns 16:48"):
        mx.narrow(1, 16, 32)


def test_memory_figure_of_a_k3_expert_layer():
    # tools/bench/packed_experts.py counts real packed tensors; one K3 expert must take the bytes of
    # the released checkpoint's tensor table (17,547,264: w1, w3, w2 packed + scales), and 4-bit
    # experts at most 0.30 of their BF16 bytes (issue 41's target).
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "bench" / "packed_experts.py"
    spec = importlib.util.spec_from_file_location("packed_experts", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = {r["format"]: r for r in (bench.layer_row(*model, 2) for model in bench.MODELS)}
    k3 = rows[qw.MXFP4]
    assert k3["expert_bytes_packed"] == 17_547_264
    assert k3["layer_bytes_bf16"] == 896 * 3 * 3072 * 3584 * 2
    assert k3["packed_over_bf16"] <= 0.30 and rows[qw.INT4]["packed_over_bf16"] <= 0.30
