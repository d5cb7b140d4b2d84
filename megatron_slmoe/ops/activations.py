"""Activations of a gated linear unit that read fc1's whole output ``[gate | up]``.

Megatron-Core's gated MLP computes ``act(gate) * up``: the activation sees the gate half only.
Some models transform both halves, e.g. SiTU-GLU (Kimi K3's dense MLP, shared and routed
experts)::

    g, u = gate, up  (computed in fp32)
    a  = beta * tanh(g / beta) * sigmoid(g)        beta 4, the sigmoid of the raw g
    u' = linear_beta * tanh(u / linear_beta)       linear_beta 25
    out = a * u'     (cast back to the input dtype)

A :class:`FusedGLUActivation` maps ``[..., 2F]`` (gate first, as Megatron's linear_fc1 stacks
them; under tensor parallelism each rank's shard is ``[gate shard | up shard]``, so the split
stays per rank) to ``[..., F]``. It reaches the layers through ``TransformerConfig.
activation_func``:

* this repository's experts call :func:`megatron_slmoe.ops.lora_expert.expert_activation`,
  which hands a fused activation the whole fc1 output;
* Megatron-Core's MLP (dense layers, shared experts, its own experts) calls the config's
  activation on the whole fc1 output when ``use_te_activation_func`` is set and the layer spec
  gives no activation module (the local spec's case); Megatron's config check admits only
  Transformer Engine's activations with that flag, so the model config sets the flag after the
  check (``model.validation.make_transformer_config``).

The activation is a frozen dataclass, not a module: it holds no weights, compares by value (two
configs with SiTU of the same betas are equal) and registers no submodule in each MLP that
keeps a reference to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable


class FusedGLUActivation:
    """``[..., 2F]`` (gate | up) -> ``[..., F]``."""

    name = "fused_glu"

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _check(self, h: torch.Tensor) -> None:
        if h.shape[-1] % 2:
            raise ValueError(f"{self.name}: fc1 must output gate|up (an even size), got "
                             f"{h.shape[-1]}")


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def _situ_parts(h: torch.Tensor, beta: float, linear_beta: float):
    """(bounded gate a, bounded up u', tanh(g/beta), sigmoid(g), tanh(u/linear_beta)) in (at
    least) fp32."""
    gate, up = h.chunk(2, dim=-1)
    g, u = _at_least_fp32(gate), _at_least_fp32(up)
    tanh_g, sig_g, tanh_u = torch.tanh(g / beta), torch.sigmoid(g), torch.tanh(u / linear_beta)
    return beta * tanh_g * sig_g, linear_beta * tanh_u, tanh_g, sig_g, tanh_u


class _SiTUGLUFunction(torch.autograd.Function):
    """SiTU-GLU that keeps only its input for the backward (the fc1 output, in its own dtype)
    and recomputes the fp32 intermediates there, instead of autograd keeping five fp32 tensors
    of the output's size."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
        ctx.save_for_backward(h)
        ctx.betas = (beta, linear_beta)
        a, u, *_ = _situ_parts(h, beta, linear_beta)
        return (a * u).to(h.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        (h,) = ctx.saved_tensors
        beta, linear_beta = ctx.betas
        a, u, tanh_g, sig_g, tanh_u = _situ_parts(h, beta, linear_beta)
        go = _at_least_fp32(grad_out)
        da_dg = (1 - tanh_g * tanh_g) * sig_g + beta * tanh_g * sig_g * (1 - sig_g)
        grad_gate = go * u * da_dg
        grad_up = go * a * (1 - tanh_u * tanh_u)
        return torch.cat([grad_gate, grad_up], dim=-1).to(h.dtype), None, None


@dataclass(frozen=True)
class SiTUGLU(FusedGLUActivation):
    """SiTU-GLU: ``beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)`` in (at least)
    fp32, in the input's dtype; the backward keeps only the input. Kimi K3: beta 4
    (``activation_situ_beta``), linear_beta 25 (``activation_situ_linear_beta``)."""

    beta: float = 4.0
    linear_beta: float = 25.0
    name = "situ"

    def __post_init__(self) -> None:
        if not (self.beta > 0 and self.linear_beta > 0):
            raise ValueError(f"situ: beta and linear_beta must be positive, got {self.beta} and "
                             f"{self.linear_beta}")

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        self._check(h)
        return _SiTUGLUFunction.apply(h, float(self.beta), float(self.linear_beta))


def is_fused_glu(activation) -> bool:
    """Whether ``activation`` reads fc1's whole output (gate and up)."""
    return isinstance(activation, FusedGLUActivation)
