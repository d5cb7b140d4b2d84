"""A small, deliberately plain pure-torch Kimi K3 text model: the reference every K3 parity claim
is held to (no transformers class exists for K3; its checkpoint ships remote code).

Written from the maths in ``shared/KIMI_K3.md``, nothing shared with the package. Plain loops
where a loop says it best: the KDA recurrence token by token, the experts one by one, the
Attention-Residual bank a Python list. Module names equal the release checkpoint's keys, so
``KimiK3Reference().state_dict()`` has the release's key layout (``language_model.model.layers.N.
self_attn.q_proj.weight``, ``language_model.model.layers.N.block_sparse_moe.experts.E.w1.weight``,
``language_model.lm_head.weight``), ``load_state_dict`` takes a dequantised release state dict
(:func:`dequantise_release_state_dict` decodes the MXFP4 experts) and PEFT can wrap it
(``base_model.model.language_model.model.layers.N.block_sparse_moe.experts.E.w1``).

Pieces (each usable alone; the unit tests hold them to transformers' ``kimi_linear`` where the
two coincide):

* :func:`kda_recurrence` / :func:`kda_gate` and :class:`KimiDeltaAttention` (``self_attn`` of a
  KDA layer: q/k/v projections, short causal convolutions, lower-bounded sigmoid decay per head
  and channel, the delta rule, gated per-head output norm);
* :class:`GatedNoPEMLA` (``self_attn`` of an MLA layer: DeepSeek MLA without any rotation, softmax
  scale (nope+rope)^-0.5, output gate sigmoid(g_proj(x)) before o_proj, eps 1e-6 on the LoRA
  norms);
* :func:`situ_glu`, :class:`GatedMLP` (dense layer 0 and the shared experts), :class:`Expert`
  (w1 gate, w3 up, w2 down), :class:`SigmoidRouter` (bias only selects), :class:`LatentMoE`
  (``block_sparse_moe``);
* :func:`attn_res_mix` and the bank bookkeeping in :class:`DecoderLayer` / :class:`TextModel`.

Precision: the fp32 islands of the release (norms, SiTU, the router, the KDA state, softmaxes,
the residual mix) are computed in at least fp32 (:func:`_wide`), so the model also runs in fp64
(``build(dtype=torch.float64)``) as an even plainer reference. Rounding grows with depth: over
the tiny model's 13 layers the fp32 reference's logits lie about 1e-5 from the fp64 one's (16
tokens; :func:`randomise_` keeps the model well conditioned), so hold an fp32 implementation
to the fp64 reference when a 1e-5 tolerance is the claim.

Use: ``model = build()`` (tiny, randomised, eval); ``model(input_ids)`` -> logits;
``greedy_decode(model, ids, n)``; ``release_state_dict(round_experts_to_mxfp4_(model))`` for a
checkpoint in the release layout (experts MXFP4-packed, decoding to exactly the model's weights)
and ``release_config(model.config)`` for its config.json.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------


@dataclass
class KimiK3TextConfig:
    """The fields of the release's ``text_config`` the text model reads (release names, except
    that ``linear_attn_config`` is flattened into ``kda_*``). Layer lists are 1-based, as in
    ``linear_attn_config``; :meth:`layer_kinds` gives the 0-based kinds."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int  # dense layers (layer 0)
    attn_res_block_size: int
    # MLA
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    full_attn_layers: list[int]
    kda_layers: list[int]
    # MoE
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    num_shared_experts: int
    routed_expert_hidden_size: Optional[int]  # None: experts in the full width, no latent norm
    short_conv_kernel_size: int = 4
    gate_lower_bound: float = -5.0
    kda_a_log_size: Optional[int] = None
    """Stored length of ``A_log`` (the release pads 96 heads to 128 with exact zeros). Default:
    the head count rounded up to a multiple of 128 (the padding rule for other head counts is
    unconfirmed; loading a state dict takes whatever length it holds, see KimiDeltaAttention)."""
    latent_moe_use_norm: bool = True
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-5
    mla_lora_norm_eps: float = 1e-6
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        full, kda = set(self.full_attn_layers), set(self.kda_layers)
        if full & kda or full | kda != set(range(1, n + 1)):
            raise ValueError(f"full_attn_layers {sorted(full)} and kda_layers {sorted(kda)} must "
                             f"split the 1-based layers 1..{n}")
        if self.kda_a_log_size is None:
            self.kda_a_log_size = 128 * math.ceil(self.kda_num_heads / 128)

    def attention_kind(self, layer: int) -> str:
        """'kda' or 'mla' for a 0-based layer."""
        return "kda" if layer + 1 in self.kda_layers else "mla"

    def mlp_kind(self, layer: int) -> str:
        """'dense' or 'moe' for a 0-based layer."""
        moe = layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0
        return "moe" if moe else "dense"

    def layer_kinds(self) -> list[tuple[str, str]]:
        return [(self.attention_kind(i), self.mlp_kind(i)) for i in range(self.num_hidden_layers)]

    @classmethod
    def from_text_config(cls, text: dict) -> "KimiK3TextConfig":
        """From the release's ``text_config`` (a dict, as in config.json)."""
        linear = text["linear_attn_config"]
        if not linear.get("use_full_rank_gate", True):
            raise ValueError("the reference implements the full-rank KDA output gate only")
        if text.get("hidden_act", "situ") != "situ":
            raise ValueError(f"hidden_act {text.get('hidden_act')!r}: the reference is SiTU only")
        if text.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ValueError("the reference router is sigmoid only")
        if text.get("num_expert_group", 1) != 1 or text.get("topk_group", 1) != 1:
            raise ValueError("the reference router has no expert groups")
        if not text.get("mla_use_nope", True) or not text.get("mla_use_output_gate", True):
            raise ValueError("the reference MLA is gated NoPE only")
        eos = text.get("eos_token_id", 1)
        return cls(
            vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
            num_hidden_layers=text["num_hidden_layers"],
            intermediate_size=text["intermediate_size"],
            attn_res_block_size=text["attn_res_block_size"],
            num_attention_heads=text["num_attention_heads"], q_lora_rank=text["q_lora_rank"],
            kv_lora_rank=text["kv_lora_rank"], qk_nope_head_dim=text["qk_nope_head_dim"],
            qk_rope_head_dim=text["qk_rope_head_dim"], v_head_dim=text["v_head_dim"],
            kda_num_heads=linear["num_heads"], kda_head_dim=linear["head_dim"],
            full_attn_layers=list(linear["full_attn_layers"]),
            kda_layers=list(linear["kda_layers"]),
            short_conv_kernel_size=linear.get("short_conv_kernel_size", 4),
            gate_lower_bound=linear.get("gate_lower_bound", -5.0),
            num_experts=text["num_experts"],
            num_experts_per_token=text["num_experts_per_token"],
            moe_intermediate_size=text["moe_intermediate_size"],
            num_shared_experts=text["num_shared_experts"],
            routed_expert_hidden_size=text.get("routed_expert_hidden_size"),
            latent_moe_use_norm=text.get("latent_moe_use_norm", True),
            first_k_dense_replace=text.get("first_k_dense_replace", 1),
            moe_layer_freq=text.get("moe_layer_freq", 1),
            moe_renormalize=text.get("moe_renormalize", True),
            routed_scaling_factor=text.get("routed_scaling_factor", 1.0),
            rms_norm_eps=text.get("rms_norm_eps", 1e-5),
            activation_situ_beta=text.get("activation_situ_beta", 4.0),
            activation_situ_linear_beta=text.get("activation_situ_linear_beta", 25.0),
            tie_word_embeddings=text.get("tie_word_embeddings", False),
            bos_token_id=text.get("bos_token_id", 0),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            pad_token_id=text.get("pad_token_id", 2),
        )

    def to_text_config(self) -> dict:
        """The release's ``text_config`` for this model (what :meth:`from_text_config` reads)."""
        return {
            "model_type": "kimi_linear", "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
            "intermediate_size": self.intermediate_size, "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "situ", "activation_situ_beta": self.activation_situ_beta,
            "activation_situ_linear_beta": self.activation_situ_linear_beta,
            "attn_res_block_size": self.attn_res_block_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads, "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim,
            "mla_use_nope": True, "mla_use_output_gate": True,
            "linear_attn_config": {
                "num_heads": self.kda_num_heads, "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.short_conv_kernel_size,
                "gate_lower_bound": self.gate_lower_bound, "use_full_rank_gate": True,
                "full_attn_layers": list(self.full_attn_layers),
                "kda_layers": list(self.kda_layers)},
            "num_experts": self.num_experts, "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            **({"routed_expert_hidden_size": self.routed_expert_hidden_size}
               if self.routed_expert_hidden_size else {}),
            "latent_moe_use_norm": self.latent_moe_use_norm,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": self.moe_layer_freq, "moe_router_activation_func": "sigmoid",
            "moe_renormalize": self.moe_renormalize,
            "routed_scaling_factor": self.routed_scaling_factor, "topk_method": "noaux_tc",
            "num_expert_group": 1, "topk_group": 1,
            "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id,
        }

    def replace(self, **changes) -> "KimiK3TextConfig":
        return dataclasses.replace(self, **changes)


