"""Grouped LoRA linear over expert-sorted rows, and the LoRA expert MLP built on it.

Rows of ``x_TD`` arrive grouped by expert: expert e owns the next ``tokens_per_expert_E[e]`` rows.
For expert e with rows x_e::

    y_e = x_e W_e^T + s * (x_e A_e^T) B_e^T        s = alpha / r

W [E, d_out, d_in] is frozen; the LoRA factors A [E, r, d_in] and B [E, d_out, r] are trained.
LoRA dropout, when on, multiplies only the LoRA input (the x of the shrink ``x A^T``). Optional
``probs_T`` scale each output row (the router probability of an expert row): ``y_t = p_t (...)``,
applied inside the kernel, with its gradient ``rowsum(x * g)`` from the unscaled input gradient g
the kernel returns.

:func:`lora_grouped_linear` runs the native kernel (``torch.ops.slmoe``) where the extension has one
for the tensors' device, else :func:`lora_grouped_linear_reference`; see ``_native.choose_backend``.

W may also be a :class:`~megatron_slmoe.ops.quantized_weights.PackedWeight` (MXFP4, INT4, block FP8
as the checkpoint stores it): then each expert's W_e is decoded into a scratch tile of x's dtype,
used for the dense GEMM and dropped; backward decodes it again. No dequantised copy of W is ever
kept, by autograd or otherwise (:class:`PackedLoRAGroupedLinear`). Its pure-torch kernels are
:func:`packed_grouped_fwd` / :func:`packed_grouped_bwd`, the twins of the native
``slmoe::lora_grouped_linear_packed_{fwd,bwd}``; the oracle is the dense op on ``W.decode()``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from megatron_slmoe.ops.activations import is_fused_glu
from megatron_slmoe.ops._native import choose_backend, native_extension_error, native_op
from megatron_slmoe.ops.quantized_weights import PackedWeight

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_grouped_inputs(x_TD, weight_EOD, lora_a_ERD, lora_b_EOR, tokens_per_expert_E,
                         probs_T=None) -> None:
    """The checks the native op makes (csrc/lora_expert_checks.h), with the same messages.
    ``weight_EOD`` may be a :class:`PackedWeight` of logical shape [E, d_out, d_in]."""
    name = "lora_grouped_linear"
    if x_TD.dim() != 2:
        raise ValueError(f"{name}: x must be 2-D [T, d_in], got {tuple(x_TD.shape)}")
    if x_TD.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: x must be float32, float64, bfloat16 or float16, got {x_TD.dtype}")
    if weight_EOD.dim() != 3:
        raise ValueError(f"{name}: weight must be 3-D [E, d_out, d_in], got {tuple(weight_EOD.shape)}")
    if lora_a_ERD.dim() != 3:
        raise ValueError(f"{name}: lora_a must be 3-D [E, r, d_in], got {tuple(lora_a_ERD.shape)}")
    for arg, t in (("weight", weight_EOD), ("lora_a", lora_a_ERD), ("lora_b", lora_b_EOR)):
        if isinstance(t, PackedWeight):  # decoded to x's dtype tile by tile
            if t.device != x_TD.device:
                raise ValueError(f"{name}: {arg} is on {t.device} but x is on {x_TD.device}")
            continue
        if t.dtype != x_TD.dtype:
            raise TypeError(f"{name}: {arg} has dtype {t.dtype} but x has {x_TD.dtype}")
        if t.device != x_TD.device:
            raise ValueError(f"{name}: {arg} is on {t.device} but x is on {x_TD.device}")
    T, d_in = x_TD.shape
    E, d_out = weight_EOD.shape[:2]
    r = lora_a_ERD.shape[1]
    for arg, t, want, layout in (
        ("weight", weight_EOD, (E, d_out, d_in), "[E, d_out, d_in]"),
        ("lora_a", lora_a_ERD, (E, r, d_in), "[E, r, d_in]"),
        ("lora_b", lora_b_EOR, (E, d_out, r), "[E, d_out, r]"),
    ):
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: {arg} must have shape {layout} = {list(want)}, got {tuple(t.shape)}")
    if tokens_per_expert_E.device.type != "cpu":
        raise ValueError(f"{name}: tokens_per_expert must be a CPU tensor, got one on {tokens_per_expert_E.device}")
    if tokens_per_expert_E.dtype != torch.int64:
        raise TypeError(f"{name}: tokens_per_expert must be int64, got {tokens_per_expert_E.dtype}")
    if tuple(tokens_per_expert_E.shape) != (E,):
        raise ValueError(f"{name}: tokens_per_expert must have shape [E] = [{E}], got {tuple(tokens_per_expert_E.shape)}")
    if probs_T is not None:
        if probs_T.dtype != x_TD.dtype:
            raise TypeError(f"{name}: probs has dtype {probs_T.dtype} but x has {x_TD.dtype}")
        if probs_T.device != x_TD.device:
            raise ValueError(f"{name}: probs is on {probs_T.device} but x is on {x_TD.device}")
        if tuple(probs_T.shape) != (T,):
            raise ValueError(f"{name}: probs must have shape [T] = [{T}], got {tuple(probs_T.shape)}")
    counts = tokens_per_expert_E.tolist()
    if any(c < 0 for c in counts):
        raise ValueError(f"{name}: tokens_per_expert has a negative count: {counts}")
    if sum(counts) != T:
        raise ValueError(f"{name}: tokens_per_expert sums to {sum(counts)} but x has {T} rows")


def lora_grouped_linear_reference(
    x_TD: torch.Tensor,
    weight_EOD: torch.Tensor,
    lora_a_ERD: torch.Tensor,
    lora_b_EOR: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    scaling: float,
    lora_mask_TD: torch.Tensor | None = None,
    probs_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch grouped LoRA linear: one loop step per expert, differentiable by autograd.

    ``lora_mask_TD`` (already scaled by 1/(1-p)) multiplies the LoRA input, as LoRA dropout does;
    ``probs_T`` scales the output rows.
    """
    check_grouped_inputs(x_TD, weight_EOD, lora_a_ERD, lora_b_EOR, tokens_per_expert_E, probs_T)
    if lora_mask_TD is not None and lora_mask_TD.shape != x_TD.shape:
        raise ValueError(f"lora_grouped_linear: lora_mask must be shaped like x {tuple(x_TD.shape)}, "
                         f"got {tuple(lora_mask_TD.shape)}")
    lora_x_TD = x_TD if lora_mask_TD is None else x_TD * lora_mask_TD
    counts = tokens_per_expert_E.tolist()
    y_parts = []
    for e, (x_nD, lora_x_nD) in enumerate(zip(x_TD.split(counts), lora_x_TD.split(counts))):
        base_nO = x_nD @ weight_EOD[e].T
        lora_nO = (lora_x_nD @ lora_a_ERD[e].T) @ lora_b_EOR[e].T
        y_parts.append(base_nO + scaling * lora_nO)
    if not y_parts:  # no experts at all (then there are no rows either)
        return x_TD.new_empty((0, weight_EOD.shape[1]))
    y_TO = torch.cat(y_parts)
    return y_TO if probs_T is None else y_TO * probs_T.unsqueeze(1)


