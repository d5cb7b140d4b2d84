"""Import a PEFT LoRA adapter of a Hugging Face base as a megatron_slmoe adapter (``--adapter-init``
with a PEFT adapter, ``slmoe-convert-hf import-adapter``).

Every PEFT target (a module, a 2-D parameter, or a fused 3D expert parameter: one LoRA per
expert) is a LoRA ``s_t B_t A_t`` on one or more HF weights (a fused ``gate_up_proj`` covers
gate_proj and up_proj of each expert). A Megatron LoRA module whose weight is made of several HF
weights (``linear_qkv`` of q/k/v_proj, ``linear_fc1`` of gate/up_proj) gets the PEFT targets
stacked: A is the targets' A one above the other, B is block diagonal with each target's B (times
its scaling ``s_t``, over the module's) in the rows the weight table gives its HF weights.
That is exact; the Megatron rank is the largest such stack (smaller ones zero-padded). The
module's scale is PEFT's own where every adapted dense module (none adapted: every expert's) has
one PEFT scaling, so B is PEFT's B unchanged; else 1 (rank_pattern, alpha_pattern, rsLoRA in B).

A LoRA target adapts all its modules, so a module that PEFT did not adapt inside an adapted
target (the dense MLP of an experts-only adapter, k/v_proj beside a q_proj in linear_qkv) gets
zero factors: no LoRA in effect, and the PEFT export leaves such zero LoRAs out again
(``peft_export.adds_nothing``). The mapping is ``hf.lora_mapping`` over the family's weight
table, as for export.

Refused, one line each: not LoRA, DoRA, a bias, fan_in_fan_out, a tensor that is not a LoRA
factor (modules_to_save, embedding LoRA, trainable tokens), no LoRA at all, a key no HF weight of
the base has, a factor whose shape disagrees with the base, a stacked rank over the largest.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_slmoe.families.errors import HFCheckpointError
from megatron_slmoe.families.kinds import PerExpert
from megatron_slmoe.hf.loader import HFModel, open_hf_checkpoint
from megatron_slmoe.hf.lora_mapping import LORA_TARGET_OF_RULE, hf_loras, is_expert_module
from megatron_slmoe.hf.peft_export import PEFT_CONFIG, PEFT_KEY_PREFIX, PEFT_WEIGHTS, hf_meta_model
from megatron_slmoe.hf.safetensors_stream import PlannedTensor, write_streamed
from megatron_slmoe.lora.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    FORMAT_VERSION,
    TENSOR_NAMING,
    adapter_config_json,
    module_scales,
)
from megatron_slmoe.lora.config import MAX_LORA_RANK, LoRAConfig
from megatron_slmoe.lora.targets import TARGETS
from megatron_slmoe.utils.atomic import atomic_directory, write_text_atomic


log = logging.getLogger(__name__)


def is_peft_adapter(directory: str) -> bool:
    """Whether ``directory`` holds a PEFT adapter (its adapter_config.json names a peft_type)."""
    try:
        with open(os.path.join(directory, PEFT_CONFIG), encoding="utf-8") as fh:
            return "peft_type" in json.load(fh)
    except (OSError, ValueError):
        return False


def read_peft_config(directory: str) -> dict:
    path = os.path.join(directory, PEFT_CONFIG)
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError) as err:
        raise HFCheckpointError(f"{path}: cannot read ({err})") from None
    refuse = {"peft_type": config.get("peft_type") != "LORA", "use_dora": config.get("use_dora"),
              "bias": config.get("bias", "none") != "none", "lora_bias": config.get("lora_bias"),
              "fan_in_fan_out": config.get("fan_in_fan_out")}
    for option, bad in refuse.items():
        if bad:
            raise HFCheckpointError(f"{path}: {option} {config.get(option)!r} is not supported "
                                    f"(plain LoRA only)")
    return config


@dataclass(frozen=True)
class SourceBlock:
    """One PEFT LoRA as it acts on one HF weight: rows ``rows`` of (B [out_t, r] of target
    ``key`` (expert ``expert`` of a fused target)) are that weight's B, with A [r, in]."""

    key: str
    expert: Optional[int]
    experts: int
    rows: tuple[int, int]
    scaling: float


