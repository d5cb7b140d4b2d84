"""Quantised weight formats of Hugging Face checkpoints: decode (bit for bit) and encode.

Three formats, spelled as the checkpoints spell them:

``mxfp4-pack-quantized`` (compressed-tensors; Kimi K3's routed experts)
    ``weight_packed`` uint8 [out, in/2]: byte c of a row holds element 2c in its low nibble and 2c+1
    in its high nibble; a nibble is an E2M1 code, bit 3 the sign, bits 0-2 index
    {0, .5, 1, 1.5, 2, 3, 4, 6}. ``weight_scale`` uint8 [out, in/32]: one E8M0 byte s per 32
    inputs, the factor 2^(s-127) (255 is NaN in the OCP MX spec and is refused).
``pack-quantized`` (compressed-tensors, 4-bit symmetric int, group strategy; Kimi-K2.5/K2.6)
    ``weight_packed`` int32 [out, in/8]: element i of a row sits in word i//8 at bits 4*(i%8),
    stored as q+8 (q in [-8, 7]); ``weight_scale`` [out, in/group] in the checkpoint's float
    dtype (bf16); ``weight_shape`` [out, in]. The weight is ``q.to(scale.dtype) * scale``, in the
    scale's dtype, as compressed-tensors computes it (so bf16-rounded for bf16 scales).
``block-fp8`` (DeepSeek-V3, Kimi-K2: ``quant_method "fp8"``, ``weight_block_size``)
    ``weight`` float8_e4m3fn [out, in] and ``weight_scale_inv`` float32 [ceil(out/br), ceil(in/bc)],
    one factor per block (edge blocks may be partial); the weight is ``fp8.float() * factor``.

Decoding is exact: MXFP4 products are powers of two times E2M1 values (exact in fp32, and in bf16
inside its range), INT4 is computed in the scale's dtype as the checkpoint's library does, block FP8
in fp32 as the checkpoint reader (``hf.checkpoint``) has always done; the result is then cast to the
dtype asked for. :class:`PackedWeight` is the typed value: packed tensor, scales, format, logical
shape; it can be cut by experts, rows and columns at block boundaries without decoding anything.

Encoding reproduces the libraries' compression: INT4 as compressed-tensors' observer and compressor
(scale = amax/7.5 in the weight's dtype, round half to even, clamp to [-8, 7]); MXFP4 with the E2M1
value rounded half to even and the shared exponent by one of two rules (:data:`MXFP4_SCALE_RULES`):
``"ocp"`` the OCP MX spec's floor(log2(amax)) - 2, which gives back the scales of a checkpoint
made that way (decode then encode is the identity on such bytes), and ``"compressed-tensors"``,
which first rounds amax up to the next power of two when its significand is >= 1.75 (fewer
clipped values; what llm-compressor writes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from megatron_slmoe.utils.errors import InputError

MXFP4 = "mxfp4-pack-quantized"
INT4 = "pack-quantized"
BLOCK_FP8 = "block-fp8"
FORMATS = (MXFP4, INT4, BLOCK_FP8)

MXFP4_GROUP = 32
MXFP4_SCALE_RULES = ("ocp", "compressed-tensors")
E8M0_NAN = 255
INT4_GROUP_SIZES = (32, 64, 128)  # what the kernels are built and tested for (Kimi-K2.5: 32)
FP8_MAX = 448.0  # largest float8_e4m3fn

# E2M1 code -> value; codes 8..15 are the negatives (8 is -0.0).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = _E2M1 + tuple(-v for v in _E2M1)
# E8M0 byte -> 2^(s-127), exact in fp32 (s = 0 is the subnormal 2^-127); 255 would be NaN.
_E8M0_FACTORS = tuple(math.ldexp(1.0, s - 127) for s in range(255)) + (math.nan,)


DECODE_CHUNK_VALUES = 1 << 18
"""Values one step of :meth:`PackedWeight.decode_into` decodes (whole scale-block rows, at least
one block of rows)."""
_DECODE_BYTES_PER_VALUE = 24
"""An upper bound of the bytes per value a decode's intermediates hold at their peak, over the
formats (MXFP4: int64 table indices, fp32 values and products, the cast), held to the measured
peak by tests/unit/test_packed_decode_scratch.py."""


def decode_step_rows(rows: int, cols: int, block_rows: int = 1) -> int:
    """Rows one step of :meth:`PackedWeight.decode_into` decodes: whole scale blocks of
    ``block_rows`` rows, about :data:`DECODE_CHUNK_VALUES` values, at most the weight's ``rows``."""
    return min(rows, max(block_rows, DECODE_CHUNK_VALUES // cols // block_rows * block_rows))


def decode_chunk_bytes(rows: int, cols: int, block_rows: int = 1) -> int:
    """Bytes one step of :meth:`PackedWeight.decode_into` holds besides the tile, for a weight
    [rows, cols] whose scale blocks span ``block_rows`` rows."""
    return decode_step_rows(rows, cols, block_rows) * cols * _DECODE_BYTES_PER_VALUE


class QuantizedWeightError(InputError, ValueError):
    """A packed weight that cannot be decoded as its format says; the message is one line."""


def _table(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


# --- decode --------------------------------------------------------------------------------------


def decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
                 ) -> torch.Tensor:
    """[..., out, in] from uint8 ``packed`` [..., out, in/2] and E8M0 ``scale`` [..., out, in/32]."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    values = _table(E2M1_VALUES, packed.device)[codes]
    factors = _table(_E8M0_FACTORS, packed.device)[scale.long()]
    weight = values.unflatten(-1, (-1, MXFP4_GROUP)) * factors.unsqueeze(-1)
    return weight.flatten(-2).to(dtype)


def int4_codes(packed: torch.Tensor) -> torch.Tensor:
    """q in [-8, 7] (int8) [..., out, 8*words] from compressed-tensors' int32 words [..., out, words]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift, then masked: sign-safe
    return (nibbles.flatten(-2) - 8).to(torch.int8)


def decode_int4(packed: torch.Tensor, scale: torch.Tensor, group_size: int,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """[..., out, in] from int32 ``packed`` [..., out, in/8] and ``scale`` [..., out, in/group],
    computed in the scale's dtype (compressed-tensors' ``q.to(scale.dtype) * scale``), then cast."""
    q = int4_codes(packed).unflatten(-1, (-1, group_size))
    weight = (q.to(scale.dtype) * scale.unsqueeze(-1)).flatten(-2)
    return weight if dtype is None else weight.to(dtype)


def dequantize_block_fp8(values: torch.Tensor, scales: torch.Tensor, rows: slice, cols: slice,
                         block: tuple[int, int]) -> torch.Tensor:
    """fp32 of the block ``[rows, cols]`` of a block-scaled FP8 weight.

    ``values`` is that block (FP8), ``scales`` the rows ``rows.start // block[0]`` ... and columns
    ``cols.start // block[1]`` ... of the weight's ``scale_inv`` table (one fp32 factor per
    ``block`` of the weight; edge blocks may be partial). The one rule for block FP8: the
    checkpoint reader dequantises slices with it, :func:`decode_block_fp8` whole weights.
    """
    r0, c0 = rows.start % block[0], cols.start % block[1]
    factors = scales.float().repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)
    factors = factors[..., r0:r0 + values.shape[-2], c0:c0 + values.shape[-1]]
    return values.float() * factors


def decode_block_fp8(values: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., out, in] of FP8 ``values`` with fp32 ``scales`` [..., ceil(out/br), ceil(in/bc)]."""
    rows, cols = values.shape[-2:]
    return dequantize_block_fp8(values, scales, slice(0, rows), slice(0, cols), block).to(dtype)


# --- encode --------------------------------------------------------------------------------------


def _group_amax(weight: torch.Tensor, group: int) -> torch.Tensor:
    return weight.unflatten(-1, (-1, group)).abs().amax(-1)


def mxfp4_scale_bytes(weight: torch.Tensor, rule: str = "ocp") -> torch.Tensor:
    """E8M0 bytes [..., out, in/32] for ``weight`` [..., out, in] by ``rule`` (module doc)."""
    if rule not in MXFP4_SCALE_RULES:
        raise QuantizedWeightError(f"MXFP4 scale rule must be one of {', '.join(MXFP4_SCALE_RULES)}, "
                                   f"got {rule!r}")
    amax = _group_amax(weight, MXFP4_GROUP).double()  # exact: every float dtype fits a double
    significand, exponent = torch.frexp(amax)  # amax = significand * 2^exponent, significand in [.5, 1)
    floor_log2 = exponent - 1
    if rule == "compressed-tensors":  # its round_to_power_2: up when the significand is >= 1.75
        floor_log2 = floor_log2 + (significand >= 0.875).to(floor_log2.dtype)
    biased = torch.where(amax > 0, floor_log2 - 2 + 127, torch.zeros_like(floor_log2))
    return biased.clamp(0, E8M0_NAN - 1).to(torch.uint8)


def _round_e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of ``scaled`` (already divided by its scale): clamped to +-6, rounded to the
    nearest value with ties to the even code; the sign bit set for values below zero (a negative
    value that rounds to zero is -0.0, code 8; -0.0 itself is code 0), as compressed-tensors
    packs them."""
    magnitude = scaled.abs().clamp(max=6.0)
    code = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for bound in (0.25, 1.25, 2.5, 5.0):  # ties round down to the even code
        code += (magnitude > bound).to(torch.uint8)
    for bound in (0.75, 1.75, 3.5):  # ties round up to the even code
        code += (magnitude >= bound).to(torch.uint8)
    return code | ((scaled < 0).to(torch.uint8) << 3)


def encode_mxfp4(weight: torch.Tensor, scale: torch.Tensor | None = None, rule: str = "ocp"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [..., out, in/2], scale uint8 [..., out, in/32]) of float ``weight``;
    ``scale`` (E8M0 bytes) when given is used as is, else made by ``rule``."""
    _check_encodable(weight, MXFP4_GROUP, MXFP4)
    if scale is None:
        scale = mxfp4_scale_bytes(weight, rule)
    _check_e8m0(scale, f"{MXFP4} scale")
    # Divided in the weight's dtype, as compressed-tensors does: exact for powers of two in range.
    factors = _table(_E8M0_FACTORS, weight.device)[scale.long()].to(weight.dtype)
    scaled = weight.unflatten(-1, (-1, MXFP4_GROUP)) / factors.unsqueeze(-1)
    codes = _round_e2m1_codes(scaled.flatten(-2))
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scale


def encode_int4(weight: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed int32 [..., out, in/8], scale [..., out, in/group] in the weight's dtype) of float
    ``weight``, as compressed-tensors' observer and ``pack-quantized`` compressor make them."""
    _check_group_size(group_size)
    _check_encodable(weight, group_size, INT4)
    amax = _group_amax(weight, group_size)
    scale = amax / torch.tensor(7.5, dtype=weight.dtype)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(weight.dtype).eps, dtype=weight.dtype),
                        scale)
    scaled = weight.unflatten(-1, (-1, group_size)) / scale.unsqueeze(-1)
    q = torch.round(scaled.clamp(-8, 7)).flatten(-2).to(torch.int32) + 8
    q = q.unflatten(-1, (-1, 8)) << torch.arange(0, 32, 4, dtype=torch.int32, device=weight.device)
    words = q.sum(-1, dtype=torch.int64)  # the nibbles do not overlap: the sum is their OR
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32), scale


