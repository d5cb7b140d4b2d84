"""The one registry of LoRA targets: which modules of a Megatron model each ``--lora-target-modules``
name adapts, and how. A new target is one ``ModuleKind`` entry here.

=================  ==========================================================================
``linear_qkv``     the attention's input projections: ``self_attention.linear_qkv``
                   (ColumnParallelLinear); with multi-latent attention (DeepSeek-V3, Kimi-K2) its
                   ``linear_q_proj`` or ``linear_q_down_proj`` + ``linear_q_up_proj``, and
                   ``linear_kv_down_proj`` + ``linear_kv_up_proj``
``linear_proj``    ``self_attention.linear_proj`` (RowParallelLinear)
``linear_fc1``     dense ``mlp.linear_fc1``; in MoE layers every routed expert's fc1
                   (``LatentSwiGLUExperts`` -> ``LoRALatentSwiGLUExperts``, one adapter per expert)
``linear_fc2``     dense ``mlp.linear_fc2``; every routed expert's fc2
``shared_experts`` ``mlp.shared_experts.linear_fc1`` and ``.linear_fc2``
``router``         ``mlp.router`` (gating linear)
``latent``         ``mlp.latent_down`` and ``mlp.latent_up``
``vision_attention`` multimodal models: the vision tower's ``self_attention.linear_qkv`` and
                   ``.linear_proj`` (a transformers tower: ``attn.q_proj/k_proj/v_proj/proj``)
``projector``      multimodal models: the vision projector's ``linear_fc1`` / ``linear_fc2``
                   (or its one affine linear; a transformers projector: its linears)
=================  ==========================================================================

**Regions.** A multimodal model (Megatron's LLaVAModel) holds a vision tower (``vision_model``) and
a projector (``vision_projection``) beside its language model. Every kind belongs to one region,
and a module is matched only by the kinds of the region it sits in, so the language-model targets
never adapt the tower (its attention also has ``linear_qkv``) and the vision targets never adapt
the language model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

from megatron_slmoe.lora.config import TARGET_NAMES, LoRAConfig
from megatron_slmoe.lora.experts import LoRALatentSwiGLUExperts
from megatron_slmoe.lora.latent import LoRALatentProjection
from megatron_slmoe.lora.linear import (
    LoRAColumnParallelLinear,
    LoRAReplicatedLinear,
    LoRARowParallelLinear,
)
from megatron_slmoe.lora.router import LoRARouterMixin
from megatron_slmoe.moe.experts import LatentSwiGLUExperts
from megatron_slmoe.moe.latent import LatentProjection


class LoRATargetError(ValueError):
    """A LoRA target that matches nothing in the model, or a module LoRA cannot adapt."""


Adapter = Callable[[torch.nn.Module, torch.nn.Module, str, LoRAConfig, str, set], torch.nn.Module]
"""adapt(child, parent, attr, lora_config, global name, wanted targets) -> the LoRA module."""


REGIONS = ("language", "vision", "projector")
"""Where a module sits: the (language) model, a multimodal model's vision tower or its projector."""

# The attribute of a multimodal model's vision side -> the region of every module under it:
# LLaVAModel's, and those of a transformers tower and projector (Kimi-K2.5's, in
# ``hf.kimi_k25.KimiK25Vision``).
_REGION_ROOTS = {"vision_model": "vision", "vision_projection": "projector",
                 "vision_tower": "vision", "mm_projector": "projector",
                 # Qwen3-VL's (``hf.qwen3_vl_moe``): the mergers sit inside the tower.
                 "visual": "vision", "merger": "projector",
                 "deepstack_merger_list": "projector"}


@dataclass(frozen=True)
class ModuleKind:
    """A kind of module LoRA can adapt, found as ``parent.<attr>`` in ``region``."""

    name: str
    targets: tuple[str, ...]
    """The target names that select it (any of them)."""
    matches: Callable[[torch.nn.Module, str, torch.nn.Module], bool]
    """matches(parent, attr, child)."""
    adapt: Adapter
    region: str = "language"


def _linear(child, parent, attr, lora_config, name, wanted):
    if getattr(child, "is_expert", False):
        raise TypeError(f"{name}: Megatron's own routed experts are not supported (LoRA adapts "
                        f"the Stable Latent MoE experts)")
    if isinstance(child, ColumnParallelLinear):
        glu = attr == "linear_fc1" and bool(parent.config.gated_linear_unit)
        return LoRAColumnParallelLinear.from_base(child, lora_config, name, glu=glu)
    if isinstance(child, RowParallelLinear):
        return LoRARowParallelLinear.from_base(child, lora_config, name)
    raise TypeError(f"{name} is a {type(child).__name__}; LoRA adapts Megatron's local "
                    f"ColumnParallelLinear/RowParallelLinear (build the model without "
                    f"Transformer Engine)")


