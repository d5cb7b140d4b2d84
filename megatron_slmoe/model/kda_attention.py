"""Kimi Delta Attention (KDA, the linear attention of Kimi Linear and Kimi K3) as a Megatron-Core
self-attention module, its heads split over tensor parallelism.

With x the normed hidden state [s, b, d] (P = heads x head_dim, H = heads, K = head_dim)::

    q, k, v  = SiLU(causal depthwise conv_4(q_proj(x))), ... (k_proj, v_proj)     [P] each
    q, k     = L2-normalised per head (eps 1e-6); q scaled by K^-0.5 in the core
    beta     = sigmoid(b_proj(x))                                                  [H]
    g        = lower_bound * sigmoid(exp(A_log[h]) * (f_b_proj(f_a_proj(x)) + dt_bias))  [P]
    o        = the KDA recurrence (``megatron_slmoe.ops.kda``) with log-decay g
    out      = o_proj(RMSNorm_per_head(o) * o_norm.weight * sigmoid(g_proj(x)))

Parameter names are the released checkpoints' (``self_attn.q_proj``, ``q_conv1d``, ``f_a_proj``,
``A_log``, ``o_norm`` ...). The convolutions, ``A_log``, ``dt_bias`` and ``o_norm.weight`` are
float32 whatever the model's dtype, as the release stores them; ``A_log`` holds one value per head
of this rank (the release pads it, see :func:`a_log_from_checkpoint`).

Tensor parallelism: q/k/v/g/f_b/b are ColumnParallelLinear (rank r holds heads
[r H/tp, (r+1) H/tp)), o_proj is RowParallelLinear, and the convolutions, ``A_log`` and
``dt_bias`` hold the same heads' slices. ``f_a_proj`` [K, d] and ``o_norm.weight`` [K] are whole on
every rank: f_a feeds the column-parallel f_b, whose input gradient Megatron all-reduces, so its
gradient is whole unless sequence parallelism splits its input (then it is marked
``sequence_parallel`` and finalize_model_grads sums it over TP, as for the layer norms);
``o_norm`` weighs only this rank's heads, so its gradient is summed over TP inside the graph.

Generation: with Megatron's ``StaticInferenceContext`` the layer keeps a :class:`KDAState` (the
convolutions' last inputs and the recurrent state) per layer in the context, started at zero when
the context's sequence offset is 0, so a prefill and any number of later steps equal one forward
over the whole sequence. :meth:`KimiDeltaAttention.forward_with_state` does the same with an
explicit state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)

from megatron_slmoe.ops.kda import kda


@dataclass(frozen=True)
class KDAConfig:
    """The shape of one KDA layer (K3: 96 heads of 128, kernel 4, lower bound -5)."""

    num_heads: int
    head_dim: int
    conv_kernel_size: int = 4
    gate_lower_bound: float = -5.0
    norm_eps: Optional[float] = None
    """``o_norm``'s epsilon; None: the TransformerConfig's ``layernorm_epsilon``."""

    @classmethod
    def from_linear_attn_config(cls, linear_attn_config: dict,
                                norm_eps: Optional[float] = None) -> "KDAConfig":
        """From a release's ``text_config.linear_attn_config`` (K3, Kimi Linear)."""
        if not linear_attn_config.get("use_full_rank_gate", True):
            raise ValueError("linear_attn_config.use_full_rank_gate is false: the low-rank output "
                             "gate (g_a_proj/g_b_proj) is not implemented")
        return cls(num_heads=int(linear_attn_config["num_heads"]),
                   head_dim=int(linear_attn_config["head_dim"]),
                   conv_kernel_size=int(linear_attn_config.get("short_conv_kernel_size", 4)),
                   gate_lower_bound=float(linear_attn_config.get("gate_lower_bound", -5.0)),
                   norm_eps=norm_eps)

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "conv_kernel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KDAConfig.{name} must be positive, got {getattr(self, name)}")
        if not self.gate_lower_bound < 0:
            raise ValueError(f"KDAConfig.gate_lower_bound must be negative (a log-decay), got "
                             f"{self.gate_lower_bound}")


@dataclass
class KimiDeltaAttentionSubmodules:
    q_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    k_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    v_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    g_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    f_b_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    b_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    o_proj: Union[ModuleSpec, type] = RowParallelLinear


def kda_attention_spec(kda_config: KDAConfig) -> ModuleSpec:
    """The ``self_attention`` submodule spec of a TransformerLayer with KDA (Megatron's local,
    non-TransformerEngine linears)."""
    return ModuleSpec(module=KimiDeltaAttention, submodules=KimiDeltaAttentionSubmodules(),
                      params={"kda_config": kda_config})


