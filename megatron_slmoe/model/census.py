"""Models without memory: build on the ``meta`` device, and count parameters there.

Megatron-Core modules pass explicit devices when they create tensors
(``device=torch.cuda.current_device()``, which the CPU adaptor makes the CPU), so a plain
``with torch.device("meta")`` does not reach them. ``meta_device()`` rewrites the device of every
tensor factory call instead, so a trillion-parameter model is built as shapes only.

``count_parameters(model_config)`` builds the whole model (TP = PP = EP = 1) that way and returns
its parameter census: total, active per token, and a breakdown by component.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_slmoe.compat.torch import device_constructors
from megatron_slmoe.model.build import build_gpt_model
from megatron_slmoe.model.model_file import ModelConfig
from megatron_slmoe.moe.layer import StableLatentMoELayer
from megatron_slmoe.platform.single_rank import init_single_rank

_META = torch.device("meta")


def _is_device(value: object) -> bool:
    return isinstance(value, (torch.device, str, int)) and not isinstance(value, bool)


class _MetaFactories(TorchFunctionMode):
    """Every tensor factory (empty, zeros, arange, tensor, ...) creates on meta, whatever device
    it names; ``tensor.to(device)`` keeps meta tensors on meta."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in device_constructors():
            kwargs["device"] = _META
        elif func is torch.Tensor.to:
            if "device" in kwargs:
                kwargs["device"] = _META
            if len(args) > 1 and _is_device(args[1]):
                args = (args[0], _META, *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_device():
    """Inside, every tensor created is a meta tensor (shape and dtype, no storage)."""
    with _MetaFactories():
        yield


def build_meta_model(model_config: ModelConfig, **overrides: Any):
    """The whole GPTModel (one stage, no model parallelism) as meta tensors."""
    config = model_config.transformer_config(
        **{"perform_initialization": False, "use_cpu_initialization": True, **overrides})
    with meta_device():
        return build_gpt_model(model_config, config)


# Breakdown categories, matched on the parameter's module path, first match wins. KDA's
# projections, convolutions, A_log and dt_bias and gated MLA's output gate are attention (KDA's
# o_norm a norm); the latent norm is latent; the Attention-Residual mixes (each layer's two, the
# output mix) have their own line.
_CATEGORIES = (
    ("routed_experts", (".mlp.experts.",)),
    ("shared_experts", (".mlp.shared_experts.",)),
    ("router", (".mlp.router.",)),
    ("router_bias", ()),  # buffers: see _BUFFERS
    ("latent", (".mlp.latent_",)),
    ("attention_residuals", ("_res.", ".attn_res.")),
    ("norms", ("norm.",)),
    ("attention", (".self_attention.",)),
    ("dense_mlp", (".mlp.",)),
    ("embedding", ("embedding.",)),
    ("output_layer", ("output_layer.",)),
)

_BUFFERS = (("router_bias", ".mlp.router.expert_bias"),)
"""Buffers a checkpoint holds as weights, counted with the parameters: the router's correction
bias (Megatron's ``expert_bias`` buffer, the release's ``e_score_correction_bias``)."""


def _category(name: str) -> str:
    dotted = "." + name
    for category, markers in _CATEGORIES:
        if any(marker in dotted for marker in markers):
            return category
    raise ValueError(f"parameter {name!r} fits no category of the parameter census")


def parameter_census(model) -> dict[str, Any]:
    """Total and active-per-token parameter counts of a built GPTModel (meta or real), with a
    breakdown by component; the router's correction bias (a buffer) counts, as a checkpoint
    holds it. Active per token: everything except, in each MoE layer, the routed
    experts a token is not sent to, (E - k) / E of that layer's routed-expert parameters."""
    config = model.config
    breakdown = {category: 0 for category, _ in _CATEGORIES}
    for name, param in model.named_parameters():  # shared (tied) parameters appear once
        breakdown[_category(name)] += param.numel()
    for name, buffer in model.named_buffers():
        for category, suffix in _BUFFERS:
            if ("." + name).endswith(suffix):
                breakdown[category] += buffer.numel()
    total = sum(breakdown.values())
    inactive = 0
    moe_layers = 0
    for module in model.modules():
        if isinstance(module, StableLatentMoELayer):
            moe_layers += 1
            routed = sum(p.numel() for p in module.experts.parameters())
            experts = config.num_moe_experts
            inactive += routed // experts * (experts - config.moe_router_topk)
    active = total - inactive
    return {
        "total_params": total,
        "active_params_per_token": active,
        "active_fraction": active / total,
        "num_layers": config.num_layers,
        "num_moe_layers": moe_layers,
        "num_moe_experts": config.num_moe_experts,
        "moe_router_topk": config.moe_router_topk,
        "breakdown": breakdown,
    }


def count_parameters(model_config: ModelConfig) -> dict[str, Any]:
    """Build ``model_config`` on meta (initialising a one-rank parallel_state if needed) and
    return its parameter census."""
    init_single_rank()
    return parameter_census(build_meta_model(model_config))