def _register_fake_kernels() -> None:
    """Shapes of the native ops' outputs from their inputs' (``torch.library.register_fake``), so
    torch.compile and meta tensors trace through the op without running it."""

    @torch.library.register_fake("slmoe::lora_grouped_linear_fwd")
    def _fwd(x, weight, lora_a, lora_b, tokens_per_expert, scaling, lora_x=None, probs=None):
        return x.new_empty(x.shape[0], weight.shape[1]), x.new_empty(x.shape[0], lora_a.shape[1])

    @torch.library.register_fake("slmoe::lora_grouped_linear_bwd")
    def _bwd(grad_y, lora_x, weight, lora_a, lora_b, h, tokens_per_expert, scaling,
             lora_mask=None, output_mask=(True, True, True), probs=None):
        return (lora_x.new_empty(lora_x.shape) if output_mask[0] else None,
                lora_a.new_empty(lora_a.shape) if output_mask[1] else None,
                lora_b.new_empty(lora_b.shape) if output_mask[2] else None)

    if not hasattr(torch.ops.slmoe, "lora_grouped_linear_packed_fwd"):
        return  # an extension built before the packed ops were declared

    @torch.library.register_fake("slmoe::lora_grouped_linear_packed_fwd")
    def _packed_fwd(x, lora_a, lora_b, tokens_per_expert, scaling, lora_x, probs, packed, scale,
                    format, block, matrix_shape):
        return x.new_empty(x.shape[0], matrix_shape[0]), x.new_empty(x.shape[0], lora_a.shape[1])

    @torch.library.register_fake("slmoe::lora_grouped_linear_packed_bwd")
    def _packed_bwd(grad_y, lora_x, lora_a, lora_b, h, tokens_per_expert, scaling, lora_mask,
                    output_mask, probs, packed, scale, format, block, matrix_shape):
        return _bwd(grad_y, lora_x, None, lora_a, lora_b, h, tokens_per_expert, scaling, lora_mask,
                    output_mask, probs)