def tiny_config(**overrides) -> KimiK3TextConfig:
    """A tiny K3: 13 layers in K3's pattern (MLA every 4th layer, the last two both MLA: 0-based
    3, 7, 11, 12), dense layer 0, AttnRes blocks of 3 layers (the bank restarts at layers 0, 3,
    6, 9, 12 and ends with 6 candidates), 8 experts top-2 in a latent of half the width (32:
    the expert widths are multiples of MXFP4's 32-input groups), 2 shared experts' width."""
    fields = dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=13, intermediate_size=96,
        attn_res_block_size=3,
        num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8,
        kda_num_heads=4, kda_head_dim=8, full_attn_layers=[4, 8, 12, 13],
        kda_layers=[1, 2, 3, 5, 6, 7, 9, 10, 11],
        num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, num_shared_experts=2,
        routed_expert_hidden_size=32,
    )
    fields.update(overrides)
    return KimiK3TextConfig(**fields)


# ---------------------------------------------------------------------------------------------
# Small pieces
# ---------------------------------------------------------------------------------------------


def _wide(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (fp64 stays fp64): the release's fp32 islands."""
    return x if x.dtype == torch.float64 else x.float()


class RMSNorm(nn.Module):
    """Normalise in (at least) fp32, cast back, then multiply by the weight."""

    def __init__(self, size: int, eps: float, weight_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=weight_dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _wide(x)
        normed = w * torch.rsqrt(w.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0,
             linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU-GLU: beta*tanh(g/beta)*sigmoid(g) times linear_beta*tanh(u/linear_beta), in (at
    least) fp32, cast back to the input dtype. The sigmoid takes the raw g."""
    g, u = _wide(gate), _wide(up)
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    return (a * (linear_beta * torch.tanh(u / linear_beta))).to(gate.dtype)


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU, for the comparisons with transformers' Kimi-Linear (silu experts)."""
    return F.silu(gate) * up


class GatedMLP(nn.Module):
    """gate_proj / up_proj / down_proj: the dense MLP of layer 0 and the shared experts."""

    def __init__(self, hidden: int, intermediate: int, act=situ_glu):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class Expert(nn.Module):
    """One routed expert: w1 gate, w3 up, w2 down (in the latent width when there is one)."""

    def __init__(self, width: int, intermediate: int, act=situ_glu):
        super().__init__()
        self.w1 = nn.Linear(width, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, width, bias=False)
        self.w3 = nn.Linear(width, intermediate, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x), self.w3(x)))


class SigmoidRouter(nn.Linear):
    """``gate``: a linear layer (so that PEFT can put LoRA on it) giving fp32 logits of the
    full-width x; :meth:`route` then takes s = sigmoid(logits), chooses the top-k of s + bias
    (the correction bias only selects) and weights them with the unbiased s of the chosen,
    renormalised to sum 1 when ``renormalize``, times ``scaling``."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool = True,
                 scaling: float = 1.0):
        super().__init__(hidden, num_experts, bias=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))
        self.top_k, self.renormalize, self.scaling = top_k, renormalize, scaling

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return F.linear(_wide(x_TD), _wide(self.weight))

    def route(self, logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen experts [T, k], their weights [T, k] in (at least) fp32)."""
        scores = torch.sigmoid(_wide(logits_TE))
        chosen = torch.topk(scores + _wide(self.e_score_correction_bias), self.top_k, dim=-1)[1]
        weights = scores.gather(1, chosen)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return chosen, weights * self.scaling


class LatentMoE(nn.Module):
    """``block_sparse_moe``: router on the full x; z = routed_expert_down_proj(x) once per token;
    each chosen expert on z, weighted; the weighted sum through routed_expert_norm and
    routed_expert_up_proj; plus the shared experts (one MLP of width moe_intermediate *
    num_shared) on the full x, unweighted. Without ``latent_size`` the experts run in the full
    width with no projections and no norm (transformers' Kimi-Linear MoE)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int,
                 num_shared: int, latent_size: Optional[int] = None, latent_norm: bool = True,
                 renormalize: bool = True, scaling: float = 1.0, eps: float = 1e-5,
                 act=situ_glu):
        super().__init__()
        width = latent_size or hidden
        self.gate = SigmoidRouter(hidden, num_experts, top_k, renormalize, scaling)
        self.experts = nn.ModuleList(Expert(width, intermediate, act) for _ in range(num_experts))
        self.shared_experts = (GatedMLP(hidden, intermediate * num_shared, act)
                               if num_shared else None)
        if latent_size:
            self.routed_expert_down_proj = nn.Linear(hidden, latent_size, bias=False)
            self.routed_expert_up_proj = nn.Linear(latent_size, hidden, bias=False)
            self.routed_expert_norm = RMSNorm(latent_size, eps) if latent_norm else None
        else:
            self.routed_expert_down_proj = self.routed_expert_up_proj = None
            self.routed_expert_norm = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_TD = x.reshape(-1, x.shape[-1])
        # PEFT may wrap the gate (LoRA on the router): its LoRA adds to the logits.
        router = getattr(self.gate, "base_layer", self.gate)
        chosen_TK, weights_TK = router.route(self.gate(x_TD))
        z_TL = x_TD if self.routed_expert_down_proj is None else self.routed_expert_down_proj(x_TD)
        y_TL = _wide(torch.zeros_like(z_TL))
        for e, expert in enumerate(self.experts):
            tokens, slots = torch.where(chosen_TK == e)
            if tokens.numel():
                out = expert(z_TL[tokens])
                y_TL[tokens] += weights_TK[tokens, slots, None] * _wide(out)
        y_TL = y_TL.to(z_TL.dtype)
        if self.routed_expert_norm is not None:
            y_TL = self.routed_expert_norm(y_TL)
        y_TD = y_TL if self.routed_expert_up_proj is None else self.routed_expert_up_proj(y_TL)
        if self.shared_experts is not None:
            y_TD = y_TD + self.shared_experts(x_TD)
        return y_TD.view(x.shape)


# ---------------------------------------------------------------------------------------------
# Kimi Delta Attention
# ---------------------------------------------------------------------------------------------


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (fla's l2norm, as transformers' Kimi-Linear)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             lower_bound: float = -5.0) -> torch.Tensor:
    """Log-space decay per head and channel: g = lower_bound * sigmoid(exp(A_log[h]) * (f +
    dt_bias)). f [B, T, H, D] (f_b_proj(f_a_proj(x))), A_log [H] (the used heads), dt_bias
    [H*D]."""
    H, D = f.shape[-2:]
    pre = _wide(f) + _wide(dt_bias).view(H, D)
    return lower_bound * torch.sigmoid(torch.exp(_wide(A_log)).view(H, 1) * pre)


def kda_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                   normalise_qk: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The KDA delta rule, one token at a time, in (at least) fp32.

    q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] log-space decay; beta [B, T, H] (after the
    sigmoid); state S [B, H, K, V]. With ``normalise_qk`` q and k are L2-normalised (eps 1e-6)
    first; q is scaled by K^-0.5. Per step: S <- diag(exp(g_t)) S; S <- S + k_t (beta_t (v_t -
    S^T k_t))^T; o_t = S^T q_t (the updated state). Returns (o [B, T, H, V] in v's dtype, the
    final state)."""
    q, k, v, g, beta = (_wide(t) for t in (q, k, v, g, beta))
    if normalise_qk:
        q, k = l2_normalise(q), l2_normalise(k)
    q = q * q.shape[-1] ** -0.5
    B, T, H, K = k.shape
    V = v.shape[-1]
    S = (torch.zeros(B, H, K, V, dtype=q.dtype, device=q.device) if initial_state is None
         else _wide(initial_state).clone())
    outputs = []
    for t in range(T):
        S = S * torch.exp(g[:, t]).unsqueeze(-1)
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        delta = beta[:, t].unsqueeze(-1) * (v[:, t] - predicted)
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(B, 0, H, V)
    return o, S


class ShortConvolution(nn.Module):
    """Causal depthwise convolution followed by SiLU; weight [C, 1, kernel] (fp32 in the
    release): out[t, c] = silu(sum_j w[c, 0, j] * x[t - (kernel - 1) + j, c]), zeros before the
    start."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel, dtype=torch.float32))

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        x = _wide(x_BTC)
        kernel = self.weight.shape[-1]
        out = torch.zeros_like(x)
        T = x.shape[1]
        for j in range(kernel):
            shift = kernel - 1 - j  # tap j reads the token `shift` steps back
            if shift < T:
                out[:, shift:] += _wide(self.weight[:, 0, j]) * x[:, :T - shift]
        return F.silu(out).to(x_BTC.dtype)


class KimiDeltaAttention(nn.Module):
    """``self_attn`` of a K3 KDA layer, with the release's names: q_proj/k_proj/v_proj [P, H],
    q_conv1d/k_conv1d/v_conv1d [P, 1, 4] (fp32), f_a_proj [D, H], f_b_proj [P, D], A_log [A]
    (fp32, the first ``num_heads`` used, the rest zero padding), dt_bias [P] (fp32), b_proj
    [heads, H], g_proj [P, H], o_norm [D] (fp32), o_proj [H, P]; P = heads * D.

    x is the normed hidden. q, k, v = silu(conv(proj(x))); beta = sigmoid(b_proj(x)); g =
    :func:`kda_gate` (f_b_proj(f_a_proj(x))); o = :func:`kda_recurrence`; out = o_proj(
    RMSNorm_head(o) * o_norm * sigmoid(g_proj(x))) with the per-head norm in (at least) fp32.

    ``forward(x, initial_state=None, return_state=False)``: the state (and the convolutions'
    last ``kernel - 1`` inputs) is not carried between calls unless asked for; the reference's
    generation recomputes the whole sequence instead.
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_kernel: int = 4,
                 gate_lower_bound: float = -5.0, a_log_size: Optional[int] = None,
                 norm_eps: float = 1e-5):
        super().__init__()
        P = num_heads * head_dim
        self.num_heads, self.head_dim = num_heads, head_dim
        self.gate_lower_bound, self.norm_eps = gate_lower_bound, norm_eps
        self.q_proj = nn.Linear(hidden_size, P, bias=False)
        self.k_proj = nn.Linear(hidden_size, P, bias=False)
        self.v_proj = nn.Linear(hidden_size, P, bias=False)
        self.q_conv1d = ShortConvolution(P, conv_kernel)
        self.k_conv1d = ShortConvolution(P, conv_kernel)
        self.v_conv1d = ShortConvolution(P, conv_kernel)
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, P, bias=False)
        self.A_log = nn.Parameter(torch.zeros(a_log_size or num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(P, dtype=torch.float32))
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.g_proj = nn.Linear(hidden_size, P, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(head_dim, dtype=torch.float32))
        self.o_proj = nn.Linear(P, hidden_size, bias=False)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A stored A_log of another padded length than ours (the padding rule for other head
        # counts is unconfirmed): take its length, after checking the padding is zero.
        stored = state_dict.get(prefix + "A_log")
        if stored is not None and stored.shape != self.A_log.shape:
            if stored.dim() != 1 or stored.numel() < self.num_heads:
                raise ValueError(f"{prefix}A_log {tuple(stored.shape)} cannot hold "
                                 f"{self.num_heads} heads")
            if bool((stored[self.num_heads:] != 0).any()):
                raise ValueError(f"{prefix}A_log padding beyond {self.num_heads} heads is not zero")
            self.A_log = nn.Parameter(torch.zeros_like(stored, dtype=torch.float32),
                                      requires_grad=self.A_log.requires_grad)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def core_inputs(self, x: torch.Tensor):
        """(q, k, v, g, beta) of the recurrence for the normed hidden x [B, T, hidden]."""
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        q = self.q_conv1d(self.q_proj(x)).view(B, T, H, D)
        k = self.k_conv1d(self.k_proj(x)).view(B, T, H, D)
        v = self.v_conv1d(self.v_proj(x)).view(B, T, H, D)
        f = self.f_b_proj(self.f_a_proj(x)).view(B, T, H, D)
        g = kda_gate(f, self.A_log[:H], self.dt_bias, self.gate_lower_bound)
        beta = torch.sigmoid(_wide(self.b_proj(x)))
        return q, k, v, g, beta

    def output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """o_proj of the gated per-head norm of the recurrence output o [B, T, H, D]."""
        B, T = x.shape[:2]
        w = _wide(o)
        normed = w * torch.rsqrt(w.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        gate = torch.sigmoid(_wide(self.g_proj(x))).view_as(w)
        y = (normed * _wide(self.o_norm.weight) * gate).to(x.dtype)
        return self.o_proj(y.reshape(B, T, -1))

    def forward(self, x: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                return_state: bool = False):
        q, k, v, g, beta = self.core_inputs(x)
        o, state = kda_recurrence(q, k, v, g, beta, initial_state)
        out = self.output(x, o)
        return (out, state) if return_state else out


# ---------------------------------------------------------------------------------------------
# Gated NoPE MLA
# ---------------------------------------------------------------------------------------------


class GatedNoPEMLA(nn.Module):
    """``self_attn`` of a K3 MLA layer: DeepSeek MLA with no rotation at all (the qk_rope dims
    join the dot product as they are; k_pe is one head broadcast to all), causal softmax (at
    least fp32) with scale (nope + rope)^-0.5, then o <- o * sigmoid(g_proj(x)) before o_proj.
    q_a_layernorm and kv_a_layernorm take eps 1e-6. ``output_gate=False`` leaves g_proj out
    (transformers' Kimi-Linear MLA)."""

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 lora_norm_eps: float = 1e-6, output_gate: bool = True):
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope, self.rope, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        q_dim = qk_nope_head_dim + qk_rope_head_dim
        self.scale = q_dim ** -0.5
        self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(q_lora_rank, lora_norm_eps)
        self.q_b_proj = nn.Linear(q_lora_rank, num_heads * q_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim,
                                            bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, lora_norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim),
                                   bias=False)
        self.g_proj = (nn.Linear(hidden_size, num_heads * v_head_dim, bias=False)
                       if output_gate else None)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """The heads' outputs before the gate and o_proj, [B, T, heads * v_head_dim]."""
        B, T, _ = x.shape
        H = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, H, -1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, H, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(B, T, H, self.rope)], dim=-1)
        scores = torch.einsum("bqhd,bkhd->bhqk", _wide(q), _wide(k)) * self.scale
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        o = torch.einsum("bhqk,bkhd->bqhd", probs, _wide(v)).to(x.dtype)
        return o.reshape(B, T, H * self.v_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = self.attention(x)
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)


