"""The adapter export layouts, each named by what it is for: which serving engine or loader reads
it, and which trained expert layout it can be written from (issue 42).

One ``ExportLayout`` per name in ``LAYOUTS``; ``--export-hf-layout NAME`` (``slmoe-convert-hf
export`` and the fine-tune's ``--export-hf``) picks one. Its ``writer`` ("module:function",
imported when used, so a writer's module may import from ``hf.peft_export`` without a cycle) is
called as ``writer(job, staging)``: it writes the adapter files into the staging directory and
returns the manifest's ``modules`` (one entry per adapted HF module or parameter, the experts of a
layer as ``experts.*``: its rank, alpha and scale). ``hf.peft_export.export_peft_adapter`` runs
it and adds ``slmoe_adapter_manifest.json`` (``manifest``): the layout, the engines, how to load
it, the base model, the modules.

An unknown layout, or one the adapter's trained expert layout cannot give, is one
``HFCheckpointError`` line (``export_layout``).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron_slmoe.families.errors import HFCheckpointError

MANIFEST = "slmoe_adapter_manifest.json"
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class ExportLayout:
    name: str
    engines: tuple[str, ...]
    """Who reads it, each with what it needs (a flag, a version)."""
    load: str
    """How to load it, in one line."""
    trained: tuple[str, ...]
    """The trained expert layouts (``--expert-lora-layout``) it is written from."""
    writer: str
    """"module:function" writing it."""
    caveats: tuple[str, ...] = ()

    def write_function(self) -> Callable[["ExportJob", str], list[dict]]:
        module, _, function = self.writer.partition(":")
        return getattr(importlib.import_module(module), function)


LAYOUTS: dict[str, ExportLayout] = {layout.name: layout for layout in (
    ExportLayout(
        "per-expert",
        engines=("vLLM (--enable-lora; expert LoRA per expert module, tensor parallelism, not "
                 "expert parallelism)",
                 "PEFT on transformers 5 for Qwen2/3-MoE and DeepSeek (converted to its fused "
                 "experts on load)"),
        load="vllm serve BASE --enable-lora --lora-modules NAME=DIR; or "
             "PeftModel.from_pretrained(base, DIR)",
        trained=("per-expert",),
        writer="megatron_slmoe.hf.peft_export:write_peft_layout",
        caveats=("PEFT reads every gate/up/down_proj target as expert LoRA: no dense or shared "
                 "MLP LoRA of those names",)),
    ExportLayout(
        "fused",
        engines=("PEFT target_parameters on transformers 5's fused 3D experts (every family)",
                 "vLLM's 3D expert LoRA (lora_B [out, r*E], expert index fastest)"),
        load="PeftModel.from_pretrained(base, DIR)",
        trained=("per-expert",),
        writer="megatron_slmoe.hf.peft_export:write_peft_layout"),
    ExportLayout(
        "shared-outer",
        engines=("SGLang with --experts-shared-outer-loras (the gate's and the up's A and the "
                 "down's B shared by a layer's experts)",),
        load="python -m sglang.launch_server --model-path BASE --lora-paths NAME=DIR "
             "--experts-shared-outer-loras",
        trained=("shared-outer",),
        writer="megatron_slmoe.hf.shared_outer_export:write_shared_outer",
        caveats=("SGLang sizes Kimi K3's expert LoRA buffers by the 3584 latent, not the "
                 "hidden size",)),
    ExportLayout(
        "shared-outer-expanded",
        engines=("vLLM (per-expert modules)", "PEFT on transformers 5 (as per-expert)"),
        load="as per-expert",
        trained=("shared-outer",),
        writer="megatron_slmoe.hf.shared_outer_export:write_shared_outer_expanded",
        caveats=("every expert carries its copy of the shared factors: the file is per-expert "
                 "sized, the experts at twice the rank (gate and up each their own shared A)",)),
)}
"""One entry per layout."""


def export_layout(name: str, trained: str = "per-expert") -> ExportLayout:
    """The layout ``name`` for an adapter trained with the expert layout ``trained``; one
    HFCheckpointError line when it is unknown or cannot be written from that adapter."""
    layout = LAYOUTS.get(name)
    if layout is None:
        raise HFCheckpointError(f"--export-hf-layout {name!r} is not one of "
                                f"{', '.join(LAYOUTS)}")
    if trained not in layout.trained:
        fitting = [n for n, entry in LAYOUTS.items() if trained in entry.trained]
        raise HFCheckpointError(
            f"--export-hf-layout {name} needs an adapter trained with --expert-lora-layout "
            f"{' or '.join(layout.trained)}; this one is {trained} (export it as "
            f"{' or '.join(fitting)})")
    return layout


@dataclass(frozen=True)
class ExportJob:
    """What a writer is given: the adapter, its settings, the HF base and the names to state."""

    adapter_dir: str
    lora_config: Any
    """The adapter's LoRAConfig."""
    hf: Any
    """The HF base (``hf.loader.HFModel``)."""
    layout: ExportLayout
    base_model_name_or_path: str


_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def module_entry(module: str, rank: int, alpha: float, parameter: Optional[str] = None,
                 experts: int = 1, megatron: str = "") -> dict:
    """A manifest ``modules`` entry: an expert index in a module path becomes ``*`` (one entry
    for the experts of a layer), the scale is alpha / rank."""
    return {"module": _EXPERT_INDEX.sub(".experts.*.", module), "parameter": parameter,
            "experts": experts, "rank": rank, "alpha": float(alpha),
            "scaling": float(alpha) / rank,
            "megatron": _EXPERT_INDEX.sub(".experts.*.", megatron)}


def manifest(job: ExportJob, modules: list[dict], files: list[str]) -> dict:
    """The content of slmoe_adapter_manifest.json (modules deduplicated, in order)."""
    unique = {tuple(sorted(m.items(), key=lambda kv: kv[0])): m for m in modules}
    return {
        "manifest_version": MANIFEST_VERSION,
        "layout": job.layout.name,
        "trained_expert_layout": job.lora_config.expert_layout,
        "engines": list(job.layout.engines),
        "load": job.layout.load,
        "caveats": list(job.layout.caveats),
        "base_model_name_or_path": job.base_model_name_or_path,
        "family": job.hf.family.name,
        "files": sorted(files),
        "modules": sorted(unique.values(), key=lambda m: (m["module"], m["parameter"] or "")),
    }