if native_extension_error() is None:
    _register_fake_kernels()


class LoRAGroupedLinear(torch.autograd.Function):
    """Autograd over the native ``slmoe::lora_grouped_linear_{fwd,bwd}`` ops.

    Returns no gradient for W: it is frozen, and ``backward`` refuses a W that requires grad rather
    than silently dropping its gradient.
    """

    @staticmethod
    def forward(ctx, x_TD, weight_EOD, lora_a_ERD, lora_b_EOR, tokens_per_expert_E, scaling,
                lora_mask_TD=None, probs_T=None):
        lora_x_TD = None if lora_mask_TD is None else x_TD * lora_mask_TD
        y_TO, h_TR = native_op("lora_grouped_linear_fwd")(
            x_TD, weight_EOD, lora_a_ERD, lora_b_EOR, tokens_per_expert_E, float(scaling), lora_x_TD,
            probs_T)
        # Keep x (alive upstream anyway) and the mask rather than x * mask; backward recomputes it.
        ctx.save_for_backward(x_TD, weight_EOD, lora_a_ERD, lora_b_EOR, h_TR, tokens_per_expert_E,
                              lora_mask_TD, probs_T)
        ctx.scaling = float(scaling)
        return y_TO

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y_TO):
        (x_TD, weight_EOD, lora_a_ERD, lora_b_EOR, h_TR, tokens_per_expert_E, lora_mask_TD,
         probs_T) = ctx.saved_tensors
        lora_x_TD = x_TD if lora_mask_TD is None else x_TD * lora_mask_TD
        need = ctx.needs_input_grad
        if need[1]:  # raised here, not in forward: under no_grad a trainable W is harmless
            raise ValueError("lora_grouped_linear: weight must be frozen (requires_grad=False); "
                             "only lora_a and lora_b are trained")
        need_probs = probs_T is not None and need[7]
        g_TD, da_ERD, db_EOR = native_op("lora_grouped_linear_bwd")(
            grad_y_TO, lora_x_TD, weight_EOD, lora_a_ERD, lora_b_EOR, h_TR, tokens_per_expert_E,
            ctx.scaling, lora_mask_TD, [need[0] or need_probs, need[2], need[3]], probs_T,
        )
        if probs_T is None:
            return g_TD, None, da_ERD, db_EOR, None, None, None, None
        # The op returns the input gradient before the row scale (see csrc/bindings.cpp).
        dx_TD = g_TD * probs_T.unsqueeze(1) if need[0] else None
        dprobs_T = (x_TD * g_TD).sum(dim=1) if need_probs else None
        return dx_TD, None, da_ERD, db_EOR, None, None, None, dprobs_T


# --- packed (quantised) frozen weights ------------------------------------------------------------

PACKED_SCRATCH_BYTES = 256 << 20
"""The CUDA packed kernel decodes as many experts at once as fit in this many bytes (at least one):
``kPackedScratchBytes`` of csrc/packed_scratch.h, read back from the extension by
tests/unit/test_plan_packed_scratch.py; the planner prices that scratch (``plan.memory``)."""


