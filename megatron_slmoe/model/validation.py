"""Checks of an MoE model configuration: every invalid combination is one ConfigError line
naming the Megatron command-line flag to change.

``validate_moe_config(fields, ...)`` runs on the TransformerConfig field dict *before* the
TransformerConfig is built (Megatron's own checks raise asserts or multi-line tracebacks, and
some combinations it accepts only fail deep inside the router). ``make_transformer_config(fields)``
builds the TransformerConfig and turns whatever Megatron still raises into a ConfigError line.
``flag(field)`` spells a TransformerConfig field as its Megatron command-line flag (run settings
carry theirs in ``megatron_slmoe.config``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Mapping

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.config.types import is_int, is_number
from megatron_slmoe.moe.config import check_expert_tensor_parallel
from megatron_slmoe.ops.activations import is_fused_glu

# Fields whose Megatron flag is not "--" + the field name with dashes (Megatron's own
# ``argparse_meta`` names are read from the dataclass metadata in ``flag``).
_FLAG_EXCEPTIONS = {
    "num_moe_experts": "--num-experts",
    "gated_linear_unit": "--swiglu",
    "max_sequence_length": "--max-position-embeddings",
    "share_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
}

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
ROUTER_DTYPES = (None, "fp32", "fp64")


@functools.lru_cache(maxsize=None)
def _transformer_fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(TransformerConfig)}


def flag(field: str) -> str:
    """The Megatron command-line flag that sets ``field``."""
    if field in _FLAG_EXCEPTIONS:
        return _FLAG_EXCEPTIONS[field]
    meta = _transformer_fields().get(field)
    names = meta.metadata.get("argparse_meta", {}).get("arg_names") if meta is not None else None
    if names:
        return names[0]
    return "--" + field.replace("_", "-")


def _default(field: str) -> Any:
    f = _transformer_fields()[field]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


class _Fields:
    """Typed reads of the field dict: a value of the wrong type is itself a ConfigError."""

    def __init__(self, fields: Mapping[str, Any]) -> None:
        self.fields = fields

    def get(self, name: str) -> Any:
        return self.fields[name] if name in self.fields else _default(name)

    def int(self, name: str, *, optional: bool = True) -> int | None:
        value = self.get(name)
        if value is None and optional:
            return None
        if not is_int(value):
            raise ConfigError(f"{flag(name)} must be an integer, got {value!r}")
        return value

    def number(self, name: str) -> float | None:
        value = self.get(name)
        if value is not None and not is_number(value):
            raise ConfigError(f"{flag(name)} must be a number, got {value!r}")
        return value

    def bool(self, name: str) -> bool:
        value = self.get(name)
        if not isinstance(value, bool):
            raise ConfigError(f"{flag(name)} must be true or false, got {value!r}")
        return value


def validate_moe_config(fields: Mapping[str, Any], *, tensor_parallel: int = 1,
                        expert_parallel: int = 1, expert_tensor_parallel: int = 1,
                        pipeline_parallel: int = 1) -> None:
    """Raise ConfigError (one line, naming the flag) for the first invalid setting in ``fields``
    (TransformerConfig field names; missing fields take Megatron's defaults)."""
    f = _Fields(fields)
    _check_layers(f, pipeline_parallel)
    if f.get("num_moe_experts") is None:
        return
    experts = f.int("num_moe_experts", optional=False)
    if experts < 1:
        raise ConfigError(f"--num-experts must be at least 1, got {experts}")
    _check_parallel(f, experts, tensor_parallel, expert_parallel, expert_tensor_parallel)
    _check_widths(f)
    _check_topk(f, experts)
    _check_score_function(f)
    _check_load_balancing(f)
    _check_layer_freq(f)


def _check_layers(f: _Fields, pipeline_parallel: int) -> None:
    layers = f.int("num_layers", optional=False)
    if layers < 1:
        raise ConfigError(f"--num-layers must be at least 1, got {layers}")
    uneven = any(f.get(name) is not None for name in (
        "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
        "pipeline_model_parallel_layout"))
    if not uneven and layers % pipeline_parallel:
        raise ConfigError(f"--num-layers {layers} is not divisible by "
                          f"--pipeline-model-parallel-size {pipeline_parallel}")


def _check_parallel(f: _Fields, experts: int, tp: int, ep: int, etp: int) -> None:
    if experts % ep:
        raise ConfigError(f"--num-experts {experts} is not divisible by "
                          f"--expert-model-parallel-size {ep}")
    check_expert_tensor_parallel(etp)
    if tp > 1 and not f.bool("sequence_parallel"):
        raise ConfigError(f"MoE with --tensor-model-parallel-size {tp} needs --sequence-parallel")


def _check_widths(f: _Fields) -> None:
    hidden = f.int("hidden_size", optional=False)
    ffn = f.int("moe_ffn_hidden_size")
    if ffn is None or ffn < 1:
        raise ConfigError(f"--moe-ffn-hidden-size must be set to a positive width for an MoE "
                          f"model, got {ffn!r}")
    latent = f.int("moe_latent_size")
    if latent is not None and latent < 1:
        raise ConfigError(f"--moe-latent-size must be at least 1, got {latent} (leave it unset "
                          f"for experts at the full hidden width)")
    if latent is not None and latent >= hidden:
        raise ConfigError(f"--moe-latent-size {latent} must be smaller than --hidden-size "
                          f"{hidden}")
    shared = f.int("moe_shared_expert_intermediate_size")
    if shared is not None and shared < 1:
        raise ConfigError(f"--moe-shared-expert-intermediate-size must be positive, got {shared} "
                          f"(leave it unset for no shared expert)")


def _check_topk(f: _Fields, experts: int) -> None:
    topk = f.int("moe_router_topk", optional=False)
    if topk < 1:
        raise ConfigError(f"--moe-router-topk must be at least 1, got {topk}")
    if topk > experts:
        raise ConfigError(f"--moe-router-topk {topk} is larger than --num-experts {experts}")
    groups, group_topk = f.int("moe_router_num_groups"), f.int("moe_router_group_topk")
    if groups is None and group_topk is None:
        return
    if group_topk is None:
        raise ConfigError("--moe-router-num-groups is set but --moe-router-group-topk is not "
                          "(group-limited routing needs both)")
    if groups is None:
        raise ConfigError("--moe-router-group-topk is set but --moe-router-num-groups is not "
                          "(group-limited routing needs both)")
    if groups < 1:
        raise ConfigError(f"--moe-router-num-groups must be at least 1, got {groups}")
    if group_topk < 1:
        raise ConfigError(f"--moe-router-group-topk must be at least 1, got {group_topk}")
    if experts % groups:
        raise ConfigError(f"--num-experts {experts} is not divisible by "
                          f"--moe-router-num-groups {groups}")
    if group_topk > groups:
        raise ConfigError(f"--moe-router-group-topk {group_topk} is larger than "
                          f"--moe-router-num-groups {groups}")
    reachable = group_topk * (experts // groups)
    if topk > reachable:
        raise ConfigError(f"--moe-router-topk {topk} is larger than the {reachable} experts in "
                          f"--moe-router-group-topk {group_topk} groups of {experts // groups}")
    if topk < group_topk:
        # Megatron scores a group by its top (topk // group_topk) experts: zero of them here.
        raise ConfigError(f"--moe-router-group-topk {group_topk} is larger than "
                          f"--moe-router-topk {topk}: groups would be chosen on no scores")


def _check_score_function(f: _Fields) -> None:
    score = f.get("moe_router_score_function")
    if score not in SCORE_FUNCTIONS:
        raise ConfigError(f"--moe-router-score-function must be one of "
                          f"{', '.join(SCORE_FUNCTIONS)}, got {score!r}")
    pre_softmax = f.bool("moe_router_pre_softmax")
    if score == "sigmoid" and pre_softmax:
        raise ConfigError("--moe-router-pre-softmax is a softmax option; sigmoid routing "
                          "always scores before top-k (drop it or use softmax)")
    if score == "softmax" and f.bool("moe_router_enable_expert_bias"):
        # Megatron rejects this too: the aux-loss-free bias is defined for sigmoid scores.
        raise ConfigError("--moe-router-enable-expert-bias needs --moe-router-score-function "
                          "sigmoid")
    topk = f.int("moe_router_topk", optional=False)
    if (score == "softmax" and topk == 1 and not pre_softmax
            and f.get("moe_router_load_balancing_type") != "sinkhorn"):
        raise ConfigError("--moe-router-topk 1 with softmax routing needs "
                          "--moe-router-pre-softmax (softmax over one expert has no gradient)")
    scaling = f.number("moe_router_topk_scaling_factor")
    if scaling is not None and scaling <= 0:
        raise ConfigError(f"--moe-router-topk-scaling-factor must be positive, got {scaling}")
    rate = f.number("moe_router_bias_update_rate")
    if rate is None or rate < 0:
        raise ConfigError(f"--moe-router-bias-update-rate must be non-negative, got {rate!r}")
    dtype = f.get("moe_router_dtype")
    if dtype not in ROUTER_DTYPES:
        raise ConfigError(f"--moe-router-dtype must be fp32 or fp64 (or unset), got {dtype!r}")


def _check_load_balancing(f: _Fields) -> None:
    types, coeffs = f.get("moe_router_load_balancing_type"), f.get("moe_aux_loss_coeff")
    type_list = types if isinstance(types, list) else [types]
    for kind in type_list:
        if kind not in LOAD_BALANCING_TYPES:
            raise ConfigError(f"--moe-router-load-balancing-type {kind!r} is not one of "
                              f"{', '.join(LOAD_BALANCING_TYPES)}")
    if len(set(type_list)) != len(type_list):
        raise ConfigError(f"--moe-router-load-balancing-type lists a type twice: {types}")
    if isinstance(types, list) != isinstance(coeffs, list) or (
            isinstance(types, list) and len(types) != len(coeffs)):
        raise ConfigError(f"--moe-aux-loss-coeff must give one coefficient per "
                          f"--moe-router-load-balancing-type: {coeffs!r} for {types!r}")
    coeff_list = coeffs if isinstance(coeffs, list) else [coeffs]
    for coeff in coeff_list:
        if not isinstance(coeff, (int, float)) or isinstance(coeff, bool) or coeff < 0:
            raise ConfigError(f"--moe-aux-loss-coeff must be non-negative numbers, got {coeffs!r}")
    if "sinkhorn" in type_list and any(coeff_list):
        raise ConfigError("--moe-aux-loss-coeff must be 0 with sinkhorn load balancing "
                          f"(got {coeffs!r})")
    z_loss = f.number("moe_z_loss_coeff")
    if z_loss is not None and z_loss < 0:
        raise ConfigError(f"--moe-z-loss-coeff must be non-negative, got {z_loss}")


def _check_layer_freq(f: _Fields) -> None:
    freq, layers = f.get("moe_layer_freq"), f.int("num_layers", optional=False)
    if isinstance(freq, list):
        if len(freq) != layers or any(v not in (0, 1) or isinstance(v, bool) for v in freq):
            raise ConfigError(f"--moe-layer-freq as a list needs one 0 (dense) or 1 (MoE) per "
                              f"layer, {layers} in all; got {len(freq)} entries")
        if not any(freq):
            raise ConfigError("--moe-layer-freq makes no layer an MoE layer")
    elif not isinstance(freq, int) or isinstance(freq, bool) or freq < 1:
        raise ConfigError(f"--moe-layer-freq must be a positive integer or a 0/1 list per "
                          f"layer, got {freq!r}")


_EXCEPTIONS = (ValueError, AssertionError, TypeError, NotImplementedError, KeyError)


def _flag_in(message: str) -> str | None:
    """The flag of the first TransformerConfig field a Megatron error message mentions."""
    if "--" in message:
        return None  # Megatron named the flag itself
    found = []
    for name in _transformer_fields():
        match = re.search(rf"\b{re.escape(name)}\b", message)
        if match:
            found.append((match.start(), -len(name), name))
    return flag(min(found)[2]) if found else None


def make_transformer_config(fields: Mapping[str, Any]) -> TransformerConfig:
    """``TransformerConfig(**fields)`` (Megatron's ``MLATransformerConfig`` when
    ``multi_latent_attention`` is set: it holds the MLA widths), with Megatron's exceptions turned
    into ConfigError lines."""
    config_class = MLATransformerConfig if fields.get("multi_latent_attention") else TransformerConfig
    known = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError(f"{flag(unknown[0])}: {unknown[0]!r} is not a {config_class.__name__} "
                          f"field")
    fused_glu = is_fused_glu(fields.get("activation_func"))
    if fused_glu:
        _check_fused_glu(fields)
    try:
        config = config_class(**fields)
    except _EXCEPTIONS as err:
        message = " ".join(str(err).split()) or type(err).__name__
        named = _flag_in(message)
        raise ConfigError(f"{named}: {message}" if named else message) from err
    if fused_glu:
        # Megatron-Core's MLP hands the whole fc1 output to the config's activation only on its
        # use_te_activation_func path, which its config check admits for Transformer Engine's
        # activations alone; set after the check (see ops.activations).
        config.use_te_activation_func = True
    return config


def _check_fused_glu(fields: Mapping[str, Any]) -> None:
    name = fields["activation_func"].name
    if not fields.get("gated_linear_unit"):
        raise ConfigError(f"{flag('gated_linear_unit')}: activation_func {name} is the "
                          f"activation of a gated linear unit; set gated_linear_unit")
    for field in ("bias_activation_fusion", "use_te_activation_func"):
        if fields.get(field):
            raise ConfigError(f"{flag(field)}: activation_func {name} has no fused kernel; "
                              f"leave {field} off")