# ---------------------------------------------------------------------------------------------
# Block Attention Residuals
# ---------------------------------------------------------------------------------------------


def attn_res_mix(running_sum: torch.Tensor, bank: list[torch.Tensor], norm: RMSNorm,
                 proj: nn.Linear) -> torch.Tensor:
    """Softmax over the candidates [bank..., running_sum] of <norm.weight * proj.weight,
    RMSNorm(v_j)> (a weightless RMSNorm with the norm's eps; (at least) fp32), applied to the raw
    candidates; in the running sum's dtype."""
    values = torch.stack([_wide(v) for v in [*bank, running_sum]])  # [N, ..., H]
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + norm.eps)
    query = _wide(norm.weight) * _wide(proj.weight[0])
    probs = (keys * query).sum(-1).softmax(dim=0)  # [N, ...]
    return (probs.unsqueeze(-1) * values).sum(0).to(running_sum.dtype)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


class DecoderLayer(nn.Module):
    """One K3 layer (0-based ``index``) on (running sum, bank):

        h = mix(sum, bank; self_attention_res_*) if the bank has entries, else sum
        if index % block == 0: bank.append(sum); sum = 0
        sum += self_attn(input_layernorm(h))
        h = mix(sum, bank; mlp_res_*)
        sum += mlp or block_sparse_moe(post_attention_layernorm(h))
    """

    def __init__(self, config: KimiK3TextConfig, index: int):
        super().__init__()
        c, H = config, config.hidden_size
        self.index, self.block = index, c.attn_res_block_size
        self.attention_kind, self.mlp_kind = c.attention_kind(index), c.mlp_kind(index)
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.self_attention_res_norm = RMSNorm(H, c.rms_norm_eps)
        self.self_attention_res_proj = nn.Linear(H, 1, bias=False)
        self.mlp_res_norm = RMSNorm(H, c.rms_norm_eps)
        self.mlp_res_proj = nn.Linear(H, 1, bias=False)
        if self.attention_kind == "kda":
            self.self_attn = KimiDeltaAttention(
                H, c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size,
                c.gate_lower_bound, c.kda_a_log_size, c.rms_norm_eps)
        else:
            self.self_attn = GatedNoPEMLA(
                H, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim,
                c.qk_rope_head_dim, c.v_head_dim, c.mla_lora_norm_eps)
        act = _situ(c)
        if self.mlp_kind == "dense":
            self.mlp = GatedMLP(H, c.intermediate_size, act)
        else:
            self.block_sparse_moe = LatentMoE(
                H, c.num_experts, c.num_experts_per_token, c.moe_intermediate_size,
                c.num_shared_experts, c.routed_expert_hidden_size, c.latent_moe_use_norm,
                c.moe_renormalize, c.routed_scaling_factor, c.rms_norm_eps, act)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) if self.mlp_kind == "dense" else self.block_sparse_moe(x)

    def forward(self, running_sum: torch.Tensor, bank: list[torch.Tensor]):
        h = (attn_res_mix(running_sum, bank, self.self_attention_res_norm,
                          self.self_attention_res_proj) if bank else running_sum)
        if self.index % self.block == 0:
            bank = [*bank, running_sum]
            running_sum = torch.zeros_like(running_sum)
        running_sum = running_sum + self.self_attn(self.input_layernorm(h))
        h = attn_res_mix(running_sum, bank, self.mlp_res_norm, self.mlp_res_proj)
        running_sum = running_sum + self.ffn(self.post_attention_layernorm(h))
        return running_sum, bank