def packed_grouped_fwd(x_TD, weight: PackedWeight, lora_a_ERD, lora_b_EOR, counts, scaling,
                       lora_x_TD=None, probs_T=None):
    """(y [T, d_out], h [T, r]) of the grouped LoRA linear over packed W, as the native
    ``lora_grouped_linear_packed_fwd`` returns them: per expert, W_e decoded into the call's one
    scratch tile of x's dtype, the dense GEMM, the LoRA shrink and expand, the row scale."""
    lora_x_TD = x_TD if lora_x_TD is None else lora_x_TD
    y_TO = x_TD.new_empty(x_TD.shape[0], weight.matrix_shape[0])
    h_TR = x_TD.new_empty(x_TD.shape[0], lora_a_ERD.shape[1])
    scratch = x_TD.new_empty(weight.matrix_shape)
    off = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(off, off + n)
        off += n
        w_OD = weight[e].decode_into(scratch)
        torch.mm(lora_x_TD[rows], lora_a_ERD[e].T, out=h_TR[rows])
        torch.mm(x_TD[rows], w_OD.T, out=y_TO[rows])
        y_TO[rows].addmm_(h_TR[rows], lora_b_EOR[e].T, alpha=scaling)
        if probs_T is not None:
            y_TO[rows].mul_(probs_T[rows].unsqueeze(1))
    return y_TO, h_TR


def packed_grouped_bwd(grad_y_TO, lora_x_TD, weight: PackedWeight, lora_a_ERD, lora_b_EOR, h_TR,
                       counts, scaling, lora_mask_TD=None, output_mask=(True, True, True),
                       probs_T=None):
    """(g, dA, dB) as the native ``lora_grouped_linear_packed_bwd`` returns them (g without the row
    scale, see csrc/bindings.cpp); W_e is decoded again, into the call's scratch tile, where g
    needs it."""
    need_dx, need_da, need_db = output_mask
    E, r = lora_a_ERD.shape[:2]
    scratch = grad_y_TO.new_empty(weight.matrix_shape) if need_dx else None
    g_TD = grad_y_TO.new_empty(lora_x_TD.shape) if need_dx else None
    da_ERD = torch.zeros_like(lora_a_ERD) if need_da else None
    db_EOR = torch.zeros_like(lora_b_EOR) if need_db else None
    off = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue  # no rows: the adapter's gradient stays exactly zero
        rows = slice(off, off + n)
        off += n
        dy_nO = grad_y_TO[rows]
        p_n1 = None if probs_T is None else probs_T[rows].unsqueeze(1)
        if need_db:
            h_nR = h_TR[rows] if p_n1 is None else h_TR[rows] * p_n1
            torch.mm(dy_nO.T, h_nR, out=db_EOR[e])
            db_EOR[e].mul_(scaling)
        if not (need_dx or need_da):
            continue
        dh_nR = (dy_nO @ lora_b_EOR[e]).mul_(scaling)
        if need_da:
            torch.mm((dh_nR if p_n1 is None else dh_nR * p_n1).T, lora_x_TD[rows], out=da_ERD[e])
        if need_dx:
            w_OD = weight[e].decode_into(scratch)  # recomputed, never kept from forward
            torch.mm(dy_nO, w_OD, out=g_TD[rows])
            lora_g = dh_nR @ lora_a_ERD[e]
            g_TD[rows] += lora_g if lora_mask_TD is None else lora_g * lora_mask_TD[rows]
    return g_TD, da_ERD, db_EOR


def _native_packed(name: str, weight: PackedWeight):
    """The native packed kernel ``name`` with the weight's layout bound (format, block, shape)."""
    op = native_op(name)

    def call(*args):
        return op(*args, weight.packed, weight.scale, weight.format, list(weight.block),
                  list(weight.matrix_shape))
    return call


