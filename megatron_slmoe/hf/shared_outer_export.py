"""Writers of a shared-outer adapter (``--expert-lora-layout shared-outer``, see
``megatron_slmoe.lora.experts``) for the engines that serve it (``hf.export_layouts``).

Our adapter file holds per MoE layer (r the experts' rank, l their width, f their FFN width,
g = 2 for gated experts)::

    P.experts.linear_fc1.lora_A.weight      [g r, l]  shared: the gate's A, then the up's
    P.experts.E.linear_fc1.lora_B.weight    [g f, r]  expert E: the gate's B, then the up's
    P.experts.E.linear_fc2.lora_A.weight    [r, f]    expert E: the down's A
    P.experts.linear_fc2.lora_B.weight      [l, r]    shared: the down's B

``shared-outer`` (``write_shared_outer``): SGLang's ``--experts-shared-outer-loras`` form, as
miles hands K3's adapter to SGLang: per layer and HF expert projection one grouped tensor with
the expert axis first, the shared factors with an expert axis of 1 (``base_model.model.`` +
the checkpoint's expert module, e.g. ``model.layers.1.mlp.experts.gate_proj``)::

    experts.gate_proj.lora_A.weight [1, r, l]   experts.gate_proj.lora_B.weight [E, f, r]
    experts.up_proj.lora_A.weight   [1, r, l]   experts.up_proj.lora_B.weight   [E, f, r]
    experts.down_proj.lora_A.weight [E, r, f]   experts.down_proj.lora_B.weight [1, l, r]

``shared-outer-expanded`` (``write_shared_outer_expanded``): an exactly equal per-expert adapter
that vLLM and PEFT load as any per-expert one. Each expert's fc1 gets the shared A [g r, l] and
B'_e = g * blockdiag(B_gate,e, B_up,e) [g f, g r]; its fc2 A'_e = [A_e; 0] [g r, f] and
B' = g * [B, 0] [l, g r]: rank g r at scale alpha / (g r), so s' B' A' = s B A for every expert
projection (the padded rows and columns meet zeros). It is then written by the per-expert
writer; every expert carries the shared factors, so the file is per-expert sized.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile

import torch

from megatron_slmoe.families.errors import HFCheckpointError
from megatron_slmoe.hf.export_layouts import LAYOUTS, module_entry
from megatron_slmoe.hf.lora_mapping import hf_loras, megatron_lora_modules
from megatron_slmoe.hf.peft_export import (
    PEFT_CONFIG,
    PEFT_KEY_PREFIX,
    PEFT_WEIGHTS,
    write_peft_layout,
)
from megatron_slmoe.lora.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_config_json,
    module_scales,
    read_adapter_config,
)
from megatron_slmoe.utils.atomic import write_json_atomic

_SHARED_A = re.compile(r"^(?P<prefix>.+\.experts)\.linear_fc1\.lora_A\.weight$")


def _read(adapter_dir: str) -> tuple[object, dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config, base = read_adapter_config(adapter_dir)
    if config.expert_layout != "shared-outer":
        raise HFCheckpointError(f"{adapter_dir}: trained with --expert-lora-layout "
                                f"{config.expert_layout}, not shared-outer")
    return config, base, load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS))


def _layers(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The experts' module prefixes (``decoder.layers.1.mlp.experts``) with shared factors."""
    layers = sorted(m["prefix"] for name in tensors if (m := _SHARED_A.match(name)))
    if not layers:
        raise HFCheckpointError("the adapter has no shared-outer expert factors (LoRA on the "
                                "routed experts' linear_fc1 is needed)")
    return layers


def _experts(tensors: dict, prefix: str) -> list[int]:
    pattern = re.compile(re.escape(prefix) + r"\.(\d+)\.linear_fc1\.lora_B\.weight$")
    return sorted(int(m.group(1)) for name in tensors if (m := pattern.match(name)))


def expand_to_per_expert(adapter_dir: str, output: str) -> None:
    """Write ``adapter_dir``'s shared-outer adapter into ``output`` as the exactly equal
    per-expert adapter of the module doc (our adapter format, the experts at rank g r)."""
    from safetensors.torch import save_file

    config, base, tensors = _read(adapter_dir)
    out = {k: v for k, v in tensors.items() if ".experts." not in k or ".lora_" not in k
           or not re.search(r"\.experts\.(\d+\.)?linear_fc[12]\.", k)}
    expanded_rank = None
    for prefix in _layers(tensors):
        a1 = tensors[f"{prefix}.linear_fc1.lora_A.weight"]
        a2_shared_b = tensors.get(f"{prefix}.linear_fc2.lora_B.weight")
        for e in _experts(tensors, prefix):
            b1 = tensors[f"{prefix}.{e}.linear_fc1.lora_B.weight"]
            r = b1.shape[1]
            g = a1.shape[0] // r
            f = b1.shape[0] // g
            block = b1.new_zeros(g * f, g * r)
            for j in range(g):  # group j of B's rows pairs with A's j-th r rows
                block[j * f:(j + 1) * f, j * r:(j + 1) * r] = b1[j * f:(j + 1) * f]
            out[f"{prefix}.{e}.linear_fc1.lora_A.weight"] = a1.clone()
            out[f"{prefix}.{e}.linear_fc1.lora_B.weight"] = block * g
            if a2_shared_b is not None:
                a2 = tensors[f"{prefix}.{e}.linear_fc2.lora_A.weight"]
                out[f"{prefix}.{e}.linear_fc2.lora_A.weight"] = torch.cat(
                    [a2, a2.new_zeros((g - 1) * r, a2.shape[1])])
                out[f"{prefix}.{e}.linear_fc2.lora_B.weight"] = torch.cat(
                    [a2_shared_b, a2_shared_b.new_zeros(a2_shared_b.shape[0], (g - 1) * r)],
                    dim=1) * g
            expanded_rank = g * r
    expanded = dataclasses.replace(
        config, expert_layout="per-expert", moe_rank_scaling=False,
        expert_rank=0 if expanded_rank == config.rank else expanded_rank)
    os.makedirs(output, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sorted(out.items())},
              os.path.join(output, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(output, ADAPTER_CONFIG), "w", encoding="utf-8") as fh:
        fh.write(adapter_config_json(expanded, base,
                                     module_scales(expanded, {k: v.shape for k, v in out.items()})))