@dataclass
class KDAState:
    """What one KDA layer carries from one generation step to the next, per batch row."""

    conv: torch.Tensor
    """[B, 3, P_local, kernel - 1] float32: the last inputs of the q, k, v convolutions."""
    recurrent: torch.Tensor
    """[B, H_local, K, K] float32: the delta-rule state."""


def a_log_from_checkpoint(stored: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The per-head ``A_log`` [num_heads] of a release tensor zero-padded past the heads (K3: 96
    heads in [128]); a non-zero pad or too short a tensor is refused."""
    if stored.dim() != 1 or stored.shape[0] < num_heads:
        raise ValueError(f"A_log has shape {tuple(stored.shape)}, which cannot hold {num_heads} "
                         f"heads")
    if bool((stored[num_heads:] != 0).any()):
        raise ValueError(f"A_log is padded past its {num_heads} heads with non-zero values")
    return stored[:num_heads]


def a_log_to_checkpoint(a_log: torch.Tensor, stored_size: int) -> torch.Tensor:
    """``A_log`` [heads] zero-padded to the release's size (the inverse of
    :func:`a_log_from_checkpoint`)."""
    if stored_size < a_log.shape[0]:
        raise ValueError(f"cannot pad A_log of {a_log.shape[0]} heads to {stored_size}")
    return F.pad(a_log, (0, stored_size - a_log.shape[0]))


def replicated_linear(config: TransformerConfig, in_features: int, out_features: int,
                      device=None) -> torch.nn.Linear:
    """A bias-free ``torch.nn.Linear`` whole on every tensor-parallel rank (``f_a_proj``). With
    sequence parallelism each rank projects its slice of the sequence, so the weight is marked
    ``sequence_parallel`` and finalize_model_grads sums its gradient over TP."""
    linear = torch.nn.Linear(in_features, out_features, bias=False, dtype=config.params_dtype,
                             device=device)
    if config.perform_initialization:
        # The default RNG stream is the same on every TP rank, so the replicas start equal.
        config.init_method(linear.weight)
    linear.weight.sequence_parallel = config.sequence_parallel
    return linear


class SigmoidGatedRMSNorm(torch.nn.Module):
    """Per-head RMSNorm times a float32 weight times sigmoid(gate), all in float32 (fla's
    ``FusedRMSNormGated`` with a sigmoid), cast back to the input's dtype."""

    def __init__(self, head_dim: int, eps: float, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(head_dim, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * weight.float() * torch.sigmoid(gate.float())).to(x.dtype)


def causal_depthwise_conv(x_BSD: torch.Tensor, weight_D1W: torch.Tensor,
                          state_BDw: Optional[torch.Tensor] = None):
    """SiLU of a causal depthwise convolution over the sequence, in float32, continuing from
    ``state`` (the previous kernel-1 inputs; zeros when None): ``(y [B, S, D] in x's dtype,
    the new state [B, D, kernel-1] float32)``."""
    B, S, D = x_BSD.shape
    width = weight_D1W.shape[-1]
    x_BDS = x_BSD.transpose(1, 2).float()
    if state_BDw is None:
        state_BDw = x_BDS.new_zeros(B, D, width - 1)
    padded = torch.cat([state_BDw.float(), x_BDS], dim=-1)
    y_BDS = F.conv1d(padded, weight_D1W.float(), groups=D)
    return F.silu(y_BDS).transpose(1, 2).to(x_BSD.dtype), padded[..., padded.shape[-1] - (width - 1):]


class KimiDeltaAttention(MegatronModule):
    """KDA as a TransformerLayer's ``self_attention``: input [s, b, d] (s split over TP under
    sequence parallelism), output ``(out [s, b, d], bias None)``."""

    def __init__(self, config: TransformerConfig, submodules: KimiDeltaAttentionSubmodules,
                 layer_number: Optional[int] = None, kda_config: Optional[KDAConfig] = None,
                 pg_collection=None, **unused) -> None:
        super().__init__(config=config)
        if kda_config is None:
            raise ValueError("KimiDeltaAttention needs its kda_config (a KDAConfig)")
        if config.context_parallel_size > 1:
            raise NotImplementedError("KDA does not support context parallelism")
        self.kda_config = kda_config
        self.layer_number = layer_number
        self.tp_group = (pg_collection.tp if pg_collection is not None
                         else parallel_state.get_tensor_model_parallel_group())
        tp_size, tp_rank = self.tp_group.size(), self.tp_group.rank()
        H, K = kda_config.num_heads, kda_config.head_dim
        if H % tp_size:
            raise ValueError(f"KDA's {H} heads cannot be split over tensor parallelism {tp_size}")
        self.tp_size = tp_size
        self.num_heads_local = H // tp_size
        heads = slice(tp_rank * self.num_heads_local, (tp_rank + 1) * self.num_heads_local)
        channels = slice(heads.start * K, heads.stop * K)
        P, d = H * K, config.hidden_size

        def column(spec, out_features, in_features=d, name=""):
            return build_module(spec, in_features, out_features, config=config,
                                init_method=config.init_method, gather_output=False, bias=False,
                                skip_bias_add=False, is_expert=False,
                                tp_comm_buffer_name=f"kda_{name}", tp_group=self.tp_group)

        self.q_proj = column(submodules.q_proj, P, name="q")
        self.k_proj = column(submodules.k_proj, P, name="k")
        self.v_proj = column(submodules.v_proj, P, name="v")
        self.g_proj = column(submodules.g_proj, P, name="g")
        self.b_proj = column(submodules.b_proj, H, name="b")
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.f_a_proj = replicated_linear(config, d, K, device)
        self.f_b_proj = column(submodules.f_b_proj, P, in_features=K, name="f_b")
        self.o_proj = build_module(submodules.o_proj, P, d, config=config,
                                   init_method=config.output_layer_init_method, bias=False,
                                   input_is_parallel=True, skip_bias_add=True, is_expert=False,
                                   tp_comm_buffer_name="kda_o", tp_group=self.tp_group)

        width = kda_config.conv_kernel_size
        full = self._initial_values(H, K, width) if config.perform_initialization else None
        P_local = self.num_heads_local * K
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            conv = torch.nn.Conv1d(P_local, P_local, width, groups=P_local, bias=False,
                                   dtype=torch.float32, device=device)
            with torch.no_grad():
                conv.weight.copy_(full[name][channels] if full else torch.zeros_like(conv.weight))
            setattr(self, name, conv)
        self.A_log = torch.nn.Parameter(
            full["A_log"][heads].clone().to(device) if full
            else torch.zeros(self.num_heads_local, dtype=torch.float32, device=device))
        self.dt_bias = torch.nn.Parameter(
            full["dt_bias"][channels].clone().to(device) if full
            else torch.zeros(P_local, dtype=torch.float32, device=device))
        for param in (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight,
                      self.A_log, self.dt_bias):
            set_tensor_model_parallel_attributes(param, True, 0, 1)
        eps = config.layernorm_epsilon if kda_config.norm_eps is None else kda_config.norm_eps
        self.o_norm = SigmoidGatedRMSNorm(K, eps, device=device)

    @staticmethod
    def _initial_values(H: int, K: int, width: int) -> dict[str, torch.Tensor]:
        """Whole-layer starting values, drawn on the default RNG stream (the same on every TP
        rank) and sliced per rank, so any TP size starts from the same layer: convolutions as
        torch's Conv1d draws them, A = exp(A_log) uniform in [1, 16] per head, dt_bias the inverse
        softplus of a log-uniform dt in [1e-3, 1e-1] (Mamba's and fla's KDA's)."""
        bound = 1 / math.sqrt(width)
        values = {name: torch.empty(H * K, 1, width).uniform_(-bound, bound)
                  for name in ("q_conv1d", "k_conv1d", "v_conv1d")}
        values["A_log"] = torch.empty(H).uniform_(1, 16).log()
        dt = torch.empty(H * K).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp(min=1e-4)
        values["dt_bias"] = dt + torch.log(-torch.expm1(-dt))
        return values

    # --- forward ---------------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, key_value_states=None,
                inference_context=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None,
                **unused):
        """Megatron's attention call. The causal mask and positions are not used (KDA is causal
        by construction and has none); packed sequences are refused."""
        if packed_seq_params is not None:
            raise NotImplementedError("KDA does not support packed sequences (packed_seq_params)")
        if key_value_states is not None:
            raise NotImplementedError("KDA is self-attention only (key_value_states given)")
        context = inference_context if inference_context is not None else inference_params
        if context is None:
            out, bias, _ = self.forward_with_state(hidden_states)
            return out, bias
        store, rows = self._context_state(context, hidden_states.shape[1], hidden_states.device)
        state = KDAState(conv=store.conv[rows], recurrent=store.recurrent[rows])
        out, bias, new = self.forward_with_state(hidden_states, state, return_state=True)
        with torch.no_grad():
            store.conv[rows] = new.conv
            store.recurrent[rows] = new.recurrent
        return out, bias

    def empty_state(self, batch: int, device) -> KDAState:
        """The state before the first token: zeros."""
        K = self.kda_config.head_dim
        P_local = self.num_heads_local * K
        return KDAState(
            conv=torch.zeros(batch, 3, P_local, self.kda_config.conv_kernel_size - 1,
                             dtype=torch.float32, device=device),
            recurrent=torch.zeros(batch, self.num_heads_local, K, K, dtype=torch.float32,
                                  device=device))

    def _context_state(self, context, batch: int, device):
        """This layer's state in a static inference context, and the rows of this batch; the rows
        start from zero at sequence offset 0 (a new prompt)."""
        if not context.is_static_batching():
            raise NotImplementedError("KDA keeps its state in a StaticInferenceContext only")
        start = context.batch_size_offset
        rows = slice(start, start + batch)
        store = context.key_value_memory_dict.get(self.layer_number)
        if context.sequence_len_offset == 0:
            if store is None or store.recurrent.shape[0] < rows.stop:
                store = self.empty_state(max(context.max_batch_size, rows.stop), device)
                context.key_value_memory_dict[self.layer_number] = store
            store.conv[rows] = 0
            store.recurrent[rows] = 0
        elif store is None:
            raise RuntimeError(f"KDA layer {self.layer_number}: the inference context is at offset "
                               f"{context.sequence_len_offset} but holds no state of this layer")
        return store, rows

    def forward_with_state(self, hidden_states: torch.Tensor, state: Optional[KDAState] = None,
                           return_state: bool = False):
        """``(out [s, b, d], bias, new state or None)`` continuing from ``state`` (zeros when
        None): with s = 1 (sequence parallelism off, as in generation) one decode step."""
        H, K = self.num_heads_local, self.kda_config.head_dim
        q, _ = self.q_proj(hidden_states)  # [s, b, P_local]: the whole sequence
        k, _ = self.k_proj(hidden_states)
        v, _ = self.v_proj(hidden_states)
        gate, _ = self.g_proj(hidden_states)
        beta_logits, _ = self.b_proj(hidden_states)
        decay_in, _ = self.f_b_proj(self.f_a_proj(hidden_states))
        s, b = q.shape[:2]

        conv_state = [None] * 3 if state is None else state.conv.unbind(1)
        convolved, new_conv = [], []
        for x, conv, prev in zip((q, k, v), (self.q_conv1d, self.k_conv1d, self.v_conv1d),
                                 conv_state):
            y, tail = causal_depthwise_conv(x.transpose(0, 1), conv.weight, prev)
            convolved.append(y.reshape(b, s, H, K))
            new_conv.append(tail)
        q, k, v = convolved

        decay_in = decay_in.transpose(0, 1).float().reshape(b, s, H, K)
        g = self.kda_config.gate_lower_bound * torch.sigmoid(
            self.A_log.float().exp().view(H, 1) * (decay_in + self.dt_bias.float().view(H, K)))
        beta = torch.sigmoid(beta_logits.transpose(0, 1).float())
        o, final = kda(q, k, v, g, beta, scale=K ** -0.5,
                       initial_state=None if state is None else state.recurrent,
                       output_final_state=return_state, qk_l2norm=True)

        norm_weight = self.o_norm.weight
        if self.tp_size > 1:  # it weighs this rank's heads only: sum its gradient over TP
            norm_weight = copy_to_tensor_model_parallel_region(norm_weight, group=self.tp_group)
        o = self.o_norm(o, gate.transpose(0, 1).reshape(b, s, H, K), norm_weight)
        out, bias = self.o_proj(o.reshape(b, s, H * K).transpose(0, 1).contiguous())
        new_state = (KDAState(conv=torch.stack(new_conv, dim=1), recurrent=final)
                     if return_state else None)
        return out, bias, new_state

    # --- distributed checkpointing -----------------------------------------------------------------

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """Megatron's default for the linears; the head-sliced parameters (``A_log``,
        ``dt_bias``, the convolutions) sharded along dim 0 over TP."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        dp_cp_group = metadata["dp_cp_group"]
        own: dict = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        sharded = make_sharded_tensors_for_checkpoint(
            own, prefix, {"A_log": 0, "dt_bias": 0}, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=dp_cp_group)
        for name, module in self.named_children():
            if name in ("q_conv1d", "k_conv1d", "v_conv1d"):
                sharded.update(make_sharded_tensors_for_checkpoint(
                    module.state_dict(prefix="", keep_vars=True), f"{prefix}{name}.",
                    {"weight": 0}, sharded_offsets, tp_group=self.tp_group,
                    dp_cp_group=dp_cp_group))
            else:
                sharded.update(sharded_state_dict_default(
                    module, f"{prefix}{name}.", sharded_offsets, metadata, tp_group=self.tp_group))
        return sharded