class PackedLoRAGroupedLinear(torch.autograd.Function):
    """Autograd of the grouped LoRA linear over a packed frozen W, on the native kernels
    (``native=True``) or their pure-torch twins. Autograd keeps the packed bytes and scales, never a
    dequantised W: backward decodes each expert's tile again."""

    @staticmethod
    def forward(ctx, x_TD, packed, scale, lora_a_ERD, lora_b_EOR, tokens_per_expert_E, scaling,
                lora_mask_TD, probs_T, weight: PackedWeight, native: bool):
        lora_x_TD = None if lora_mask_TD is None else x_TD * lora_mask_TD
        if native:
            y_TO, h_TR = _native_packed("lora_grouped_linear_packed_fwd", weight)(
                x_TD, lora_a_ERD, lora_b_EOR, tokens_per_expert_E, float(scaling), lora_x_TD, probs_T)
        else:
            y_TO, h_TR = packed_grouped_fwd(x_TD, weight, lora_a_ERD, lora_b_EOR,
                                            tokens_per_expert_E.tolist(), float(scaling), lora_x_TD,
                                            probs_T)
        ctx.save_for_backward(x_TD, packed, scale, lora_a_ERD, lora_b_EOR, h_TR, tokens_per_expert_E,
                              lora_mask_TD, probs_T)
        ctx.layout = (weight.format, weight.matrix_shape, weight.block, weight.name)
        ctx.scaling, ctx.native = float(scaling), native
        return y_TO

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y_TO):
        (x_TD, packed, scale, lora_a_ERD, lora_b_EOR, h_TR, tokens_per_expert_E, lora_mask_TD,
         probs_T) = ctx.saved_tensors
        fmt, matrix_shape, block, name = ctx.layout
        weight = PackedWeight._checked(fmt, packed, scale, matrix_shape, block, name)
        lora_x_TD = x_TD if lora_mask_TD is None else x_TD * lora_mask_TD
        need = ctx.needs_input_grad
        need_probs = probs_T is not None and need[8]
        output_mask = [need[0] or need_probs, need[3], need[4]]
        if ctx.native:
            g_TD, da_ERD, db_EOR = _native_packed("lora_grouped_linear_packed_bwd", weight)(
                grad_y_TO.contiguous(), lora_x_TD, lora_a_ERD, lora_b_EOR, h_TR, tokens_per_expert_E,
                ctx.scaling, lora_mask_TD, output_mask, probs_T)
        else:
            g_TD, da_ERD, db_EOR = packed_grouped_bwd(
                grad_y_TO, lora_x_TD, weight, lora_a_ERD, lora_b_EOR, h_TR,
                tokens_per_expert_E.tolist(), ctx.scaling, lora_mask_TD, output_mask, probs_T)
        if probs_T is None:
            dx_TD, dprobs_T = g_TD, None
        else:
            dx_TD = g_TD * probs_T.unsqueeze(1) if need[0] else None
            dprobs_T = (x_TD * g_TD).sum(dim=1) if need_probs else None
        return dx_TD, None, None, da_ERD, db_EOR, None, None, None, dprobs_T, None, None


def lora_dropout_mask(x_TD: torch.Tensor, p: float) -> torch.Tensor:
    """Inverted-dropout mask for the LoRA input: 0 with probability p, else 1/(1-p)."""
    return torch.empty_like(x_TD).bernoulli_(1.0 - p).div_(1.0 - p)