def _situ(c: KimiK3TextConfig):
    beta, linear_beta = c.activation_situ_beta, c.activation_situ_linear_beta
    return lambda gate, up: situ_glu(gate, up, beta, linear_beta)


class TextModel(nn.Module):
    """``language_model.model``: embed_tokens, layers, the output mix
    (output_attn_res_norm/proj) of the last running sum with the bank, norm."""

    def __init__(self, config: KimiK3TextConfig):
        super().__init__()
        H = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.layers = nn.ModuleList(DecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.output_attn_res_norm = RMSNorm(H, config.rms_norm_eps)
        self.output_attn_res_proj = nn.Linear(H, 1, bias=False)
        self.norm = RMSNorm(H, config.rms_norm_eps)

    def forward(self, input_ids: Optional[torch.Tensor] = None,
                inputs_embeds: Optional[torch.Tensor] = None,
                return_bank: bool = False):
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        running_sum, bank = h, []
        for layer in self.layers:
            running_sum, bank = layer(running_sum, bank)
        mixed = attn_res_mix(running_sum, bank, self.output_attn_res_norm,
                             self.output_attn_res_proj)
        out = self.norm(mixed)
        return (out, running_sum, bank) if return_bank else out


class CausalLM(nn.Module):
    """``language_model``: model + lm_head."""

    def __init__(self, config: KimiK3TextConfig):
        super().__init__()
        self.model = TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids=None, inputs_embeds=None) -> torch.Tensor:
        return self.lm_head(self.model(input_ids, inputs_embeds))


