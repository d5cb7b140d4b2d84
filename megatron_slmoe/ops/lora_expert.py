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
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from megatron_slmoe.ops._native import choose_backend, native_extension_error, native_op

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_grouped_inputs(x_TD, weight_EOD, lora_a_ERD, lora_b_EOR, tokens_per_expert_E,
                         probs_T=None) -> None:
    """The checks the native op makes (csrc/lora_expert_checks.h), with the same messages."""
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

    ``dropout`` is the LoRA dropout probability; the caller passes 0 outside training.
    ``probs_T``, when given, scales each output row (cast to x's dtype).
    """
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora_grouped_linear: dropout must be in [0, 1), got {dropout}")
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


class LoRAGroupedWeights(NamedTuple):
    """One projection of all local experts: frozen weight plus its LoRA factors."""

    weight: torch.Tensor  # [E, d_out, d_in], frozen
    lora_a: torch.Tensor  # [E, r, d_in]
    lora_b: torch.Tensor  # [E, d_out, r]


def expert_activation(h_TH: torch.Tensor, activation_func=F.silu, gated: bool = True) -> torch.Tensor:
    """fc1's output -> fc2's input of an expert MLP: ``act(gate) * up`` for a gated linear unit
    (fc1 rows ``[gate; up]``, gate first as in Megatron's linear_fc1), ``act(h)`` for a non-gated
    one (e.g. squared ReLU: Megatron's ``gated_linear_unit=False`` with ``squared_relu``)."""
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