def write_shared_outer_expanded(job, staging: str) -> list[dict]:
    """``shared-outer-expanded``: the expanded per-expert adapter through the per-expert
    writer (``hf.peft_export.write_peft_layout``)."""
    scratch = tempfile.mkdtemp(prefix=".expanded-", dir=os.path.dirname(staging))
    try:
        expand_to_per_expert(job.adapter_dir, scratch)
        config, _ = read_adapter_config(scratch)
        per_expert = dataclasses.replace(job, adapter_dir=scratch, lora_config=config,
                                         layout=LAYOUTS["per-expert"])
        return write_peft_layout(per_expert, staging)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_shared_outer(job, staging: str) -> list[dict]:
    """``shared-outer``: SGLang's grouped expert tensors (module doc) and every other module as
    a PEFT module; adapter_config.json a PEFT LoraConfig (r the experts' rank, the others' a
    rank_pattern) naming the modules."""
    from peft import LoraConfig

    from safetensors.torch import save_file

    config, _, tensors = _read(job.adapter_dir)
    hf = job.hf
    table = hf.family.table(hf.model_config)

    def parts(module: str, a: torch.Tensor, b: torch.Tensor):
        """(HF module with the expert index dropped, its B, the first Megatron row of B it
        takes) per HF weight the Megatron module is made of."""
        for lora in hf_loras(table, module, b.shape[0], a.shape[1], hf.family.name):
            b_part = b.new_empty(lora.out_features, b.shape[1])
            for row in lora.rows:
                b_part[row.hf[0]:row.hf[1]] = b[row.megatron[0]:row.megatron[1]]
            yield (re.sub(r"\.experts\.\d+\.", ".experts.", lora.hf_weight)[:-len(".weight")],
                   b_part, min(row.megatron[0] for row in lora.rows))

    out: dict[str, torch.Tensor] = {}
    modules: list[dict] = []
    ranks: dict[str, int] = {}
    expert_rank = None
    for prefix in _layers(tensors):
        experts = _experts(tensors, prefix)
        grouped: dict[str, list] = {}  # PEFT key -> per expert tensors
        for e in experts:
            a1 = tensors[f"{prefix}.linear_fc1.lora_A.weight"]
            b1 = tensors[f"{prefix}.{e}.linear_fc1.lora_B.weight"]
            r = b1.shape[1]
            f = b1.shape[0] // (a1.shape[0] // r)
            for module, b_part, first in parts(f"{prefix}.{e}.linear_fc1", a1, b1):
                j = first // f  # the gate's or the up's rows: their own r rows of the shared A
                out[f"{PEFT_KEY_PREFIX}{module}.lora_A.weight"] = a1[j * r:(j + 1) * r][None]
                grouped.setdefault(f"{PEFT_KEY_PREFIX}{module}.lora_B.weight", []).append(b_part)
                modules.append(module_entry(module, r, config.alpha, None, len(experts),
                                            f"{prefix}.*.linear_fc1"))
            a2 = tensors.get(f"{prefix}.{e}.linear_fc2.lora_A.weight")
            if a2 is not None:
                b2 = tensors[f"{prefix}.linear_fc2.lora_B.weight"]
                for module, b_part, _ in parts(f"{prefix}.{e}.linear_fc2", a2, b2):
                    grouped.setdefault(f"{PEFT_KEY_PREFIX}{module}.lora_A.weight", []).append(a2)
                    out[f"{PEFT_KEY_PREFIX}{module}.lora_B.weight"] = b_part[None]
                    modules.append(module_entry(module, r, config.alpha, None, len(experts),
                                                f"{prefix}.*.linear_fc2"))
            expert_rank = r
        for key, per_expert in grouped.items():
            out[key] = torch.stack(per_expert)
    experts_lora = re.compile(r"\.experts\.(\d+\.)?linear_fc[12]\.lora_")
    for module in megatron_lora_modules(k for k in tensors if not experts_lora.search(k)):
        a, b = tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"]
        for hf_module, b_part, _ in parts(module, a, b):
            out[f"{PEFT_KEY_PREFIX}{hf_module}.lora_A.weight"] = a
            out[f"{PEFT_KEY_PREFIX}{hf_module}.lora_B.weight"] = b_part
            ranks[hf_module] = a.shape[0]
            modules.append(module_entry(hf_module, a.shape[0], config.alpha, None, 1, module))
    save_file({k: v.contiguous().clone() for k, v in sorted(out.items())},  # no shared storage
              os.path.join(staging, PEFT_WEIGHTS), metadata={"format": "pt"})
    targets = sorted({m["module"] for m in modules})
    peft_config = LoraConfig(
        r=expert_rank, lora_alpha=config.alpha, target_modules=targets,
        rank_pattern={re.escape(m): r for m, r in ranks.items() if r != expert_rank},
        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
        base_model_name_or_path=job.base_model_name_or_path, inference_mode=True).to_dict()
    peft_config = {k: sorted(v) if isinstance(v, set) else v for k, v in peft_config.items()}
    write_json_atomic(os.path.join(staging, PEFT_CONFIG), peft_config, default=str)
    return modules