def _replicated(child, parent, attr, lora_config, name, wanted):
    return LoRAReplicatedLinear.from_base(child, lora_config, name)


def _experts(child, parent, attr, lora_config, name, wanted):
    return LoRALatentSwiGLUExperts.from_base(child, lora_config, name,
                                             fc1="linear_fc1" in wanted,
                                             fc2="linear_fc2" in wanted)


def _attention(*attr_names: str):
    return lambda parent, attr, child: attr in attr_names and not isinstance(parent, MLP)


ATTENTION_INPUTS = ("linear_qkv", "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
                    "linear_kv_down_proj", "linear_kv_up_proj")
"""Megatron's attention input projections: fused q/k/v, or multi-latent attention's."""


def _dense_mlp(attr_name: str):
    return lambda parent, attr, child: (attr == attr_name and isinstance(parent, MLP)
                                        and not isinstance(parent, SharedExpertMLP))


MODULE_KINDS: tuple[ModuleKind, ...] = (
    ModuleKind("attention_qkv", ("linear_qkv",), _attention(*ATTENTION_INPUTS), _linear),
    ModuleKind("attention_proj", ("linear_proj",), _attention("linear_proj"), _linear),
    ModuleKind("dense_fc1", ("linear_fc1",), _dense_mlp("linear_fc1"), _linear),
    ModuleKind("dense_fc2", ("linear_fc2",), _dense_mlp("linear_fc2"), _linear),
    ModuleKind("routed_experts", ("linear_fc1", "linear_fc2"),
               lambda parent, attr, child: attr == "experts"
               and isinstance(child, LatentSwiGLUExperts), _experts),
    ModuleKind("shared_experts", ("shared_experts",),
               lambda parent, attr, child: attr in ("linear_fc1", "linear_fc2")
               and isinstance(parent, SharedExpertMLP), _linear),
    ModuleKind("router", ("router",),
               lambda parent, attr, child: attr == "router" and isinstance(child, TopKRouter),
               lambda child, parent, attr, lora_config, name, wanted:
               LoRARouterMixin.from_base(child, lora_config, name)),
    ModuleKind("latent", ("latent",),
               lambda parent, attr, child: attr in ("latent_down", "latent_up")
               and isinstance(child, LatentProjection),
               lambda child, parent, attr, lora_config, name, wanted:
               LoRALatentProjection.from_base(child, lora_config, name)),
    ModuleKind("vision_attention_qkv", ("vision_attention",), _attention("linear_qkv"), _linear,
               region="vision"),
    ModuleKind("vision_attention_proj", ("vision_attention",), _attention("linear_proj"),
               _linear, region="vision"),
    ModuleKind("projector_linear", ("projector",),
               lambda parent, attr, child: isinstance(child, (ColumnParallelLinear,
                                                              RowParallelLinear)),
               _linear, region="projector"),
    # A transformers tower and projector (replicated): the attention's q/k/v and output
    # projections, the projector's linears.
    ModuleKind("hf_vision_attention", ("vision_attention",),
               lambda parent, attr, child: type(child) is torch.nn.Linear and (
                   attr in ("q_proj", "k_proj", "v_proj", "proj")
                   and all(hasattr(parent, a) for a in ("q_proj", "k_proj", "v_proj"))
                   or attr in ("qkv", "proj") and hasattr(parent, "qkv")),  # fused (Qwen3-VL)
               _replicated, region="vision"),
    ModuleKind("hf_projector_linear", ("projector",),
               lambda parent, attr, child: type(child) is torch.nn.Linear, _replicated,
               region="projector"),
)

TARGETS: tuple[str, ...] = TARGET_NAMES
"""The LoRA target names (defined torch-free in lora.config; MODULE_KINDS covers each of them)."""


def regions(chunk: torch.nn.Module) -> dict[int, str]:
    """id -> region of every module of ``chunk`` outside the language region (see the module
    doc); modules not listed are in the language region."""
    found: dict[int, str] = {}
    for module in chunk.modules():
        for attr, region in _REGION_ROOTS.items():
            root = getattr(module, attr, None)
            if isinstance(root, torch.nn.Module):
                found.update((id(m), region) for m in root.modules())
    return found


def kind_of(parent: torch.nn.Module, attr: str, child: torch.nn.Module,
            region: str = "language") -> ModuleKind | None:
    """The kind of ``parent.<attr>`` when ``parent`` sits in ``region``, or None."""
    return next((kind for kind in MODULE_KINDS
                 if kind.region == region and kind.matches(parent, attr, child)), None)


def adapt(kind: ModuleKind, child, parent, attr: str, lora_config: LoRAConfig, name: str,
          wanted: set[str]) -> torch.nn.Module:
    try:
        return kind.adapt(child, parent, attr, lora_config, name, wanted)
    except TypeError as err:
        raise LoRATargetError(f"lora target {'/'.join(kind.targets)!r}: {err}") from None