class KimiK3Reference(nn.Module):
    """The K3 text model under the release's top-level names (``language_model.model.*``,
    ``language_model.lm_head``). ``forward(input_ids)`` -> logits [B, T, vocab]. No padding:
    an ``attention_mask`` (PEFT passes one) must be all ones."""

    def __init__(self, config: KimiK3TextConfig):
        super().__init__()
        self.config = config
        self.language_model = CausalLM(config)

    def forward(self, input_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                inputs_embeds: Optional[torch.Tensor] = None, **unused) -> torch.Tensor:
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("the K3 reference takes no padding (attention_mask must be all ones)")
        return self.language_model(input_ids, inputs_embeds)


@torch.no_grad()
def greedy_decode(model: nn.Module, input_ids, max_new_tokens: int,
                  eos_token_id: Optional[int] = None):
    """Greedy continuation of each row of ``input_ids`` [B, T] (the whole sequence recomputed
    for every new token). Rows that produce ``eos_token_id`` keep it and stop growing
    (the rest of such a row is filled with it). Returns [B, T + max_new_tokens]. Prompts of
    different lengths: a list of token lists, each decoded alone; returns the list of the
    generated tokens only, each cut after its ``eos_token_id``."""
    if isinstance(input_ids, (list, tuple)):
        answers = []
        for prompt in input_ids:
            row = greedy_decode(model, torch.tensor([list(prompt)]), max_new_tokens,
                                eos_token_id)[0, len(prompt):].tolist()
            if eos_token_id is not None and eos_token_id in row:
                row = row[:row.index(eos_token_id) + 1]
            answers.append(row)
        return answers
    ids = input_ids.clone()
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for _ in range(max_new_tokens):
        nxt = model(ids)[:, -1].argmax(-1)
        if eos_token_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
            done |= nxt == eos_token_id
        ids = torch.cat([ids, nxt[:, None]], dim=1)
    return ids


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def randomise_(model: nn.Module, seed: int = 0, gain: float = 0.5) -> nn.Module:
    """Draw every weight at a scale where each block matters and the model stays well
    conditioned (fp32 logits within about 1e-5 of fp64 ones over the tiny model's 13 layers):
    projections N(0, gain^2 / fan_in) (the embedding N(0, 1)), norm weights 1 + N(0, 0.1),
    residual-mix projections N(0, 1 / hidden) (mix scores of about unit spread: larger ones
    make the mix a sharp switch that amplifies rounding layer after layer), the router's
    correction bias N(0, 0.3) (so it changes the selection), conv taps N(0, 0.5), A_log = log
    U(1, 16) on the used heads (zero padding), dt_bias N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(t, mean=0.0, s=1.0):
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float64) * s + mean)

    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            normal(module.weight)
        elif isinstance(module, SigmoidRouter):
            normal(module.weight, s=gain / math.sqrt(module.weight.shape[1]))
            normal(module.e_score_correction_bias, s=0.3)
        elif isinstance(module, nn.Linear):
            is_mix = name.endswith("_res_proj")
            normal(module.weight, s=(1.0 if is_mix else gain) / math.sqrt(module.in_features))
        elif isinstance(module, RMSNorm):
            normal(module.weight, 1.0, 0.1)
        elif isinstance(module, ShortConvolution):
            normal(module.weight, s=0.5)
        elif isinstance(module, KimiDeltaAttention):
            heads = module.num_heads
            module.A_log.zero_()
            module.A_log[:heads] = torch.rand(heads, generator=gen, dtype=torch.float64).mul(
                15).add(1).log().to(module.A_log.dtype)
            normal(module.dt_bias)
            normal(module.o_norm.weight, 1.0, 0.1)
    return model


def build(config: Optional[KimiK3TextConfig] = None, seed: int = 0,
          dtype: torch.dtype = torch.float32) -> KimiK3Reference:
    """A randomised reference (eval mode) of ``config`` (default: :func:`tiny_config`)."""
    model = KimiK3Reference(config or tiny_config())
    randomise_(model, seed)
    return model.to(dtype).eval()


# ---------------------------------------------------------------------------------------------
# MXFP4 (the release's routed experts), tiny and independent
# ---------------------------------------------------------------------------------------------

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitudes of the 3 low bits of an E2M1 nibble; bit 3 is the sign."""