def encode_block_fp8(weight: torch.Tensor, block: tuple[int, int] = (128, 128)
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [..., out, in], fp32 scale_inv [..., ceil(out/br), ceil(in/bc)]): each
    block's factor is its amax / 448 (fp32), so its largest value maps to FP8's largest."""
    if weight.dim() < 2 or not weight.is_floating_point():
        raise QuantizedWeightError(f"{BLOCK_FP8}: can only encode a float weight [..., out, in], got "
                                   f"{weight.dtype} {list(weight.shape)}")
    rows, cols = weight.shape[-2:]
    br, bc = block
    padded = torch.nn.functional.pad(weight.float(), (0, -cols % bc, 0, -rows % br))
    blocks = padded.unflatten(-1, (-1, bc)).unflatten(-3, (-1, br))  # [..., R, br, C, bc]
    amax = blocks.abs().amax(dim=(-3, -1))
    # A block of zeros gets fp32 eps, as compressed-tensors gives a zero scale.
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.full_like(amax, torch.finfo(torch.float32).eps))
    factors = scale.repeat_interleave(br, -2).repeat_interleave(bc, -1)[..., :rows, :cols]
    values = (weight.float() / factors).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values, scale


def _check_encodable(weight: torch.Tensor, group: int, fmt: str) -> None:
    if weight.dim() < 2 or not weight.is_floating_point():
        raise QuantizedWeightError(f"{fmt}: can only encode a float weight [..., out, in], got "
                                   f"{weight.dtype} {list(weight.shape)}")
    if weight.shape[-1] % group:
        raise QuantizedWeightError(f"{fmt}: the input width {weight.shape[-1]} is not a multiple of "
                                   f"the group size {group}")
    if not torch.isfinite(weight).all():
        raise QuantizedWeightError(f"{fmt}: the weight to encode has NaN or inf values")


def _check_group_size(group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise QuantizedWeightError(f"{INT4}: group size {group_size} is not supported (supported: "
                                   f"{', '.join(map(str, INT4_GROUP_SIZES))})")


def _check_e8m0(scale: torch.Tensor, what: str) -> None:
    if scale.dtype != torch.uint8:
        raise QuantizedWeightError(f"{what}: E8M0 scales must be uint8, got {scale.dtype}")
    if (scale == E8M0_NAN).any():
        raise QuantizedWeightError(f"{what}: has the NaN scale byte 255 at "
                                   f"{_first_index(scale == E8M0_NAN)}")


def _first_index(mask: torch.Tensor) -> list[int]:
    return [int(i) for i in mask.nonzero()[0].tolist()]


# --- the typed value -----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A weight kept in its checkpoint's quantised format: [*lead, out, in] logically.

    ``packed`` and ``scale`` have the same leading dims (e.g. experts); ``matrix_shape`` is (out,
    in) of one matrix, ``shape`` the whole logical shape, as a dense weight's; ``block`` the (rows, cols) one scale covers: (1, 32) for MXFP4, (1, group) for INT4,
    (br, bc) for block FP8. Construction checks dtypes, shapes and the scales' values (NaN, inf,
    the E8M0 NaN byte), each failure one :class:`QuantizedWeightError` line; ``name`` names the
    weight in them.
    """

    format: str
    packed: torch.Tensor
    scale: torch.Tensor
    matrix_shape: tuple[int, int]
    block: tuple[int, int]
    name: str = "weight"

    def __post_init__(self) -> None:
        object.__setattr__(self, "matrix_shape", tuple(int(n) for n in self.matrix_shape))
        object.__setattr__(self, "block", tuple(int(n) for n in self.block))
        self._check_layout()
        self._check_scale_values()

    # construction ---------------------------------------------------------------------------

    @classmethod
    def from_state_dict(cls, tensors: Mapping[str, torch.Tensor], format: str, *,
                        group_size: int | None = None, block: tuple[int, int] | None = None,
                        name: str = "weight") -> "PackedWeight":
        """One module's checkpoint tensors by local name: ``weight_packed`` + ``weight_scale``
        (MXFP4; INT4 also ``weight_shape`` and ``group_size``), or ``weight`` +
        ``weight_scale_inv`` (block FP8, with ``block``)."""
        if format not in FORMATS:
            raise QuantizedWeightError(f"{name}: unknown quantised format {format!r} (known: "
                                       f"{', '.join(FORMATS)})")
        need = {MXFP4: ("weight_packed", "weight_scale"),
                INT4: ("weight_packed", "weight_scale", "weight_shape"),
                BLOCK_FP8: ("weight", "weight_scale_inv")}[format]
        missing = [key for key in need if key not in tensors]
        if missing:
            raise QuantizedWeightError(f"{name}: {format} needs {', '.join(need)}; missing "
                                       f"{', '.join(missing)}")
        if format == MXFP4:
            packed, scale = tensors["weight_packed"], tensors["weight_scale"]
            if packed.dim() >= 2 and scale.dim() >= 2 and (
                    2 * packed.shape[-1] != MXFP4_GROUP * scale.shape[-1]
                    or packed.shape[:-1] != scale.shape[:-1]):
                raise QuantizedWeightError(
                    f"{name}: {MXFP4}: weight_packed {list(packed.shape)} and weight_scale "
                    f"{list(scale.shape)} disagree (2 inputs a byte, 32 a scale): one is truncated "
                    f"or of another layout")
            shape = tuple(packed.shape[-2:-1]) + tuple(2 * n for n in packed.shape[-1:])
            return cls(MXFP4, packed, scale, shape, (1, MXFP4_GROUP), name)
        if format == INT4:
            if group_size is None:
                raise QuantizedWeightError(f"{name}: {INT4} needs its group_size")
            logical = tensors["weight_shape"].flatten().tolist()
            if len(logical) != 2:
                raise QuantizedWeightError(f"{name}: weight_shape must be [out, in], got {logical}")
            return cls(INT4, tensors["weight_packed"], tensors["weight_scale"], tuple(logical),
                       (1, group_size), name)
        if block is None:
            raise QuantizedWeightError(f"{name}: {BLOCK_FP8} needs its weight_block_size")
        values = tensors["weight"]
        return cls(BLOCK_FP8, values, tensors["weight_scale_inv"], tuple(values.shape[-2:]),
                   tuple(block), name)

    @classmethod
    def encode(cls, weight: torch.Tensor, format: str, *, group_size: int = 32,
               block: tuple[int, int] = (128, 128), scale_rule: str = "ocp",
               name: str = "weight") -> "PackedWeight":
        """``weight`` [..., out, in] (float) in ``format``; see the module doc for the rules."""
        shape = tuple(weight.shape[-2:])
        if format == MXFP4:
            packed, scale = encode_mxfp4(weight, rule=scale_rule)
            return cls(MXFP4, packed, scale, shape, (1, MXFP4_GROUP), name)
        if format == INT4:
            packed, scale = encode_int4(weight, group_size)
            return cls(INT4, packed, scale, shape, (1, group_size), name)
        if format == BLOCK_FP8:
            values, scale = encode_block_fp8(weight, block)
            return cls(BLOCK_FP8, values, scale, shape, tuple(block), name)
        raise QuantizedWeightError(f"{name}: unknown quantised format {format!r} (known: "
                                   f"{', '.join(FORMATS)})")

    @classmethod
    def stack(cls, weights: Sequence["PackedWeight"], name: str | None = None) -> "PackedWeight":
        """One [len(weights), *lead, out, in] weight of equal-format, equal-shape weights (the
        experts of a layer)."""
        if not weights:
            raise QuantizedWeightError("cannot stack no packed weights")
        first = weights[0]
        for w in weights[1:]:
            if (w.format, w.matrix_shape, w.block, w.lead_shape) != (
                    first.format, first.matrix_shape, first.block, first.lead_shape):
                raise QuantizedWeightError(
                    f"{w.name}: cannot stack {w.format} {list(w.logical_shape)} blocks "
                    f"{list(w.block)} with {first.name}'s {first.format} "
                    f"{list(first.logical_shape)} blocks {list(first.block)}")
        return cls._checked(first.format, torch.stack([w.packed for w in weights]),
                            torch.stack([w.scale for w in weights]), first.matrix_shape, first.block,
                            name or first.name)

    @classmethod
    def _checked(cls, format, packed, scale, shape, block, name) -> "PackedWeight":
        """A view of an already checked weight: skips the checks (they would scan the scales)."""
        value = object.__new__(cls)
        for key, item in (("format", format), ("packed", packed), ("scale", scale),
                          ("matrix_shape", tuple(shape)), ("block", tuple(block)), ("name", name)):
            object.__setattr__(value, key, item)
        return value

    # checks -----------------------------------------------------------------------------------

    def _fail(self, what: str) -> None:
        raise QuantizedWeightError(f"{self.name}: {self.format}: {what}")

    def _check_layout(self) -> None:
        if self.format not in FORMATS:
            raise QuantizedWeightError(f"{self.name}: unknown quantised format {self.format!r} "
                                       f"(known: {', '.join(FORMATS)})")
        if not isinstance(self.packed, torch.Tensor) or not isinstance(self.scale, torch.Tensor):
            self._fail("packed weight and scale must be tensors")
        if self.packed.dim() < 2:
            self._fail(f"packed weight must be at least 2-D, got {list(self.packed.shape)}")
        if len(self.matrix_shape) != 2 or min(self.matrix_shape) <= 0:
            self._fail(f"matrix shape must be (out, in) > 0, got {list(self.matrix_shape)}")
        if self.packed.device != self.scale.device:
            self._fail(f"packed weight is on {self.packed.device} but its scale on "
                       f"{self.scale.device}")
        out, cols = self.matrix_shape
        br, bc = self.block
        if self.format == MXFP4:
            dtypes, per_row = (torch.uint8, torch.uint8), 2
            if self.block != (1, MXFP4_GROUP):
                self._fail(f"blocks are (1, 32), got {list(self.block)}")
        elif self.format == INT4:
            dtypes, per_row = (torch.int32, None), 8
            _check_group_size(bc)
            if br != 1:
                self._fail(f"groups are one row high, got blocks {list(self.block)}")
            if not self.scale.is_floating_point():
                self._fail(f"scale must be a float tensor, got {self.scale.dtype}")
        else:
            dtypes, per_row = (torch.float8_e4m3fn, torch.float32), 1
            if br <= 0 or bc <= 0:
                self._fail(f"weight_block_size must be positive, got {list(self.block)}")
        if self.packed.dtype != dtypes[0]:
            self._fail(f"packed weight must be {dtypes[0]}, got {self.packed.dtype}")
        if dtypes[1] is not None and self.scale.dtype != dtypes[1]:
            self._fail(f"scale must be {dtypes[1]}, got {self.scale.dtype}")
        if cols % per_row or (self.format != BLOCK_FP8 and cols % bc):
            self._fail(f"input width {cols} is not a multiple of the group size {bc}")
        want_packed = (*self.lead_shape, out, cols // per_row)
        if tuple(self.packed.shape) != want_packed:
            self._fail(f"packed weight of logical shape {list(self.logical_shape)} must have shape "
                       f"{list(want_packed)}, got {list(self.packed.shape)} (truncated or another "
                       f"layout)")
        want_scale = (*self.lead_shape, math.ceil(out / br), math.ceil(cols / bc))
        if tuple(self.scale.shape) != want_scale:
            self._fail(f"scale of a {list(self.logical_shape)} weight in blocks of "
                       f"{list(self.block)} must have shape {list(want_scale)}, got "
                       f"{list(self.scale.shape)}")

    def _check_scale_values(self) -> None:
        if self.format == MXFP4:
            bad = self.scale == E8M0_NAN
            if bad.any():
                self._fail(f"scale has the NaN byte 255 at {_first_index(bad)}")
        else:
            bad = ~torch.isfinite(self.scale)
            if bad.any():
                self._fail(f"scale is NaN or inf at {_first_index(bad)}")

    # shape and bytes --------------------------------------------------------------------------

    @property
    def lead_shape(self) -> tuple[int, ...]:
        return tuple(self.packed.shape[:-2])

    @property
    def logical_shape(self) -> torch.Size:
        return torch.Size((*self.lead_shape, *self.matrix_shape))

    @property
    def shape(self) -> torch.Size:
        """The logical shape [*lead, out, in], as a dense weight's ``shape``."""
        return self.logical_shape

    def dim(self) -> int:
        return len(self.logical_shape)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        """Bytes resident: packed values plus scales."""
        return (self.packed.numel() * self.packed.element_size()
                + self.scale.numel() * self.scale.element_size())

    def to(self, device) -> "PackedWeight":
        return self._checked(self.format, self.packed.to(device), self.scale.to(device),
                             self.matrix_shape, self.block, self.name)

    # cutting ----------------------------------------------------------------------------------

    def __getitem__(self, index: int) -> "PackedWeight":
        """The weight at ``index`` of the first leading dim (an expert)."""
        if not self.lead_shape:
            raise QuantizedWeightError(f"{self.name}: a single [out, in] weight has no experts to "
                                       f"index")
        return self._checked(self.format, self.packed[index], self.scale[index],
                             self.matrix_shape, self.block, self.name)

    def narrow(self, dim: int, start: int, length: int) -> "PackedWeight":
        """Rows ``start:start+length`` of logical dim ``dim`` (a leading dim, out or in), without
        decoding. Rows and columns are cut at scale-block boundaries (the last block may be cut at
        the end); anything else would split a scale and is refused."""
        ndim = self.dim()
        d = dim + ndim if dim < 0 else dim
        if not 0 <= d < ndim:
            raise QuantizedWeightError(f"{self.name}: dim {dim} out of range for "
                                       f"{list(self.logical_shape)}")
        size = self.logical_shape[d]
        if start < 0 or length < 0 or start + length > size:
            raise QuantizedWeightError(f"{self.name}: rows {start}:{start + length} of dim {dim} "
                                       f"are outside {list(self.logical_shape)}")
        lead = len(self.lead_shape)
        if d < lead:
            return self._checked(self.format, self.packed.narrow(d, start, length),
                                 self.scale.narrow(d, start, length), self.matrix_shape,
                                 self.block, self.name)
        axis = d - lead  # 0: out, 1: in
        unit = self.block[axis]
        stop = start + length
        if start % unit or (stop % unit and stop != size):
            raise QuantizedWeightError(
                f"{self.name}: {self.format}: cannot cut {'rows' if axis == 0 else 'columns'} "
                f"{start}:{stop} inside its scale blocks of {unit}")
        per = 1 if axis == 0 else {MXFP4: 2, INT4: 8, BLOCK_FP8: 1}[self.format]
        packed = self.packed.narrow(d, start // per, length // per)
        scale = self.scale.narrow(d, start // unit, math.ceil(stop / unit) - start // unit)
        out, cols = self.matrix_shape
        shape = (length, cols) if axis == 0 else (out, length)
        return self._checked(self.format, packed, scale, shape, self.block, self.name)

    # decoding ---------------------------------------------------------------------------------

    def decode(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight [*lead, out, in], bit for bit as the checkpoint's library decodes it,
        cast to ``dtype``."""
        if self.format == MXFP4:
            return decode_mxfp4(self.packed, self.scale, dtype)
        if self.format == INT4:
            return decode_int4(self.packed, self.scale, self.block[1], dtype)
        return decode_block_fp8(self.packed, self.scale, self.block, dtype)

    def decode_into(self, out: torch.Tensor) -> torch.Tensor:
        """Decode this single [out, in] weight into the tile ``out`` (its dtype), rows of about
        :data:`DECODE_CHUNK_VALUES` values at a time: the decode's integer and fp32 intermediates
        stay a chunk's, not a tile's (a whole-tile decode holds 7-11 tiles' worth at its peak),
        so a pure-torch caller holds one scratch tile plus :func:`decode_chunk_bytes`."""
        if self.lead_shape or tuple(out.shape) != tuple(self.matrix_shape):
            raise QuantizedWeightError(f"{self.name}: decode_into takes one [out, in] weight and a "
                                       f"tile of its shape, not {list(self.logical_shape)} into "
                                       f"{list(out.shape)}")
        rows, cols = self.matrix_shape
        step = decode_step_rows(rows, cols, self.block[0])
        for start in range(0, rows, step):
            length = min(step, rows - start)
            out[start:start + length] = self.narrow(0, start, length).decode(out.dtype)
        return out

    def __repr__(self) -> str:
        return (f"PackedWeight({self.name}: {self.format} {list(self.logical_shape)}, blocks "
                f"{list(self.block)}, {self.nbytes} bytes on {self.device})")


def bf16_bytes(weight: PackedWeight) -> int:
    """Bytes the same weight takes dequantised to bf16."""
    return math.prod(weight.logical_shape) * 2