def lora_grouped_linear(
    x_TD: torch.Tensor,
    weight_EOD: torch.Tensor,
    lora_a_ERD: torch.Tensor,
    lora_b_EOR: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    scaling: float,
    dropout: float = 0.0,
    probs_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [T, d_out] of the grouped LoRA linear, on the native kernel where the device has one.

    ``weight_EOD`` is a dense frozen tensor or a :class:`PackedWeight` (kept packed, decoded tile by
    tile). ``dropout`` is the LoRA dropout probability; the caller passes 0 outside training.
    ``probs_T``, when given, scales each output row (cast to x's dtype).
    """
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora_grouped_linear: dropout must be in [0, 1), got {dropout}")
    if isinstance(weight_EOD, PackedWeight):
        return _packed_grouped_linear(x_TD, weight_EOD, lora_a_ERD, lora_b_EOR, tokens_per_expert_E,
                                      scaling, dropout, probs_T)
    if weight_EOD.requires_grad and torch.is_grad_enabled():
        raise ValueError("lora_grouped_linear: weight must be frozen (requires_grad=False); "
                         "only lora_a and lora_b are trained")
    lora_mask_TD = lora_dropout_mask(x_TD, dropout) if dropout > 0 else None
    if probs_T is not None:
        probs_T = probs_T.to(x_TD.dtype)
    if choose_backend("lora_grouped_linear", x_TD.device) == "native":
        return LoRAGroupedLinear.apply(
            x_TD, weight_EOD, lora_a_ERD, lora_b_EOR, tokens_per_expert_E, scaling, lora_mask_TD,
            probs_T
        )
    return lora_grouped_linear_reference(
        x_TD, weight_EOD, lora_a_ERD, lora_b_EOR, tokens_per_expert_E, scaling, lora_mask_TD,
        probs_T
    )


def _packed_grouped_linear(x_TD, weight: PackedWeight, lora_a_ERD, lora_b_EOR, tokens_per_expert_E,
                           scaling, dropout, probs_T):
    check_grouped_inputs(x_TD, weight, lora_a_ERD, lora_b_EOR, tokens_per_expert_E, probs_T)
    lora_mask_TD = lora_dropout_mask(x_TD, dropout) if dropout > 0 else None
    if probs_T is not None:
        probs_T = probs_T.to(x_TD.dtype)
    native = choose_backend("lora_grouped_linear_packed", x_TD.device) == "native"
    return PackedLoRAGroupedLinear.apply(x_TD, weight.packed, weight.scale, lora_a_ERD, lora_b_EOR,
                                         tokens_per_expert_E, scaling, lora_mask_TD, probs_T, weight,
                                         native)


class LoRAGroupedWeights(NamedTuple):
    """One projection of all local experts: frozen weight plus its LoRA factors."""

    weight: torch.Tensor | PackedWeight  # [E, d_out, d_in], frozen (dense, or packed as stored)
    lora_a: torch.Tensor  # [E, r, d_in]
    lora_b: torch.Tensor  # [E, d_out, r]


def expert_activation(h_TH: torch.Tensor, activation_func=F.silu, gated: bool = True) -> torch.Tensor:
    """fc1's output -> fc2's input of an expert MLP: ``act(gate) * up`` for a gated linear unit
    (fc1 rows ``[gate; up]``, gate first as in Megatron's linear_fc1), ``act(h)`` for a non-gated
    one (e.g. squared ReLU: Megatron's ``gated_linear_unit=False`` with ``squared_relu``). A
    fused GLU activation (``ops.activations``, e.g. SiTU-GLU) takes the whole gate|up output."""
    if is_fused_glu(activation_func):
        if not gated:
            raise ValueError(f"activation {activation_func.name} belongs to a gated linear unit "
                             f"(gated_linear_unit)")
        return activation_func(h_TH)
    if not gated:
        return activation_func(h_TH)
    if h_TH.shape[-1] % 2:
        raise ValueError(f"a gated expert's fc1 must output gate|up (an even size), got "
                         f"{h_TH.shape[-1]}")
    gate_TF, up_TF = h_TH.chunk(2, dim=-1)
    return activation_func(gate_TF) * up_TF


def lora_expert_mlp(
    x_TD: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    fc1: LoRAGroupedWeights,
    fc2: LoRAGroupedWeights,
    scaling: float,
    dropout: float = 0.0,
    activation_func=F.silu,
    gated: bool = True,
    probs_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expert MLP on expert-grouped rows, each projection with its own LoRA: SwiGLU by default
    (fc1 maps d -> 2F, gate|up), or non-gated (fc1 maps d -> F) with ``gated=False``; fc2 maps
    F -> d. The activation is :func:`expert_activation`. One grouped op per projection; the
    router probabilities ``probs_T`` are applied by the fc2 op to its output rows (the same as
    scaling the activation, fc2 being linear)."""
    h_TH = lora_grouped_linear(x_TD, *fc1, tokens_per_expert_E, scaling, dropout)
    act_TF = expert_activation(h_TH, activation_func, gated)
    return lora_grouped_linear(act_TF, *fc2, tokens_per_expert_E, scaling, dropout, probs_T)


# --- shared-outer expert LoRA ---------------------------------------------------------------------
#
# One factor of each projection is shared by all experts of the layer (SGLang's
# experts_shared_outer_loras): fc1's A on the input side, fc2's B on the output side; the other
# factor is per expert. For expert e with rows x_e (``groups`` g = 2 for a gated fc1, whose rows
# are gate|up: the gate half pairs with A's first r rows, the up half with the next r)::
#
#     fc1 (shared A [g r, d_in], B [E, d_out, r]):  y_e = x_e W_e^T + s * [h_e,j B_e,j^T]_j,
#                                                    h = x A^T, h_e,j its j-th r columns
#     fc2 (A [E, r, d_in], shared B [d_out, r]):    y_e = x_e W_e^T + s * (x_e A_e^T) B^T
#
# The shared factor is one GEMM over all rows of the layer (h = x A^T; y += s h B^T), never one
# per expert, so its gradient is one GEMM too; the per-expert factors are grouped per expert.


def _scratch_tile(weight, like: torch.Tensor):
    """The one tile a call decodes a packed W's experts into (None for a dense W)."""
    return like.new_empty(weight.matrix_shape) if isinstance(weight, PackedWeight) else None


def _frozen_tile(weight, e: int, scratch) -> torch.Tensor:
    return weight[e] if scratch is None else weight[e].decode_into(scratch)


class FrozenGroupedLinear(torch.autograd.Function):
    """x_e W_e^T per expert with W frozen (dense, or a :class:`PackedWeight` decoded tile by tile);
    backward gives x's gradient only and decodes a packed W_e again, so no tile is kept."""

    @staticmethod
    def forward(ctx, x_TD, weight, counts):
        y_TO = x_TD.new_empty(x_TD.shape[0], weight.shape[1])
        scratch = _scratch_tile(weight, x_TD)
        off = 0
        for e, n in enumerate(counts):
            if n:
                torch.mm(x_TD[off:off + n], _frozen_tile(weight, e, scratch).T,
                         out=y_TO[off:off + n])
            off += n
        ctx.weight, ctx.counts = weight, counts  # frozen: held by its module anyway
        return y_TO

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y_TO):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        dx_TD = grad_y_TO.new_empty(grad_y_TO.shape[0], ctx.weight.shape[2])
        scratch = _scratch_tile(ctx.weight, grad_y_TO)
        off = 0
        for e, n in enumerate(ctx.counts):
            if n:
                torch.mm(grad_y_TO[off:off + n], _frozen_tile(ctx.weight, e, scratch),
                         out=dx_TD[off:off + n])
            off += n
        return dx_TD, None, None


def _per_expert_shrink(x_TD, lora_a_ERD, counts) -> torch.Tensor:
    parts = [x @ lora_a_ERD[e].T for e, x in enumerate(x_TD.split(counts))]
    return torch.cat(parts) if parts else x_TD.new_zeros(0, lora_a_ERD.shape[1])


def _per_expert_expand(h_TG, lora_b_EOR, counts, groups: int) -> torch.Tensor:
    E, d_out, r = lora_b_EOR.shape
    parts = []
    for e, h in enumerate(h_TG.split(counts)):
        # [n, g, r] x [g, d_out/g, r] -> [n, g, d_out/g]: group j of the rows from h's j-th r.
        parts.append(torch.einsum("ngr,gor->ngo", h.view(-1, groups, r),
                                  lora_b_EOR[e].view(groups, d_out // groups, r))
                     .reshape(-1, d_out))
    return torch.cat(parts) if parts else h_TG.new_zeros(0, d_out)


def check_shared_outer_inputs(x_TD, weight_EOD, lora_a, lora_b, tokens_per_expert_E,
                              groups: int) -> None:
    """One line for factors that do not fit W [E, d_out, d_in] in either shared-outer side."""
    name = "shared_outer_grouped_linear"
    E, d_out, d_in = weight_EOD.shape
    if x_TD.dim() != 2 or x_TD.shape[1] != d_in:
        raise ValueError(f"{name}: x must be [T, {d_in}], got {tuple(x_TD.shape)}")
    if lora_a.dim() == 2 and lora_b.dim() == 3:  # shared A, per-expert B
        r = lora_b.shape[2]
        want_a, want_b = (groups * r, d_in), (E, d_out, r)
    elif lora_a.dim() == 3 and lora_b.dim() == 2:  # per-expert A, shared B
        r = lora_a.shape[1]
        want_a, want_b = (E, r, d_in), (d_out, r)
    else:
        raise ValueError(f"{name}: one factor must be shared (2-D) and the other per expert "
                         f"(3-D), got A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)}")
    if tuple(lora_a.shape) != want_a or tuple(lora_b.shape) != want_b:
        raise ValueError(f"{name}: A must be {list(want_a)} and B {list(want_b)} for W "
                         f"{[E, d_out, d_in]}, got {tuple(lora_a.shape)} and {tuple(lora_b.shape)}")
    if d_out % groups:
        raise ValueError(f"{name}: d_out {d_out} does not split into {groups} groups")
    if tuple(tokens_per_expert_E.shape) != (E,) or int(tokens_per_expert_E.sum()) != x_TD.shape[0]:
        raise ValueError(f"{name}: tokens_per_expert must be [{E}] summing to {x_TD.shape[0]}")


def shared_outer_grouped_linear(
    x_TD: torch.Tensor,
    weight_EOD,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    scaling: float,
    dropout: float = 0.0,
    probs_T: torch.Tensor | None = None,
    groups: int = 1,
) -> torch.Tensor:
    """y [T, d_out] of a shared-outer projection (see the section comment): the frozen grouped
    GEMM plus s times the LoRA branch whose 2-D factor (shared A [g r, d_in] or shared B
    [d_out, r]) is one GEMM over all rows and whose 3-D factor is per expert. ``dropout`` masks
    the LoRA input; ``probs_T`` scales the output rows. Differentiable in x and the factors."""
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"shared_outer_grouped_linear: dropout must be in [0, 1), got {dropout}")
    check_shared_outer_inputs(x_TD, weight_EOD, lora_a, lora_b, tokens_per_expert_E, groups)
    if not isinstance(weight_EOD, PackedWeight) and weight_EOD.requires_grad \
            and torch.is_grad_enabled():
        raise ValueError("shared_outer_grouped_linear: weight must be frozen (requires_grad=False)")
    counts = tokens_per_expert_E.tolist()
    y_TO = FrozenGroupedLinear.apply(x_TD, weight_EOD, tuple(counts))
    lora_x_TD = x_TD * lora_dropout_mask(x_TD, dropout) if dropout > 0 else x_TD
    if lora_a.dim() == 2:
        delta_TO = _per_expert_expand(F.linear(lora_x_TD, lora_a), lora_b, counts, groups)
    else:
        delta_TO = F.linear(_per_expert_shrink(lora_x_TD, lora_a, counts), lora_b)
    y_TO = y_TO + scaling * delta_TO
    return y_TO if probs_T is None else y_TO * probs_T.to(y_TO.dtype).unsqueeze(1)


def shared_outer_expert_mlp(
    x_TD: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    fc1: LoRAGroupedWeights,
    fc2: LoRAGroupedWeights,
    scaling: float,
    dropout: float = 0.0,
    activation_func=F.silu,
    gated: bool = True,
    probs_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """The expert MLP of :func:`lora_expert_mlp` with shared-outer LoRA: fc1's A [g r, d] and
    fc2's B [d, r] shared (g = 2 gated: gate and up each their own r rows of A), fc1's B
    [E, 2F or F, r] and fc2's A [E, r, F] per expert."""
    h_TH = shared_outer_grouped_linear(x_TD, *fc1, tokens_per_expert_E, scaling, dropout,
                                       groups=2 if gated else 1)
    act_TF = expert_activation(h_TH, activation_func, gated)
    return shared_outer_grouped_linear(act_TF, *fc2, tokens_per_expert_E, scaling, dropout,
                                       probs_T)
