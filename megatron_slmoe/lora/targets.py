"""The one registry of LoRA targets: which modules of a Megatron model each ``--lora-target-modules``
name adapts, and how. A new target is one ``ModuleKind`` entry here.

=================  ==========================================================================
``linear_qkv``     the attention's input projections: ``self_attention.linear_qkv``
                   (ColumnParallelLinear); with multi-latent attention (DeepSeek-V3, Kimi-K2) its
                   ``linear_q_proj`` or ``linear_q_down_proj`` + ``linear_q_up_proj``, and
                   ``linear_kv_down_proj`` + ``linear_kv_up_proj`` (+ ``linear_gate``, the
                   output gate of gated NoPE MLA); with linear attention under its own names
                   (Kimi Delta Attention) ``q_proj``, ``k_proj``, ``v_proj``, ``g_proj``,
                   ``b_proj``, ``f_b_proj`` (ColumnParallelLinear) and ``f_a_proj`` (a
                   ``torch.nn.Linear`` whole on every TP rank)
``linear_proj``    ``self_attention.linear_proj`` or ``.o_proj`` (RowParallelLinear)
``linear_fc1``     dense ``mlp.linear_fc1``; in MoE layers every routed expert's fc1
                   (``LatentSwiGLUExperts`` -> ``LoRALatentSwiGLUExperts``, one adapter per expert)
``linear_fc2``     dense ``mlp.linear_fc2``; every routed expert's fc2
``shared_experts`` ``mlp.shared_experts.linear_fc1`` and ``.linear_fc2``
``router``         ``mlp.router`` (gating linear)
``latent``         ``mlp.latent_down`` and ``mlp.latent_up``
``vision_attention`` multimodal models: the vision tower's ``self_attention.linear_qkv`` and
                   ``.linear_proj`` (a tower from elsewhere: the linears it declares)
``projector``      multimodal models: the vision projector's ``linear_fc1`` / ``linear_fc2``
                   (or its one affine linear; a transformers projector: its linears)
=================  ==========================================================================

**Regions.** A multimodal model (Megatron's LLaVAModel) holds a vision tower (``vision_model``) and
a projector (``vision_projection``) beside its language model; a tower from elsewhere (a checkpoint
family's) declares its regions (``DeclaresLoRARegions``). Every kind belongs to one region,
and a module is matched only by the kinds of the region it sits in, so the language-model targets
never adapt the tower (its attention also has ``linear_qkv``) and the vision targets never adapt
the language model.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Callable, Mapping

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
from megatron_slmoe.utils.errors import InputError


class LoRATargetError(InputError, ValueError):
    """A LoRA target that matches nothing in the model, or a module LoRA cannot adapt."""


Adapter = Callable[[torch.nn.Module, torch.nn.Module, str, LoRAConfig, str, set], torch.nn.Module]
"""adapt(child, parent, attr, lora_config, global name, wanted targets) -> the LoRA module."""


REGIONS = ("language", "vision", "projector")
"""Where a module sits: the (language) model, a multimodal model's vision tower or its projector."""

# Megatron-Core's LLaVAModel: the attribute of its vision side -> the region of every module under it.
_LLAVA_REGION_ROOTS = {"vision_model": "vision", "vision_projection": "projector"}


class DeclaresLoRARegions:
    """A module from elsewhere (a checkpoint family's vision tower and projector, built from
    transformers' classes) that says where its submodules sit for LoRA: ``lora_regions`` maps a
    dotted submodule name to the region of everything under it (the longest match wins), and
    ``lora_attention_linears`` names, as ``fnmatch`` patterns relative to the module, its plain
    ``torch.nn.Linear`` attention projections (``vision_attention``). LoRA then needs no
    knowledge of any family's module names."""

    lora_regions: Mapping[str, str] = {}
    lora_attention_linears: tuple[str, ...] = ()


@dataclass
class Regions:
    """Where each module of a model chunk sits (by ``id``): its region (``language`` when not
    listed) and whether it is a declared attention projection of a vision tower."""

    region: dict[int, str]
    attention: set[int]

    def of(self, module: torch.nn.Module) -> str:
        return self.region.get(id(module), "language")


@dataclass(frozen=True)
class ModuleKind:
    """A kind of module LoRA can adapt, found as ``parent.<attr>`` in ``region``."""

    name: str
    targets: tuple[str, ...]
    """The target names that select it (any of them)."""
    matches: Callable[[torch.nn.Module, str, torch.nn.Module, Regions], bool]
    """matches(parent, attr, child, regions of the chunk)."""
    adapt: Adapter
    region: str = "language"


def _linear(child, parent, attr, lora_config, name, wanted):
    if type(child) is torch.nn.Linear:  # replicated over TP (KDA's f_a_proj)
        return LoRAReplicatedLinear.from_base(child, lora_config, name)
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


def expert_rank(experts: torch.nn.Module, lora_config: LoRAConfig) -> int:
    """The rank of LoRA on these routed experts (their model's top-k for --moe-rank-scaling);
    LoRATargetError (one line) where none can be had."""
    try:
        return lora_config.expert_rank_for(experts.config.moe_router_topk)
    except ValueError as err:
        raise LoRATargetError(str(err)) from None


def _experts(child, parent, attr, lora_config, name, wanted):
    return LoRALatentSwiGLUExperts.from_base(child, lora_config, name,
                                             fc1="linear_fc1" in wanted,
                                             fc2="linear_fc2" in wanted,
                                             rank=expert_rank(child, lora_config))