def mxfp4_decode(packed: torch.Tensor, scale: torch.Tensor,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in/2] uint8 + [out, in/32] uint8 -> [out, in]. Byte c holds element 2c in its low
    nibble and 2c+1 in its high nibble; each 32 inputs share the scale 2^(s - 127) (255 is
    NaN)."""
    out_dim, half = packed.shape
    values = torch.empty(out_dim, 2 * half, dtype=torch.float64)
    table = torch.tensor(E2M1, dtype=torch.float64)
    for position, nibbles in ((0, packed & 0x0F), (1, packed >> 4)):
        magnitude = table[(nibbles & 0x7).long()]
        values[:, position::2] = torch.where((nibbles & 0x8).bool(), -magnitude, magnitude)
    exponent = scale.to(torch.float64) - 127
    factor = torch.where(scale == 255, torch.tensor(float("nan"), dtype=torch.float64),
                         torch.pow(2.0, exponent))
    values = values * factor.repeat_interleave(32, dim=1)
    return values.to(dtype)


def mxfp4_encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (packed [out, in/2] uint8, scale [out, in/32] uint8): per 32 inputs the
    exponent floor(log2(amax)) - 2 (127 + that as the scale byte; 127 for an all-zero group),
    each value rounded to the nearest E2M1 value (ties to the smaller magnitude), clamped to
    6. Values that are already representable come back exactly."""
    w = weight.to(torch.float64)
    out_dim, in_dim = w.shape
    groups = w.view(out_dim, in_dim // 32, 32)
    amax = groups.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(1e-300))) - 2,
                           torch.zeros_like(amax))
    scaled = (groups / torch.pow(2.0, exponent).unsqueeze(-1)).view(out_dim, in_dim)
    table = torch.tensor(E2M1, dtype=torch.float64)
    index = (scaled.abs().clamp(max=6.0).unsqueeze(-1) - table).abs().argmin(-1)
    nibbles = (index | torch.where(scaled < 0, 8, 0)).to(torch.uint8)
    nibbles = torch.where(index == 0, torch.zeros_like(nibbles), nibbles)  # no negative zero
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    return packed, (exponent + 127).to(torch.uint8)


