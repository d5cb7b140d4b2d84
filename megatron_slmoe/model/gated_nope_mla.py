"""Gated NoPE multi-latent attention on Megatron-Core's MLA (Kimi K3's full-attention layers).

DeepSeek's MLA (Megatron-Core's ``MLASelfAttention``: q and kv LoRA down-projections, their
RMSNorms, up-projections, one shared rope key head) with three changes:

* **no rotation**: the ``qk_pos_emb_head_dim`` dims still join the dot product (the shared key
  head broadcast to all heads), unrotated. Megatron's MLA always rotates them; here every
  rotary frequency is zero, so the rotation is the identity exactly (cos 0 = 1, sin 0 = 0) in
  training and in Megatron's inference paths alike. The softmax scale stays Megatron's
  ``(qk_head_dim + qk_pos_emb_head_dim)^-0.5`` (192^-0.5 for K3; ``rope_type`` must be
  ``rope``: yarn would rescale it);
* **output gate**: o <- o * sigmoid(linear_gate(x)) per head and channel, before ``linear_proj``
  (the release's ``self_attn.g_proj``, [heads * v_head_dim, hidden]); ``linear_gate`` is
  column-parallel like the heads, so each TP rank gates its own heads;
* **LoRA norm eps**: ``q_layernorm`` and ``kv_layernorm`` take their own eps (1e-6 in K3, whose
  other norms take 1e-5), so the spec must give them as separate modules (Megatron's local
  spec does with ``qk_layernorm``; a spec without them or fusing them into the up-projections
  is refused).

Release names: q_a_proj = linear_q_down_proj, q_a_layernorm = q_layernorm, q_b_proj =
linear_q_up_proj, kv_a_proj_with_mqa = linear_kv_down_proj, kv_a_layernorm = kv_layernorm,
kv_b_proj = linear_kv_up_proj, g_proj = linear_gate, o_proj = linear_proj. The layouts are the
same (per head [nope | rope] queries, [nope | v] key-values, the latent then the rope key).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.moe.specs import TensorParallelMLA

LORA_NORM_EPS = 1e-6
"""Kimi K3's eps of q_a_layernorm and kv_a_layernorm."""


@dataclass
class GatedNoPEMLASubmodules(MLASelfAttentionSubmodules):
    linear_gate: Union[ModuleSpec, type] = ColumnParallelLinear


class GatedNoPEMultiLatentAttention(TensorParallelMLA):
    """Megatron-Core's MLA self-attention without rotation, with a sigmoid output gate and its
    own eps on the LoRA norms (see the module docstring)."""

    def __init__(self, config, submodules: GatedNoPEMLASubmodules, layer_number: int,
                 attn_mask_type=AttnMaskType.padding, cp_comm_type: Optional[str] = None,
                 pg_collection=None, lora_norm_eps: float = LORA_NORM_EPS) -> None:
        if config.rope_type != "rope":
            raise ConfigError(f"--rope-type {config.rope_type}: gated NoPE MLA needs 'rope' (its "
                              f"rotation is switched off; yarn would rescale the softmax)")
        if config.apply_rope_fusion:
            raise ConfigError("--apply-rope-fusion: gated NoPE MLA applies no rotation")
        for norm in ("q_layernorm", "kv_layernorm"):
            if getattr(submodules, norm) in (None, IdentityOp):
                raise ConfigError(f"--qk-layernorm: gated NoPE MLA needs {norm} as a module of "
                                  f"its own (eps {lora_norm_eps}); the layer spec has none (set "
                                  f"qk_layernorm; a spec fusing it into the up-projection "
                                  f"cannot take its eps)")
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         attn_mask_type=attn_mask_type, cp_comm_type=cp_comm_type,
                         pg_collection=pg_collection)
        # NoPE as a rotation by angle zero (RotaryEmbedding caches per call arguments; nothing
        # has been computed from the frequencies yet).
        self.rotary_pos_emb.inv_freq = torch.zeros_like(self.rotary_pos_emb.inv_freq)
        if self.config.q_lora_rank is not None:
            self.q_layernorm = build_module(submodules.q_layernorm,
                                            hidden_size=self.config.q_lora_rank,
                                            config=self.config, eps=lora_norm_eps)
        self.kv_layernorm = build_module(submodules.kv_layernorm,
                                         hidden_size=self.config.kv_lora_rank,
                                         config=self.config, eps=lora_norm_eps)
        self.linear_gate = build_module(
            submodules.linear_gate, self.config.hidden_size, self.query_projection_size,
            config=self.config, init_method=self.config.init_method, gather_output=False,
            bias=False, skip_bias_add=False, is_expert=False, tp_comm_buffer_name="gate",
            tp_group=self.pg_collection.tp)
        self._gate_logits: Optional[torch.Tensor] = None
        self.linear_proj.register_forward_pre_hook(self._apply_output_gate)

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        # The gate's logits live for this call only: linear_proj's pre-hook multiplies them in.
        self._gate_logits, _ = self.linear_gate(hidden_states)
        try:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        finally:
            self._gate_logits = None

    def _apply_output_gate(self, module, args):
        core_attn_out, *rest = args
        gate = self._gate_logits
        if gate is None:
            raise RuntimeError("linear_proj of gated NoPE MLA ran outside its forward")
        return (core_attn_out * torch.sigmoid(gate).view_as(core_attn_out), *rest)


def gated_nope_mla_spec(mla_spec: ModuleSpec, lora_norm_eps: float = LORA_NORM_EPS,
                        linear_gate: Union[ModuleSpec, type] = ColumnParallelLinear
                        ) -> ModuleSpec:
    """The gated NoPE MLA spec from Megatron's MLA self-attention spec (as its layer specs build
    it): the same submodules and parameters, plus the gate."""
    submodules = GatedNoPEMLASubmodules(
        **{f.name: getattr(mla_spec.submodules, f.name)
           for f in dataclasses.fields(MLASelfAttentionSubmodules)},
        linear_gate=linear_gate)
    return ModuleSpec(module=GatedNoPEMultiLatentAttention, submodules=submodules,
                      params={**(mla_spec.params or {}), "lora_norm_eps": lora_norm_eps})
