"""The numbers of a model config the planner works with, and its parameter census from them alone.

``ModelShape.from_config`` reads a validated model config (``load_shape("flagship_2p8t")``) without
building any torch module, so the planner prices a 2.8e12-parameter model in microseconds.
``census(shape)`` gives the same total, active-per-token count and breakdown by component as
``megatron_slmoe.model.census.parameter_census`` on the built model (a unit test holds them equal
on every shipped config and on multi-latent-attention and non-gated-expert configs), and ``layer_parameters`` is the one formula of what each kind of layer holds,
which the memory model splits over tensor, pipeline and expert parallelism.

Symbols (the shape's field names): d hidden, F dense FFN, h heads, g query groups, c kv channels
(with multi-latent attention: the value head width), E routed experts, k top-k, f expert FFN,
l latent width (d when there is no latent projection), Fs shared-expert FFN, V vocabulary.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from megatron_slmoe.plan._sources import MLA_DEFAULTS, ConfigError, ModelConfig, load_model_config


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    moe_layers: tuple[bool, ...]
    """Per layer: whether it is an MoE layer (else a dense MLP layer)."""
    hidden: int
    ffn_hidden: int
    heads: int
    query_groups: int
    kv_channels: int
    qk_layernorm: bool
    """Norms on q and k per head (GQA), or on the compressed q and kv (multi-latent attention)."""
    norm_params: int
    """Parameters per normalised width element: 1 for RMSNorm, 2 for LayerNorm (weight, bias)."""
    gated: bool
    """Gated linear units (fc1 holds gate and up) in the dense, shared-expert and routed-expert
    MLPs; else non-gated (e.g. squared ReLU)."""
    experts: int
    topk: int
    expert_ffn: int
    latent: Optional[int]
    """Latent width of the routed experts; None: they work in the hidden width."""
    shared_ffn: int
    """Shared-expert FFN width; 0: no shared expert."""
    router_groups: Optional[int]
    router_group_topk: Optional[int]
    capacity_factor: Optional[float]
    pad_to_capacity: bool
    vocab: int
    max_sequence_length: int
    learned_positions: bool
    tied_embeddings: bool
    mla: Optional["MLAShape"] = None
    """Multi-latent attention's widths; None: grouped-query attention."""

    @property
    def expert_width(self) -> int:
        """l: the width of the rows the dispatcher moves and the experts work in."""
        return self.latent or self.hidden

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def attention_width(self) -> int:
        """h * c: the query / context width."""
        return self.heads * self.kv_channels

    @classmethod
    def from_config(cls, model_config: ModelConfig) -> "ModelShape":
        t = dict(model_config.transformer)
        where = model_config.source
        if t.get("add_bias_linear"):
            raise ConfigError(f"{where}: the planner models add_bias_linear: false only "
                              f"(--disable-bias-linear)")
        layers = t["num_layers"]
        freq = t.get("moe_layer_freq", 1)
        experts = t.get("num_moe_experts") or 0
        if not experts:
            moe = (False,) * layers
        elif isinstance(freq, (list, tuple)):
            moe = tuple(bool(v) for v in freq)
        else:
            moe = tuple(i % freq == 0 for i in range(layers))
        heads = t["num_attention_heads"]
        hidden = t["hidden_size"]
        mla = MLAShape.from_fields(t) if t.get("multi_latent_attention") else None
        return cls(
            name=model_config.name,
            num_layers=layers,
            moe_layers=moe,
            hidden=hidden,
            ffn_hidden=t.get("ffn_hidden_size") or 4 * hidden,
            heads=heads,
            query_groups=t.get("num_query_groups") or heads,
            kv_channels=mla.v_head_dim if mla else t.get("kv_channels") or hidden // heads,
            qk_layernorm=bool(t.get("qk_layernorm", False)),
            norm_params=2 if t.get("normalization", "LayerNorm") == "LayerNorm" else 1,
            gated=bool(t.get("gated_linear_unit", False)),
            experts=experts,
            topk=t.get("moe_router_topk", 2) if experts else 0,
            expert_ffn=t.get("moe_ffn_hidden_size") or 0,
            latent=t.get("moe_latent_size"),
            shared_ffn=t.get("moe_shared_expert_intermediate_size") or 0,
            router_groups=t.get("moe_router_num_groups"),
            router_group_topk=t.get("moe_router_group_topk"),
            capacity_factor=t.get("moe_expert_capacity_factor"),
            pad_to_capacity=bool(t.get("moe_pad_expert_input_to_capacity", False)),
            vocab=model_config.vocab_size,
            max_sequence_length=model_config.max_sequence_length,
            learned_positions=model_config.position_embedding_type == "learned_absolute",
            tied_embeddings=model_config.share_embeddings_and_output_weights,
            mla=mla,
        )


