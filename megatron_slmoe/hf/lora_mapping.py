"""LoRA adapters between Megatron module names and Hugging Face weights, from the same mapping
tables as the weights.

A Megatron LoRA module ``M`` (``s * B A`` added to the weight ``W`` [out, in] of ``M``) maps to a
LoRA on every HF weight that ``W``'s rule takes rows from: A is the module's A (the input
dimension is never split: a piece that splits it is refused), B is the rows of the module's B that
the rule gives that HF weight. This is exact: a gated ``linear_fc1`` [gate; up] gives gate_proj
and up_proj the same A and the two halves of B; ``linear_qkv`` gives q/k/v_proj their grouped rows.
Routed experts are stored one adapter per global expert (``...mlp.experts.5.linear_fc1``) and map
through the per-expert inner rule of ``...mlp.experts.fc1_weight``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from megatron_slmoe.families.errors import HFCheckpointError
from megatron_slmoe.families.kinds import MappingTable, PerExpert

# A routed expert's LoRA module: ``<prefix>.experts.<global expert>.linear_fc1`` (adapter naming).
_EXPERT_MODULE = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.linear_(?P<fc>fc[12])$")


def is_expert_module(module: str) -> bool:
    """Whether a LoRA module name is one routed expert's (``...experts.5.linear_fc1``)."""
    return _EXPERT_MODULE.match(module) is not None


# The LoRA target (``megatron_slmoe.lora.targets``) that adapts the Megatron weight of a table rule,
# by the end of the rule's name; the modules PEFT import must give an adapter file.
LORA_TARGET_OF_RULE = (
    (".self_attention.linear_qkv.weight", "linear_qkv"),
    (".self_attention.linear_q_proj.weight", "linear_qkv"),  # multi-latent attention
    (".self_attention.linear_q_down_proj.weight", "linear_qkv"),
    (".self_attention.linear_q_up_proj.weight", "linear_qkv"),
    (".self_attention.linear_kv_down_proj.weight", "linear_qkv"),
    (".self_attention.linear_kv_up_proj.weight", "linear_qkv"),
    (".self_attention.linear_gate.weight", "linear_qkv"),  # gated NoPE MLA's output gate
    *((f".self_attention.{name}.weight", "linear_qkv")  # linear attention (KDA)
      for name in ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "f_a_proj", "f_b_proj")),
    (".self_attention.linear_proj.weight", "linear_proj"),
    (".self_attention.o_proj.weight", "linear_proj"),
    (".mlp.shared_experts.linear_fc1.weight", "shared_experts"),
    (".mlp.shared_experts.linear_fc2.weight", "shared_experts"),
    (".mlp.linear_fc1.weight", "linear_fc1"),
    (".mlp.linear_fc2.weight", "linear_fc2"),
    (".mlp.experts.fc1_weight", "linear_fc1"),
    (".mlp.experts.fc2_weight", "linear_fc2"),
    (".mlp.router.weight", "router"),
    (".mlp.latent_down.weight", "latent"),
    (".mlp.latent_up.weight", "latent"),
)


@dataclass(frozen=True)
class RowMap:
    """Rows ``megatron`` of the Megatron module's B are rows ``hf`` of the HF weight's B."""

    megatron: tuple[int, int]
    hf: tuple[int, int]


@dataclass(frozen=True)
class HFLoRA:
    """The LoRA of one HF weight (canonical name as checkpoints store it), made from the Megatron
    LoRA module ``megatron``: A is the module's A, B is assembled from the module's B by
    ``rows``."""

    hf_weight: str
    megatron: str
    expert: Optional[int]
    """Global expert index of a routed expert's weight, else None."""
    out_features: int
    in_features: int
    rows: tuple[RowMap, ...]


def megatron_lora_modules(tensor_names) -> list[str]:
    """The LoRA module names of an adapter's tensor names (``M.lora_A.weight`` ...), in order."""
    modules = []
    for name in tensor_names:
        for suffix in (".lora_A.weight", ".lora_B.weight"):
            if name.endswith(suffix) and name[:-len(suffix)] not in modules:
                modules.append(name[:-len(suffix)])
    return modules


def hf_loras(table: MappingTable, module: str, out_features: int, in_features: int,
             family: str) -> list[HFLoRA]:
    """The HF LoRAs that Megatron LoRA module ``module`` (B [out, r], A [r, in]) is made of.
    Raises HFCheckpointError (one line) for a module the family's table has no rule for, or one
    whose rule does not split into whole rows of HF weights."""
    expert = _EXPERT_MODULE.match(module)
    weight = (f"{expert['prefix']}.{expert['fc']}_weight" if expert else f"{module}.weight")
    found = table.match(weight)
    if found is None:
        raise HFCheckpointError(f"LoRA on Megatron {module}: the {family} model has no HF weight "
                                f"for it (no rule for {weight})")
    rule, names = found
    kind = rule.kind
    if expert:
        if not isinstance(kind, PerExpert):
            raise HFCheckpointError(f"LoRA on Megatron {module}: {weight} is not per expert")
        kind, names = kind.inner, {**names, "expert": int(expert["expert"])}
    try:
        pieces = kind.pieces((out_features, in_features), names)
    except ValueError as err:
        raise HFCheckpointError(f"LoRA on Megatron {module} [{out_features}, {in_features}] does "
                                f"not fit the {family} model: {err}") from None
    by_weight: dict[str, list] = {}
    for piece in pieces:
        if (len(piece.meg_box) != 2 or piece.meg_box[1] != (0, in_features)
                or piece.hf_dims != (0, 1) or piece.hf_start[1] != 0
                or piece.hf_shape[1] != in_features):
            raise HFCheckpointError(f"LoRA on Megatron {module}: {piece.hf_key} takes part of the "
                                    f"input dimension; only whole-row mappings carry a LoRA")
        by_weight.setdefault(piece.hf_key, []).append(piece)
    result = []
    for hf_weight, group in by_weight.items():
        out = group[0].hf_shape[0]
        rows = tuple(RowMap(p.meg_box[0], (p.hf_start[0], p.hf_start[0] + p.meg_box[0][1]
                                           - p.meg_box[0][0])) for p in group)
        if sorted(r.hf for r in rows) != _tiling(sorted(r.hf for r in rows), out):
            raise HFCheckpointError(f"LoRA on Megatron {module}: its rows do not cover "
                                    f"{hf_weight} exactly")
        result.append(HFLoRA(hf_weight, module, int(expert["expert"]) if expert else None, out,
                             in_features, rows))
    return result


def _tiling(spans, total):
    """``spans`` if they tile [0, total) without gaps or overlaps, else a marker that differs."""
    at = 0
    for lo, hi in spans:
        if lo != at:
            return None
        at = hi
    return spans if at == total else None