def _attention(*attr_names: str):
    return lambda parent, attr, child, where: attr in attr_names and not isinstance(parent, MLP)


ATTENTION_INPUTS = ("linear_qkv", "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
                    "linear_kv_down_proj", "linear_kv_up_proj", "linear_gate",
                    "q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "f_a_proj", "f_b_proj")
"""The attention input projections: Megatron's fused q/k/v, or multi-latent attention's (and the
output gate of gated NoPE MLA, model.gated_nope_mla, which also reads the layer's input); a
linear attention's under the checkpoint's names (model.kda_attention: q/k/v, output gate g,
beta b, decay f_a -> f_b)."""

ATTENTION_OUTPUTS = ("linear_proj", "o_proj")


def _dense_mlp(attr_name: str):
    return lambda parent, attr, child, where: (attr == attr_name and isinstance(parent, MLP)
                                        and not isinstance(parent, SharedExpertMLP))


MODULE_KINDS: tuple[ModuleKind, ...] = (
    ModuleKind("attention_qkv", ("linear_qkv",), _attention(*ATTENTION_INPUTS), _linear),
    ModuleKind("attention_proj", ("linear_proj",), _attention(*ATTENTION_OUTPUTS), _linear),
    ModuleKind("dense_fc1", ("linear_fc1",), _dense_mlp("linear_fc1"), _linear),
    ModuleKind("dense_fc2", ("linear_fc2",), _dense_mlp("linear_fc2"), _linear),
    ModuleKind("routed_experts", ("linear_fc1", "linear_fc2"),
               lambda parent, attr, child, where: attr == "experts"
               and isinstance(child, LatentSwiGLUExperts), _experts),
    ModuleKind("shared_experts", ("shared_experts",),
               lambda parent, attr, child, where: attr in ("linear_fc1", "linear_fc2")
               and isinstance(parent, SharedExpertMLP), _linear),
    ModuleKind("router", ("router",),
               lambda parent, attr, child, where: attr == "router"
               and isinstance(child, TopKRouter),
               lambda child, parent, attr, lora_config, name, wanted:
               LoRARouterMixin.from_base(child, lora_config, name)),
    ModuleKind("latent", ("latent",),
               lambda parent, attr, child, where: attr in ("latent_down", "latent_up")
               and isinstance(child, LatentProjection),
               lambda child, parent, attr, lora_config, name, wanted:
               LoRALatentProjection.from_base(child, lora_config, name)),
    ModuleKind("vision_attention_qkv", ("vision_attention",), _attention("linear_qkv"), _linear,
               region="vision"),
    ModuleKind("vision_attention_proj", ("vision_attention",), _attention("linear_proj"),
               _linear, region="vision"),
    ModuleKind("projector_linear", ("projector",),
               lambda parent, attr, child, where: isinstance(child, (ColumnParallelLinear,
                                                                     RowParallelLinear)),
               _linear, region="projector"),
    # A tower and projector from elsewhere (replicated, ``DeclaresLoRARegions``): its declared
    # attention projections, the projector's linears.
    ModuleKind("declared_vision_attention", ("vision_attention",),
               lambda parent, attr, child, where: type(child) is torch.nn.Linear
               and id(child) in where.attention, _replicated, region="vision"),
    ModuleKind("declared_projector_linear", ("projector",),
               lambda parent, attr, child, where: type(child) is torch.nn.Linear, _replicated,
               region="projector"),
)

TARGETS: tuple[str, ...] = TARGET_NAMES
"""The LoRA target names (defined torch-free in lora.config; MODULE_KINDS covers each of them)."""


def regions(chunk: torch.nn.Module) -> Regions:
    """Where every module of ``chunk`` sits (see the module doc): under LLaVAModel's vision
    side, or as a ``DeclaresLoRARegions`` module declares."""
    found = Regions({}, set())
    for module in chunk.modules():
        for attr, region in _LLAVA_REGION_ROOTS.items():
            root = getattr(module, attr, None)
            if isinstance(root, torch.nn.Module):
                found.region.update((id(m), region) for m in root.modules())
        if isinstance(module, DeclaresLoRARegions):
            _declared(module, found)
    return found


def _declared(module: "DeclaresLoRARegions", found: Regions) -> None:
    roots = sorted(module.lora_regions.items(), key=lambda item: len(item[0]))
    for name, sub in module.named_modules():
        for root, region in roots:  # shortest first: the longest match is written last
            if name == root or name.startswith(root + "."):
                found.region[id(sub)] = region
        if any(fnmatch.fnmatchcase(name, p) for p in module.lora_attention_linears):
            found.attention.add(id(sub))


def kind_of(parent: torch.nn.Module, attr: str, child: torch.nn.Module,
            where: Regions) -> ModuleKind | None:
    """The kind of ``parent.<attr>`` in a chunk whose modules sit as ``where`` says, or None."""
    region = where.of(parent)
    return next((kind for kind in MODULE_KINDS
                 if kind.region == region and kind.matches(parent, attr, child, where)), None)


def adapt(kind: ModuleKind, child, parent, attr: str, lora_config: LoRAConfig, name: str,
          wanted: set[str]) -> torch.nn.Module:
    try:
        return kind.adapt(child, parent, attr, lora_config, name, wanted)
    except TypeError as err:
        raise LoRATargetError(f"lora target {'/'.join(kind.targets)!r}: {err}") from None