@dataclass(frozen=True)
class MLAShape:
    """Megatron's multi-latent attention (``MLATransformerConfig``): q through an optional rank
    ``q_lora_rank`` compression, k and v from one ``kv_lora_rank`` latent plus a shared rotary key
    of ``qk_pos_emb_head_dim`` per token."""

    q_lora_rank: Optional[int]
    """None: q is projected from the hidden state directly (``linear_q_proj``)."""
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int

    @classmethod
    def from_fields(cls, t: dict) -> "MLAShape":
        return cls(**{name: t.get(name, default) for name, default in MLA_DEFAULTS.items()})

    @property
    def q_head_dim(self) -> int:
        return self.qk_head_dim + self.qk_pos_emb_head_dim


def load_shape(name_or_path: str | os.PathLike) -> ModelShape:
    """The shape of a packaged config name or a model YAML file (ConfigError: one line)."""
    return ModelShape.from_config(load_model_config(name_or_path))


def layer_parameters(shape: ModelShape, moe: bool) -> dict[str, int]:
    """Parameters of one transformer layer by component (whole model, no parallelism)."""
    d, norm = shape.hidden, shape.norm_params
    attention, attention_norms = _attention_parameters(shape)
    counts = {"attention": attention, "norms": 2 * d * norm + attention_norms}
    if not moe:
        counts["dense_mlp"] = _mlp(d, shape.ffn_hidden, shape.gated)
        return counts
    counts["router"] = shape.experts * d
    counts["latent"] = 2 * d * shape.latent if shape.latent else 0
    counts["routed_experts"] = shape.experts * expert_parameters(shape)
    counts["shared_experts"] = _mlp(d, shape.shared_ffn, shape.gated) if shape.shared_ffn else 0
    return counts


def _attention_parameters(shape: ModelShape) -> tuple[int, int]:
    """(projection weights, q/k or latent norm weights) of one attention block."""
    d, h, norm = shape.hidden, shape.heads, shape.norm_params
    out = shape.attention_width * d  # linear_proj: h * c -> d
    if shape.mla is None:
        qkv = d * (h + 2 * shape.query_groups) * shape.kv_channels
        return qkv + out, 2 * shape.kv_channels * norm if shape.qk_layernorm else 0
    m = shape.mla
    q_out = h * m.q_head_dim
    q = d * q_out if m.q_lora_rank is None else d * m.q_lora_rank + m.q_lora_rank * q_out
    kv = d * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank * h * (m.qk_head_dim
                                                                               + m.v_head_dim)
    norms = (m.kv_lora_rank + (m.q_lora_rank or 0)) * norm if shape.qk_layernorm else 0
    return q + kv + out, norms


def expert_parameters(shape: ModelShape) -> int:
    """One routed expert in the expert width: fc1 (gate|up when gated) and fc2."""
    return _mlp(shape.expert_width, shape.expert_ffn, shape.gated)


def _mlp(d: int, ffn: int, gated: bool) -> int:
    return d * ffn * (2 if gated else 1) + ffn * d


def embedding_parameters(shape: ModelShape) -> int:
    return shape.vocab * shape.hidden + (
        shape.max_sequence_length * shape.hidden if shape.learned_positions else 0)


def output_parameters(shape: ModelShape) -> int:
    """The output layer's own weight (none when tied to the embedding)."""
    return 0 if shape.tied_embeddings else shape.vocab * shape.hidden


CATEGORIES = ("routed_experts", "shared_experts", "router", "latent", "norms", "attention",
              "dense_mlp", "embedding", "output_layer")
"""The census breakdown, in the order of megatron_slmoe.model.census's."""


def census(shape: ModelShape) -> dict[str, Any]:
    """Total and active-per-token parameters with a breakdown by component, as
    ``megatron_slmoe.model.census.parameter_census`` reports them for the built model."""
    breakdown = dict.fromkeys(CATEGORIES, 0)
    for moe in shape.moe_layers:
        for category, count in layer_parameters(shape, moe).items():
            breakdown[category] += count
    breakdown["norms"] += shape.hidden * shape.norm_params  # final layer norm
    breakdown["embedding"] = embedding_parameters(shape)
    breakdown["output_layer"] = output_parameters(shape)
    total = sum(breakdown.values())
    inactive = shape.num_moe_layers * (shape.experts - shape.topk) * expert_parameters(shape)
    active = total - inactive
    return {
        "total_params": total,
        "active_params_per_token": active,
        "active_fraction": active / total,
        "num_layers": shape.num_layers,
        "num_moe_layers": shape.num_moe_layers,
        "num_moe_experts": shape.experts,
        "moe_router_topk": shape.topk,
        "breakdown": breakdown,
    }