@torch.no_grad()
def round_experts_to_mxfp4_(model: nn.Module) -> nn.Module:
    """Replace every routed expert weight by its MXFP4 round trip, so that a release-layout
    checkpoint of the model (experts packed) decodes to exactly the model's weights."""
    for name, module in model.named_modules():
        if isinstance(module, Expert):
            for linear in (module.w1, module.w2, module.w3):
                linear.weight.copy_(mxfp4_decode(*mxfp4_encode(linear.weight),
                                                 dtype=linear.weight.dtype))
    return model


def release_state_dict(model: KimiK3Reference, pack_experts: bool = True) -> dict:
    """The model's tensors under the release's keys and layout: experts packed
    (``weight_packed`` + ``weight_scale``, exact only after :func:`round_experts_to_mxfp4_`),
    everything else as held."""
    out = {}
    for key, tensor in model.state_dict().items():
        if pack_experts and ".experts." in key and key.endswith(".weight"):
            packed, scale = mxfp4_encode(tensor)
            out[key + "_packed"], out[key + "_scale"] = packed, scale
        else:
            out[key] = tensor.detach().clone()
    return out


def dequantise_release_state_dict(state: dict, dtype: torch.dtype = torch.float32) -> dict:
    """A release state dict with ``*.weight_packed`` / ``*.weight_scale`` pairs decoded to
    ``*.weight`` (other tensors as given), ready for ``KimiK3Reference.load_state_dict``."""
    out = {}
    for key, tensor in state.items():
        if key.endswith(".weight_scale"):
            continue
        if key.endswith(".weight_packed"):
            stem = key[: -len("_packed")]
            scale = state.get(stem + "_scale")
            if scale is None:
                raise KeyError(f"{stem}_scale is missing for {key}")
            out[stem] = mxfp4_decode(tensor, scale, dtype)
        else:
            out[key] = tensor
    return out


def release_config(config: KimiK3TextConfig) -> dict:
    """A release-style top-level config.json for a text-only checkpoint of ``config``."""
    return {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
        "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id, "tie_word_embeddings": config.tie_word_embeddings,
        "text_config": config.to_text_config(),
    }


__all__ = [
    "CausalLM", "DecoderLayer", "E2M1", "Expert", "GatedMLP", "GatedNoPEMLA",
    "KimiDeltaAttention", "KimiK3Reference", "KimiK3TextConfig", "LatentMoE", "RMSNorm",
    "ShortConvolution", "SigmoidRouter", "TextModel", "attn_res_mix", "build",
    "dequantise_release_state_dict", "greedy_decode", "kda_gate", "kda_recurrence",
    "l2_normalise", "mxfp4_decode", "mxfp4_encode", "randomise_", "release_config",
    "release_state_dict", "round_experts_to_mxfp4_", "silu_glu", "situ_glu", "tiny_config",
]