def _scaling(config: dict, names: list[str], rank: int) -> float:
    from peft.utils.other import get_pattern_key

    alpha = config.get("lora_alpha", 8)
    pattern = config.get("alpha_pattern") or {}
    for name in names:
        key = get_pattern_key(list(pattern), name)
        if key in pattern:
            alpha = pattern[key]
            break
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def peft_blocks(directory: str, hf: HFModel, meta, config: dict, shapes: dict
                ) -> dict[str, SourceBlock]:
    """Canonical HF weight name -> the PEFT LoRA that acts on it."""
    params = dict(meta.named_parameters())
    modules = dict(meta.named_modules())
    targeted = config.get("target_parameters") or []
    blocks: dict[str, SourceBlock] = {}
    weights = os.path.join(directory, PEFT_WEIGHTS)
    other = sorted(k for k in shapes if not k.endswith((".lora_A.weight", ".lora_B.weight")))
    if other:  # a full weight (modules_to_save), embedding LoRA, trainable tokens
        raise HFCheckpointError(f"{weights}: {other[0]} is not a LoRA factor of a linear "
                                f"weight; only those are imported")
    if not any(k.endswith(".lora_A.weight") for k in shapes):
        raise HFCheckpointError(f"{weights}: holds no LoRA factor")
    for a_key in [k for k in shapes if k.endswith(".lora_A.weight")]:
        key = a_key[:-len(".lora_A.weight")]
        b_shape, a_shape = shapes.get(f"{key}.lora_B.weight"), shapes[a_key]
        if b_shape is None or not key.startswith(PEFT_KEY_PREFIX):
            raise HFCheckpointError(f"{weights}: {a_key} is not a PEFT LoRA key of a base model")
        path = key[len(PEFT_KEY_PREFIX):]
        depth = 0
        while path.endswith(".base_layer"):
            path, depth = path[:-len(".base_layer")], depth + 1
        own = [n for n, _ in modules[path].named_parameters(recurse=False)
               if any(f"{path}.{n}" == t or f"{path}.{n}".endswith(f".{t}") for t in targeted)
               ] if path in modules else []
        if own:  # a parameter target: nested wrappers, the first registered innermost
            if depth >= len(own):
                raise HFCheckpointError(f"{weights}: {a_key} nests deeper than {path}'s "
                                        f"targeted parameters {own}")
            name = f"{path}.{own[len(own) - 1 - depth]}"
            shape = tuple(params[name].shape)
        else:
            name = f"{path}.weight"
            shape = None
        canonical = hf.family.layouts.canonical(name, shape) if shape else [(name, None)]
        if len(canonical) == 1 and (shape is None or len(shape) == 2):
            weight = _canonical_name(hf, canonical[0][0])
            experts, r = 1, a_shape[0]
            targets = [(weight, None, (0, b_shape[0]))]
        else:  # a fused 3D expert parameter: canonical parts are expert-major
            experts = shape[0]
            r = a_shape[0] // experts
            per_expert = len(canonical) // experts
            targets, row = [], 0
            for i, (weight, part_shape) in enumerate(canonical):
                if i % per_expert == 0:
                    row = 0
                targets.append((weight, i // per_expert, (row, row + part_shape[0])))
                row += part_shape[0]
        scaling = _scaling(config, [path, name], r)
        for weight, expert, rows in targets:
            blocks[weight] = SourceBlock(key, expert, experts, rows, scaling)
    return blocks


def _canonical_name(hf: HFModel, name: str) -> str:
    for rename in hf.family.layouts.renames:
        if name.startswith(rename.stored):
            return rename.canonical + name[len(rename.stored):]
    return name


def megatron_modules(hf: HFModel, weights: dict) -> list[tuple[str, str, int, int]]:
    """(Megatron LoRA module, LoRA target, out, in) of every module the model has for the LoRA
    targets that the HF weights ``weights`` (canonical name -> shape) belong to; HF weights are
    those of the base model."""
    table = hf.family.table(hf.model_config)
    layers = hf.model_config.transformer["num_layers"]
    experts = hf.model_config.transformer.get("num_moe_experts") or 0
    found = []
    for rule in table.rules:
        target = next((t for suffix, t in LORA_TARGET_OF_RULE if rule.megatron.endswith(suffix)),
                      None)
        if target is None:
            continue
        per_expert = isinstance(rule.kind, PerExpert)
        kind = rule.kind.inner if per_expert else rule.kind
        for layer in range(layers):
            for expert in range(experts if per_expert else 1):
                names = table.names({"layer": layer, "expert": expert})
                hf_names = [t.format(**names) for t in kind.hf_templates()]
                if not all(n in weights for n in hf_names):
                    continue
                out = sum(weights[n][0] for n in dict.fromkeys(hf_names))
                module = rule.megatron.format(**names)
                if per_expert:  # ...experts.fc1_weight -> ...experts.<e>.linear_fc1
                    stacked, weight = module.rsplit(".", 1)
                    module = f"{stacked}.{expert}.linear_{weight[:3]}"
                else:
                    module = module[:-len(".weight")]
                found.append((module, target, out, weights[hf_names[0]][1]))
    return found


def _warn_if_another_base(config: dict, hf: HFModel, peft_dir: str) -> None:
    """A PEFT adapter names the base it was made for; a different one may still fit every shape
    (a sibling checkpoint, another vocabulary without LoRA on the embedding), so say so."""
    named = config.get("base_model_name_or_path")
    if not named:
        return
    directory = os.path.abspath(hf.checkpoint.directory)
    try:
        with open(hf.checkpoint.config_path, encoding="utf-8") as f:
            own = json.load(f).get("_name_or_path")
    except (OSError, ValueError):
        own = None
    if named in (directory, own) or os.path.basename(named.rstrip("/")) == os.path.basename(
            directory):
        return
    log.warning("PEFT adapter %s was made for base %r, and is loaded onto %s%s: its shapes fit, "
                "but check that it is the model it was trained on", peft_dir, named, directory,
                f" ({own})" if own else "")


def peft_to_adapter(peft_dir: str, hf_dir, output: str, dropout: Optional[float] = None) -> str:
    """Write the megatron_slmoe adapter of the PEFT adapter ``peft_dir`` for the HF base
    ``hf_dir`` into the new (or empty) directory ``output``; returns its path."""
    from safetensors import safe_open

    config = read_peft_config(peft_dir)
    hf = hf_dir if isinstance(hf_dir, HFModel) else open_hf_checkpoint(hf_dir, check_shapes=False)
    _warn_if_another_base(config, hf, peft_dir)
    meta = hf_meta_model(hf)
    weights = {}
    for name, tensor in meta.state_dict(keep_vars=True).items():
        weights.update(hf.family.layouts.canonical(name, tuple(tensor.shape)))
    path = os.path.join(peft_dir, PEFT_WEIGHTS)
    try:
        source = safe_open(path, framework="pt", device="cpu")
    except Exception as err:  # noqa: BLE001 (safetensors raises untyped errors)
        raise HFCheckpointError(f"{path}: not a readable safetensors file ({err})") from None
    shapes = {k: tuple(source.get_slice(k).get_shape()) for k in source.keys()}
    blocks = peft_blocks(peft_dir, hf, meta, config, shapes)
    for weight in blocks:
        if weight not in weights:
            raise HFCheckpointError(f"{path}: LoRA on {weight}, which the base "
                                    f"{hf.checkpoint.config_path} does not have")
    table = hf.family.table(hf.model_config)
    adapted = {}
    for module, target, out, in_features in megatron_modules(hf, weights):
        loras = hf_loras(table, module, out, in_features, hf.family.name)
        adapted[module] = (target, out, in_features,
                           [(lora, blocks[lora.hf_weight]) for lora in loras
                            if lora.hf_weight in blocks])
    targets = {t for t, _, _, used in adapted.values() if used}
    modules = {m: v for m, v in adapted.items() if v[0] in targets}
    covered = {lora.hf_weight for _, _, _, used in modules.values() for lora, _ in used}
    if covered != set(blocks):
        missing = sorted(set(blocks) - covered)[0]
        raise HFCheckpointError(f"{path}: LoRA on {missing}, which no Megatron LoRA target maps "
                                f"to")

    def stacked(used):
        """The distinct PEFT LoRAs of one module in order: (key, expert) -> column offset."""
        order: dict = {}
        for _, block in used:
            order.setdefault((block.key, block.expert), None)
        return list(order)

    def r_of(key):
        return shapes[f"{key}.lora_A.weight"][0] // _experts(key)

    def _experts(key):
        return next(b.experts for b in blocks.values() if b.key == key)

    # The routed experts keep a rank of their own (PEFT's rank_pattern). Only modules PEFT
    # adapted count: the others get zero factors of their kind's rank.
    def needed(expert: bool) -> list[int]:
        return [sum(r_of(k) for k, _ in stacked(used)) for module, (*_, used) in modules.items()
                if used and is_expert_module(module) == expert]

    rank = max(needed(False) or needed(True))
    expert_rank = max(needed(True) or [rank])
    if max(rank, expert_rank) > MAX_LORA_RANK:
        raise HFCheckpointError(f"{path}: its LoRAs stack to rank {max(rank, expert_rank)} in "
                                f"one Megatron module, over the largest, {MAX_LORA_RANK}")
    # alpha: PEFT's own scale on the dense modules (none adapted: the experts), when one, so their
    # B is PEFT's unchanged and an export gives PEFT's tensors back; else a scale of 1.
    # (With no dense module adapted, rank is the experts'.)
    reference = {b.scaling for m, (*_, used) in modules.items() for _, b in used
                 if is_expert_module(m) == (not needed(False))}
    alpha = rank * (min(reference) if len(reference) == 1 and min(reference) > 0 else 1.0)

    def rank_of(module: str) -> int:
        return expert_rank if is_expert_module(module) else rank

    for key in {b.key for b in blocks.values()}:
        a, b = shapes[f"{key}.lora_A.weight"], shapes[f"{key}.lora_B.weight"]
        if a[0] != b[1]:
            raise HFCheckpointError(f"{path}: {key} has A {list(a)} and B {list(b)}")

    cache: dict = {}

    def factor(key, which):
        name = f"{key}.lora_{which}.weight"
        if name not in cache:
            cache.clear()  # a fused target is read once for all its experts, one at a time
            cache[name] = source.get_tensor(name).float()
        return cache[name]

    def expert_factors(key, expert, experts):
        a, b = factor(key, "A"), factor(key, "B")
        if expert is None:
            return a, b
        r = a.shape[0] // experts
        return (a.reshape(experts, r, -1)[expert],
                b.reshape(b.shape[0], r, experts)[:, :, expert])

    planned = []
    for module, (_, out, in_features, used) in modules.items():
        columns = stacked(used)
        r_module = rank_of(module)
        module_scaling = alpha / r_module

        def make_a(columns=columns, in_features=in_features, used=used, rank=r_module):
            result = torch.zeros(rank, in_features)
            col = 0
            for key, expert in columns:
                experts = next(b.experts for _, b in used if b.key == key)
                a, _ = expert_factors(key, expert, experts)
                result[col:col + a.shape[0]] = a
                col += a.shape[0]
            return result

        def make_b(columns=columns, out=out, used=used, rank=r_module, s=module_scaling):
            result = torch.zeros(out, rank)
            offsets, col = {}, 0
            for key, expert in columns:
                offsets[key, expert] = col
                col += r_of(key)
            for lora, block in used:
                _, b = expert_factors(block.key, block.expert, block.experts)
                start = offsets[block.key, block.expert]
                part = b[block.rows[0]:block.rows[1]]
                if not math.isclose(block.scaling, s, rel_tol=1e-12):  # B as PEFT's, if it can
                    part = part * (block.scaling / s)
                if part.shape[0] != lora.out_features:
                    raise HFCheckpointError(f"{path}: {block.key} gives {lora.hf_weight} "
                                            f"{part.shape[0]} rows, the base has "
                                            f"{lora.out_features}")
                for row in lora.rows:
                    result[row.megatron[0]:row.megatron[1], start:start + part.shape[1]] = \
                        part[row.hf[0]:row.hf[1]]
            return result

        planned += [PlannedTensor(f"{module}.lora_A.weight", torch.float32,
                                  (r_module, in_features), make_a),
                    PlannedTensor(f"{module}.lora_B.weight", torch.float32, (out, r_module),
                                  make_b)]
    lora_config = LoRAConfig(rank=rank, alpha=alpha,
                             expert_rank=expert_rank if expert_rank != rank else 0,
                             targets=[t for t in TARGETS if t in targets],
                             dropout=float(config.get("lora_dropout", 0.0) if dropout is None
                                           else dropout))
    lora_config.validate()
    output = os.path.abspath(output)
    with atomic_directory(output) as staging:
        write_streamed(os.path.join(staging, ADAPTER_WEIGHTS), planned,
                       metadata={"format": "pt", "format_version": str(FORMAT_VERSION),
                                 "tensor_naming": TENSOR_NAMING})
        write_text_atomic(os.path.join(staging, ADAPTER_CONFIG), adapter_config_json(
            lora_config, {"hf_checkpoint": hf.checkpoint.directory, "peft_adapter": peft_dir},
            module_scales(lora_config, {p.name: p.shape for p in planned})))
    source.__exit__(None, None, None)
    return output
