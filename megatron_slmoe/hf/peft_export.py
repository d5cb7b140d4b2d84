"""Export a megatron_slmoe adapter as a PEFT LoRA adapter of the Hugging Face base model.

Input: an adapter directory as ``save_adapter`` writes it (globally named, unsharded: the same
file whatever the parallel layout of the run) and the HF checkpoint directory of the base model.
Output: ``adapter_config.json`` (a PEFT ``LoraConfig``) and ``adapter_model.safetensors`` with
PEFT's key names (``base_model.model.<HF module>.lora_A.weight``), written one tensor at a time
(``safetensors_stream``) into a staging directory renamed into place.

Two expert layouts (``--export-hf-layout``; ``hf.export_layouts`` names every export layout, the
engines that read it and its writer, and ``export_peft_adapter`` writes any of them with its
manifest):

* ``per-expert``: every routed expert's projections as modules
  (``model.layers.1.mlp.experts.5.gate_proj``), as checkpoints store them; what vLLM loads. PEFT
  loads it on transformers 5 (which holds experts fused) only for the model types it converts
  (Qwen2/3-MoE, DeepSeek): it then reads every ``gate_proj``/``up_proj``/``down_proj`` target as
  expert LoRA, so a dense MLP or shared expert with those names is refused here, as is a
  non-Linear module PEFT cannot adapt (a router it does not convert); for other types (NemotronH,
  the Stable Latent MoE) the export warns that PEFT would leave the expert LoRA out;
* ``fused``: PEFT's ``target_parameters`` on transformers 5's 3D expert tensors
  (``mlp.experts.gate_up_proj`` [E, 2F, d]): A [E*r, in] expert-major, B [out, r*E] rank-major,
  as ``peft.tuners.lora.ParamWrapper`` reads them. The other MLP weights (dense, shared experts,
  router) are ``target_parameters`` too, so PEFT's conversion leaves them alone; attention
  projections stay modules. Every family loads this form in PEFT.

A LoRA that adds nothing to its HF weight is left out (``idle_loras``): what the PEFT import
gave zero factors because PEFT did not adapt it (k/v_proj beside an adapted q_proj, the dense MLP of
an experts-only adapter), so an imported adapter exports back as PEFT wrote it.

The mapping is ``hf.lora_mapping`` over the family's weight table (one place for both).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_slmoe.families.errors import HFCheckpointError
from megatron_slmoe.hf.export_layouts import (
    MANIFEST,
    ExportJob,
    export_layout,
    manifest,
    module_entry,
)
from megatron_slmoe.hf.loader import HFModel, open_hf_checkpoint
from megatron_slmoe.hf.lora_mapping import (
    HFLoRA,
    hf_loras,
    is_expert_module,
    megatron_lora_modules,
)
from megatron_slmoe.hf.safetensors_stream import (
    DTYPE_NAMES,
    PlannedTensor,
    WindowedReader,
    write_streamed,
)
from megatron_slmoe.lora.adapter import ADAPTER_WEIGHTS, read_adapter_config
from megatron_slmoe.utils.atomic import atomic_directory, write_json_atomic

log = logging.getLogger(__name__)

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
PEFT_KEY_PREFIX = "base_model.model."
"""What PEFT puts before a module path in adapter_model.safetensors."""


@dataclass(frozen=True)
class PeftTarget:
    """One adapted HF module (``parameter`` None) or parameter, and the HF LoRAs it is made of
    (one per expert for a fused 3D parameter, in expert order; each expert's parts in order)."""

    module: str
    parameter: Optional[str]
    loras: tuple[tuple[HFLoRA, ...], ...]
    experts: int
    key_module: str = ""
    """The module path of its PEFT keys (nested ParamWrappers add ``.base_layer``)."""


def hf_meta_model(hf: HFModel):
    """The base model as transformers holds it, on the meta device (names, module types): the
    family's (``Family.hf_meta_model``)."""
    return hf.family.hf_meta_model(hf.checkpoint.config_path, hf.checkpoint.tensors)


def _in_memory(hf: HFModel, canonical: str, params: dict) -> str:
    """The name transformers gives a canonical (on-disk) weight name in memory."""
    if canonical in params:
        return canonical
    for rename in hf.family.layouts.renames:
        if canonical.startswith(rename.canonical):
            stored = rename.stored + canonical[len(rename.canonical):]
            if stored in params:
                return stored
    return canonical


def check_shapes(loras: list[HFLoRA], hf: HFModel, meta) -> None:
    """Every HF LoRA's weight exists in the base model with the LoRA's [out, in] (an adapter
    trained on another base is refused here, in one line)."""
    shapes = {}
    for name, tensor in meta.state_dict(keep_vars=True).items():
        shapes.update(hf.family.layouts.canonical(name, tuple(tensor.shape)))
    for lora in loras:
        want = shapes.get(lora.hf_weight)
        if want != (lora.out_features, lora.in_features):
            raise HFCheckpointError(
                f"LoRA on Megatron {lora.megatron} gives {lora.hf_weight} "
                f"[{lora.out_features}, {lora.in_features}], but {hf.checkpoint.config_path} "
                f"describes " + (f"{list(want)}" if want else "no such weight")
                + " (an adapter for another base model?)")


def plan_targets(loras: list[HFLoRA], hf: HFModel, meta, layout: str) -> list[PeftTarget]:
    """Group the HF LoRAs (shapes checked) into PEFT targets of ``layout``."""
    params = dict(meta.named_parameters())
    modules = dict(meta.named_modules())
    targets: list[PeftTarget] = []
    fused: dict[str, dict[int, list]] = {}
    fused_in_memory = False  # per-expert LoRA on experts transformers holds as 3D tensors
    conversion = _peft_conversion(hf) if layout == "per-expert" else None
    # Module names PEFT turns into LoRA on the fused 3D experts (a dense gate_proj too).
    peft_expert_targets = {old for old, new in (conversion or {}).items()
                           if any(p.endswith(f".experts.{new}") for p in params)}
    for lora in loras:
        if lora.expert is not None and layout == "fused":
            # The checkpoint's name or its in-memory rename (NemotronH: backbone. -> model.).
            found = next((f for name in (lora.hf_weight, _renamed(hf, lora.hf_weight))
                          for rule in hf.family.layouts.fused
                          if (f := rule.to_fused(name)) and f[0] in params), None)
            if found is None:
                raise HFCheckpointError(f"LoRA on Megatron {lora.megatron}: {lora.hf_weight} has "
                                        f"no fused 3D tensor in {type(meta).__name__}")
            fused.setdefault(found[0], {}).setdefault(found[1], []).append((found[2], lora))
            continue
        if lora.expert is not None:  # per-expert: checkpoint names, one module per expert
            if _in_memory(hf, lora.hf_weight, params) not in params:
                fused_in_memory = True
            targets.append(PeftTarget(lora.hf_weight[:-len(".weight")], None, ((lora,),), 1))
            continue
        name = _in_memory(hf, lora.hf_weight, params)
        module = name.rpartition(".")[0]
        if name not in params:
            raise HFCheckpointError(f"LoRA on Megatron {lora.megatron}: {type(meta).__name__} has "
                                    f"no weight {lora.hf_weight}")
        is_linear = isinstance(modules.get(module), torch.nn.Linear)
        if layout == "fused" and (not is_linear or ".mlp." in name):
            targets.append(PeftTarget(module, name.rpartition(".")[2], ((lora,),), 1))
        elif peft_expert_targets and module.rpartition(".")[2] in peft_expert_targets:
            raise HFCheckpointError(
                f"LoRA on Megatron {lora.megatron}: PEFT {_peft_version()} reads every "
                f"{module.rpartition('.')[2]} target of a per-expert adapter of "
                f"{type(meta).__name__} as expert LoRA, so {module} cannot be exported per "
                f"expert: export with --export-hf-layout fused")
        elif not is_linear and module.rpartition(".")[2] not in (conversion or {}):
            raise HFCheckpointError(
                f"LoRA on Megatron {lora.megatron}: {module} is a "
                f"{type(modules.get(module)).__name__}, which PEFT adapts only as a target "
                f"parameter: export it with --export-hf-layout fused")
        else:
            targets.append(PeftTarget(module, None, ((lora,),), 1))
    if fused_in_memory and conversion is None:
        log.warning("per-expert layout: %s holds its experts fused and PEFT %s converts a "
                    "per-expert adapter only for other model types, so PEFT on transformers "
                    "would leave the expert LoRA out; for PEFT export --export-hf-layout fused",
                    type(meta).__name__, _peft_version())
    for name, experts in fused.items():
        count = params[name].shape[0]
        if sorted(experts) != list(range(count)):
            raise HFCheckpointError(f"{name}: the adapter has LoRA on experts "
                                    f"{sorted(experts)} of {count}; a fused tensor needs all")
        per_expert = []
        for e in range(count):
            parts = [lora for _, lora in sorted(experts[e], key=lambda p: p[0])]
            if len({p.megatron for p in parts}) != 1:
                raise HFCheckpointError(f"{name}: expert {e}'s parts come from different LoRA "
                                        f"modules; they cannot share one fused LoRA")
            per_expert.append(tuple(parts))
        module, _, parameter = name.rpartition(".")
        if getattr(modules[module], "is_transposed", False):
            raise HFCheckpointError(f"{name}: transposed expert tensors are not supported")
        targets.append(PeftTarget(module, parameter, tuple(per_expert), count))
    return _nest(targets, modules)


def per_expert_export_problem(hf: HFModel, lora_targets) -> Optional[str]:
    """Why a per-expert PEFT export of LoRA on ``lora_targets`` of this model cannot work, found
    before training (the export itself refuses the same in ``plan_targets``), or None: PEFT
    converts a per-expert adapter of some model types (Qwen2/3-MoE, DeepSeek) to its fused
    experts, and reads every gate/up/down projection target then as expert LoRA, dense and
    shared MLPs included."""
    conversion = _peft_conversion(hf)
    if not conversion:
        return None
    meta = hf_meta_model(hf)
    params = dict(meta.named_parameters())
    expert_targets = {old for old, new in conversion.items()
                      if any(p.endswith(f".experts.{new}") for p in params)}
    for name in params:
        module = name.rpartition(".")[0]
        if ".experts." in name or module.rpartition(".")[2] not in expert_targets:
            continue
        shared = "shared_expert" in module
        wanted = {"shared_experts"} if shared else {"linear_fc1", "linear_fc2"}
        if wanted & set(lora_targets):
            flag = "shared_experts" if shared else "linear_fc1/linear_fc2"
            return (f"PEFT {_peft_version()} reads every {module.rpartition('.')[2]} target of a "
                    f"per-expert adapter of {type(meta).__name__} as expert LoRA, so LoRA on "
                    f"{module} ({flag} of --lora-target-modules) cannot be exported per expert: "
                    f"use --export-hf-layout fused, or leave {flag} out of the targets")
    return None


def _peft_version() -> str:
    from importlib.metadata import version

    return version("peft")


def _peft_conversion(hf: HFModel) -> Optional[dict]:
    """The module renames PEFT applies when it loads a per-expert adapter of this model type on
    transformers' model, or None where it converts nothing for this type."""
    from megatron_slmoe.compat.peft import moe_target_module_mapping

    model_type = hf.family.peft_model_type(hf.checkpoint.config_path)
    return None if model_type is None else moe_target_module_mapping(model_type)


def _renamed(hf: HFModel, name: str) -> str:
    for rename in hf.family.layouts.renames:
        if name.startswith(rename.canonical):
            return rename.stored + name[len(rename.canonical):]
    return name


def _nest(targets: list[PeftTarget], modules: dict) -> list[PeftTarget]:
    """PEFT wraps the targeted parameters of one module in nested ParamWrappers, the first
    registered innermost: its keys run through one ``.base_layer`` per parameter outside it."""
    by_module: dict[str, list[str]] = {}
    for t in targets:
        if t.parameter is not None:
            by_module.setdefault(t.module, []).append(t.parameter)
    out = []
    for t in targets:
        key_module = t.module
        if t.parameter is not None:
            order = [n for n, _ in modules[t.module].named_parameters(recurse=False)
                     if n in by_module[t.module]]
            key_module += ".base_layer" * (len(order) - 1 - order.index(t.parameter))
        out.append(PeftTarget(t.module, t.parameter, t.loras, t.experts, key_module))
    return out


def _target_modules(targets: list[PeftTarget], meta, hf: HFModel) -> list[str]:
    """Leaf names when they select exactly the adapted modules, else full names."""
    wanted = {t.module for t in targets if t.parameter is None}
    if not wanted:
        return []
    known = {name for name, _ in meta.named_modules()}
    for name, tensor in meta.state_dict(keep_vars=True).items():
        for key, _ in hf.family.layouts.canonical(name, tuple(tensor.shape)):
            known.add(key.rpartition(".")[0])
    leaves = {m.rpartition(".")[2] for m in wanted}
    if {m for m in known | wanted if m.rpartition(".")[2] in leaves} == wanted:
        return sorted(leaves)
    return sorted(wanted)


def _is_expert(target: PeftTarget) -> bool:
    return target.experts > 1 or target.loras[0][0].expert is not None


def peft_config_dict(lora_config, targets: list[PeftTarget], meta, hf: HFModel,
                     base_model_name_or_path: Optional[str],
                     ranks: Optional[dict[str, int]] = None) -> dict:
    """adapter_config.json as PEFT's own ``LoraConfig`` writes it. ``ranks`` (Megatron LoRA
    module -> rank) gives routed experts a rank of their own (``rank_pattern``; alpha is one)."""
    from peft import LoraConfig

    ranks = ranks or {}
    rank_of = lambda t: ranks.get(t.loras[0][0].megatron, lora_config.rank)  # noqa: E731
    dense = {rank_of(t) for t in targets if not _is_expert(t)}
    experts = {rank_of(t) for t in targets if _is_expert(t)}
    if len(dense) > 1 or len(experts) > 1:
        raise HFCheckpointError(f"the adapter's modules have ranks {sorted(dense | experts)}; a "
                                f"PEFT adapter takes one rank and one for the routed experts")
    # r is the experts' rank and the other targets' rank a rank_pattern of their exact names: PEFT
    # turns a per-expert adapter of the types it converts into fused experts of rank r (times the
    # projections fused), whatever rank_pattern says of the experts.
    rank = next(iter(experts or dense), lora_config.rank)
    rank_pattern = {re.escape(f"{t.module}.{t.parameter}" if t.parameter else t.module): rank_of(t)
                    for t in targets if not _is_expert(t) and rank_of(t) != rank}
    parameters = sorted(f"{t.module}.{t.parameter}" for t in targets if t.parameter is not None)
    config = LoraConfig(
        r=rank, lora_alpha=lora_config.alpha, rank_pattern=rank_pattern,
        target_modules=_target_modules(targets, meta, hf) or None,
        target_parameters=parameters or None,
        # PEFT's parameter LoRA has no dropout; inference ignores dropout anyway.
        lora_dropout=0.0 if parameters else lora_config.dropout,
        bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model_name_or_path,
        inference_mode=True)
    document = config.to_dict()
    for key, value in list(document.items()):
        if isinstance(value, set):
            document[key] = sorted(value)
    return json.loads(json.dumps(document, default=str))


def planned_tensors(targets: list[PeftTarget], source) -> list[PlannedTensor]:
    """Every PEFT tensor, produced from the adapter file ``source`` (a WindowedReader); each
    target's rank is its LoRA module's (the routed experts may have their own)."""

    def read(name: str) -> torch.Tensor:
        return source.get_tensor(name)

    def lora_b(lora: HFLoRA) -> torch.Tensor:
        b = read(f"{lora.megatron}.lora_B.weight")
        out = torch.empty(lora.out_features, b.shape[1], dtype=b.dtype)
        for row in lora.rows:
            out[row.hf[0]:row.hf[1]] = b[row.megatron[0]:row.megatron[1]]
        return out

    dtype = _source_dtype(source)
    tensors = []
    for t in targets:
        key = f"{PEFT_KEY_PREFIX}{t.key_module}"
        first = t.loras[0][0]
        rank = source.get_slice(f"{first.megatron}.lora_A.weight").get_shape()[0]
        out = sum(p.out_features for p in t.loras[0])
        if t.experts == 1 and (t.parameter is None or len(t.loras[0]) == 1):
            (lora,) = t.loras[0]
            tensors += [
                PlannedTensor(f"{key}.lora_A.weight", dtype, (rank, first.in_features),
                              lambda lora=lora: read(f"{lora.megatron}.lora_A.weight")),
                PlannedTensor(f"{key}.lora_B.weight", dtype, (out, rank),
                              lambda lora=lora: lora_b(lora))]
            continue
        # A fused 3D parameter: A [E*r, in] expert-major, B [out, r*E] rank-major (PEFT's reshape).
        tensors += [
            PlannedTensor(f"{key}.lora_A.weight", dtype, (t.experts * rank, first.in_features),
                          lambda t=t: torch.cat([read(f"{parts[0].megatron}.lora_A.weight")
                                                 for parts in t.loras])),
            PlannedTensor(f"{key}.lora_B.weight", dtype, (out, rank * t.experts),
                          lambda t=t, out=out: torch.stack(
                              [torch.cat([lora_b(p) for p in parts]) for parts in t.loras],
                              dim=-1).reshape(out, -1))]
    return tensors


def _source_dtype(source) -> torch.dtype:
    names = {v: k for k, v in DTYPE_NAMES.items()}
    return names[source.get_slice(next(iter(source.keys()))).get_dtype()]


def idle_loras(source, module: str, loras: list[HFLoRA]) -> list[HFLoRA]:
    """The HF LoRAs of the Megatron LoRA module ``module`` that add nothing to their weight: all
    of them where its A and B are zero (a module PEFT did not adapt; nothing trains it either), or
    those whose rows of B are zero while others are not (k/v_proj beside an adapted q_proj). B
    zero under a non-zero A is an adapter not yet trained: kept."""
    b = source.get_tensor(f"{module}.lora_B.weight")
    if not b.any():
        return list(loras) if not source.get_tensor(f"{module}.lora_A.weight").any() else []
    return [lora for lora in loras
            if not any(b[r.megatron[0]:r.megatron[1]].any() for r in lora.rows)]


def write_peft_layout(job: ExportJob, staging: str) -> list[dict]:
    """The per-expert and fused layouts' writer (``hf.export_layouts``): adapter_config.json and
    adapter_model.safetensors into ``staging``; returns the manifest's modules."""
    hf, layout = job.hf, job.layout.name
    table = hf.family.table(hf.model_config)
    meta = hf_meta_model(hf)
    weights = os.path.join(job.adapter_dir, ADAPTER_WEIGHTS)
    with WindowedReader(weights) as source:
        shapes = {name: tuple(source.get_slice(name).get_shape()) for name in source.keys()}
        loras = []
        for module in megatron_lora_modules(shapes):
            a, b = shapes.get(f"{module}.lora_A.weight"), shapes.get(f"{module}.lora_B.weight")
            if a is None or b is None:
                raise HFCheckpointError(f"{weights}: {module} has only one LoRA factor")
            own = hf_loras(table, module, b[0], a[1], hf.family.name)
            idle = idle_loras(source, module, own)
            if layout == "fused" and is_expert_module(module) and len(idle) < len(own):
                idle = []  # gate and up share one fused tensor: both or neither
            loras += [lora for lora in own if lora not in idle]
        if not loras:
            raise HFCheckpointError(f"{weights}: every LoRA factor pair is zero; nothing to "
                                    f"export")
        check_shapes(loras, hf, meta)
        targets = plan_targets(loras, hf, meta, layout)
        ranks = {m: shapes[f"{m}.lora_A.weight"][0] for m in megatron_lora_modules(shapes)}
        config = peft_config_dict(job.lora_config, targets, meta, hf,
                                  job.base_model_name_or_path, ranks)
        write_streamed(os.path.join(staging, PEFT_WEIGHTS), planned_tensors(targets, source),
                       metadata={"format": "pt"})
    write_json_atomic(os.path.join(staging, PEFT_CONFIG), config)
    return [module_entry(t.module, ranks[t.loras[0][0].megatron], job.lora_config.alpha,
                         t.parameter, t.experts, t.loras[0][0].megatron) for t in targets]


def export_peft_adapter(adapter_dir: str, hf_dir, output: str, layout: str = "per-expert",
                        base_model_name_or_path: Optional[str] = None) -> str:
    """Write the adapter of ``adapter_dir`` for the HF base ``hf_dir`` in the export layout
    ``layout`` (``hf.export_layouts.LAYOUTS``) into the new (or empty) directory ``output``,
    with its manifest; returns its absolute path. Bad input is one HFCheckpointError /
    AdapterError line and leaves nothing at ``output``."""
    lora_config, _ = read_adapter_config(adapter_dir)
    entry = export_layout(layout, lora_config.expert_layout)
    hf = hf_dir if isinstance(hf_dir, HFModel) else open_hf_checkpoint(hf_dir, check_shapes=False)
    job = ExportJob(adapter_dir, lora_config, hf, entry,
                    base_model_name_or_path or hf.checkpoint.directory)
    output = os.path.abspath(output)
    with atomic_directory(output) as staging:
        modules = entry.write_function()(job, staging)
        write_json_atomic(os.path.join(staging, MANIFEST),
                          manifest(job, modules, os.listdir(staging)))
    return output
