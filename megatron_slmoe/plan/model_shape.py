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
A model file's ``blocks`` (Kimi K3's) add Kimi Delta Attention layers (``KDAShape``: H heads of
width K, P = H K), gated NoPE MLA's output gate and the Attention-Residual mixes.
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
    kda_layers: tuple[bool, ...] = ()
    """Per layer: whether its attention is Kimi Delta Attention (empty: none is)."""
    kda: Optional["KDAShape"] = None
    gated_mla: bool = False
    """Multi-latent attention with a sigmoid output gate (``linear_gate``: d -> h c)."""
    attention_residual_block: Optional[int] = None
    """Block Attention Residuals: a mix (norm + [1, d] query) before each sublayer and the final
    norm; the stream between layers holds the running sum and the bank."""
    latent_norm: bool = False
    """An RMSNorm of width l on the experts' combined latent output."""
    expert_bias: bool = False
    """The router's correction bias (E values per MoE layer, a checkpoint tensor)."""
    glu_saved: int = 4
    """Per unit of a gated MLP's width, what its activation keeps for backward: SwiGLU 4 (fc1's
    output, glu's linear half and silu's output), SiTU-GLU 2 (its input alone)."""
    packed_expert_bytes: Optional[float] = None
    """Bytes per routed-expert weight as the checkpoint packs them (values plus their share of a
    scale: MXFP4 0.5 + 1/32, INT4 group 32 with bf16 scales 0.5 + 2/32, block FP8 128x128 1 +
    4/128^2); None: not packed."""
    experts_packed: bool = False
    """The model holds its routed experts packed (``--expert-weights packed``)."""

    def is_kda(self, layer: int) -> bool:
        return bool(self.kda_layers) and self.kda_layers[layer]

    @property
    def layer_kinds(self) -> tuple[tuple[bool, bool], ...]:
        """Per layer: (MoE layer, KDA layer)."""
        return tuple((moe, self.is_kda(i)) for i, moe in enumerate(self.moe_layers))

    @property
    def stream_slots(self) -> int:
        """Hidden states the residual stream between two layers holds: 1, or with Attention
        Residuals the running sum and the most block vectors the bank holds before a layer
        (the embedding and one per finished block: model.attention_residuals.stream_slots)."""
        block = self.attention_residual_block
        return 1 if block is None else 1 + -(-self.num_layers // block)

    @property
    def expert_width(self) -> int:
        """l: the width of the rows the dispatcher moves and the experts work in."""
        return self.latent or self.hidden

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """The LoRA target names that adapt something in this model (as ``lora.targets`` matches
        them on a built one): a model config describes a language model, with no vision tower
        or projector."""
        moe = self.num_moe_layers > 0
        present = {"linear_qkv": True, "linear_proj": True, "linear_fc1": True,
                   "linear_fc2": True, "shared_experts": moe and self.shared_ffn > 0,
                   "router": moe, "latent": moe and self.latent is not None}
        return tuple(name for name, here in present.items() if here)

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
        blocks = model_config.blocks
        kda = (KDAShape(blocks.kda_num_heads, blocks.kda_head_dim, blocks.kda_conv_kernel_size)
               if blocks.kda_layers else None)
        kda_layers = tuple(i in blocks.kda_layers for i in range(layers)) if kda else ()
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
            kda_layers=kda_layers,
            kda=kda,
            gated_mla=bool(mla and blocks.gated_nope_mla),
            attention_residual_block=blocks.attention_residual_block,
            latent_norm=bool(model_config.slmoe.latent_norm and t.get("moe_latent_size")),
            expert_bias=bool(experts and t.get("moe_router_enable_expert_bias")),
            glu_saved=2 if t.get("activation_func") == "situ_glu" else 4,
            **_packed_experts(model_config.slmoe.expert_weights),
        )


def _packed_experts(layout) -> dict:
    """ModelShape's packed-expert fields of ``slmoe.expert_weights`` (``moe.config.PackedExperts``)."""
    if layout is None:
        return {}
    return {"packed_expert_bytes": layout.bytes_per_weight, "experts_packed": layout.held}


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


@dataclass(frozen=True)
class KDAShape:
    """Kimi Delta Attention (``model.kda_attention``): q, k, v and the output gate g d -> P, the
    decay through rank K (f_a d -> K, f_b K -> P), beta d -> H, o P -> d, depthwise causal
    convolutions of ``conv_kernel`` taps on q, k, v, per-head A_log, dt_bias P, o_norm K."""

    heads: int
    head_dim: int
    conv_kernel: int

    @property
    def width(self) -> int:
        return self.heads * self.head_dim

    def parameters(self, d: int) -> tuple[int, int]:
        """(everything but the norm, o_norm) of one KDA block."""
        p, k, h = self.width, self.head_dim, self.heads
        return (4 * p * d + d * p + 3 * p * self.conv_kernel + k * d + p * k + h * d + h + p, k)


def load_shape(name_or_path: str | os.PathLike) -> ModelShape:
    """The shape of a packaged config name or a model YAML file (ConfigError: one line)."""
    return ModelShape.from_config(load_model_config(name_or_path))


def layer_parameters(shape: ModelShape, moe: bool, kda: bool = False) -> dict[str, int]:
    """Parameters of one transformer layer by component (whole model, no parallelism)."""
    d, norm = shape.hidden, shape.norm_params
    attention, attention_norms = (shape.kda.parameters(d) if kda
                                  else _attention_parameters(shape))
    counts = {"attention": attention, "norms": 2 * d * norm + attention_norms}
    if shape.attention_residual_block:  # two mixes: norm weight and [1, d] projection each
        counts["attention_residuals"] = 4 * d
    if not moe:
        counts["dense_mlp"] = _mlp(d, shape.ffn_hidden, shape.gated)
        return counts
    counts["router"] = shape.experts * d
    counts["router_bias"] = shape.experts if shape.expert_bias else 0
    counts["latent"] = (2 * d * shape.latent + (shape.latent if shape.latent_norm else 0)
                        if shape.latent else 0)
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
    gate = d * shape.attention_width if shape.gated_mla else 0
    return q + kv + out + gate, norms


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


CATEGORIES = ("routed_experts", "shared_experts", "router", "router_bias", "latent",
              "attention_residuals", "norms", "attention", "dense_mlp", "embedding",
              "output_layer")
"""The census breakdown, in the order of megatron_slmoe.model.census's."""


def census(shape: ModelShape) -> dict[str, Any]:
    """Total and active-per-token parameters with a breakdown by component, as
    ``megatron_slmoe.model.census.parameter_census`` reports them for the built model."""
    breakdown = dict.fromkeys(CATEGORIES, 0)
    for moe, kda in shape.layer_kinds:
        for category, count in layer_parameters(shape, moe, kda).items():
            breakdown[category] += count
    breakdown["norms"] += shape.hidden * shape.norm_params  # final layer norm
    if shape.attention_residual_block:
        breakdown["attention_residuals"] += 2 * shape.hidden  # the output mix
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
