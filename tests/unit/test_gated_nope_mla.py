"""Gated NoPE MLA on Megatron-Core's MLA (model.gated_nope_mla) equals the K3 reference's MLA
(tests/helpers/kimi_k3_reference.GatedNoPEMLA, itself held to transformers' Kimi-Linear MLA):
no rotation, softmax scale (nope + rope)^-0.5, the sigmoid output gate before linear_proj, eps
1e-6 on the LoRA norms; output and gradients, with the release's weights mapped onto Megatron's
names. Megatron's own MLA (rotating) with the same weights differs, so the comparison can fail."""

from __future__ import annotations

import pytest
import torch

from megatron_slmoe.config.errors import ConfigError
from tests.helpers import kimi_k3_reference as R

pytestmark = pytest.mark.usefixtures("megatron_single_rank")

HIDDEN, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V = 32, 4, 24, 16, 8, 4, 8

# Megatron name <- release name (self_attn.*)
RELEASE_NAMES = {
    "linear_q_down_proj": "q_a_proj", "q_layernorm": "q_a_layernorm",
    "linear_q_up_proj": "q_b_proj", "linear_kv_down_proj": "kv_a_proj_with_mqa",
    "kv_layernorm": "kv_a_layernorm", "linear_kv_up_proj": "kv_b_proj",
    "linear_gate": "g_proj", "linear_proj": "o_proj",
}


def _config(**overrides):
    from megatron_slmoe.model.validation import make_transformer_config

    fields = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, multi_latent_attention=True,
        q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA, qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE,
        v_head_dim=V, rope_type="rope", qk_layernorm=True, normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        add_bias_linear=False, use_cpu_initialization=True, params_dtype=torch.float32,
        ffn_hidden_size=64, attention_dropout=0.0, hidden_dropout=0.0)
    fields.update(overrides)
    return make_transformer_config(fields)


def _mla_spec(config):
    from megatron_slmoe.moe.specs import get_slmoe_decoder_block_spec

    return get_slmoe_decoder_block_spec(config).layer_specs[0].submodules.self_attention


def _pair(seed=0, gated=True):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_slmoe.model.gated_nope_mla import gated_nope_mla_spec

    config = _config()
    spec = gated_nope_mla_spec(_mla_spec(config)) if gated else _mla_spec(config)
    ours = build_module(spec, config=config, layer_number=1)
    reference = R.GatedNoPEMLA(HIDDEN, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V)
    R.randomise_(reference, seed, gain=1.5)
    with torch.no_grad():
        for megatron_name, release_name in RELEASE_NAMES.items():
            if hasattr(ours, megatron_name):
                getattr(ours, megatron_name).weight.copy_(
                    getattr(reference, release_name).weight)
    return ours, reference


def test_gated_nope_mla_equals_the_reference():
    ours, reference = _pair()
    # Compared in float64 so that a different summation order (threads) cannot flip a bound.
    ours.double()
    reference.double()
    assert ours.q_layernorm.eps == ours.kv_layernorm.eps == 1e-6
    assert ours.softmax_scale == pytest.approx((NOPE + ROPE) ** -0.5, rel=1e-12)
    x_BSH = (torch.randn(2, 9, HIDDEN, generator=torch.Generator().manual_seed(1),
                         dtype=torch.float64)).requires_grad_()
    out_SBH, bias = ours(x_BSH.transpose(0, 1), None)
    assert bias is None
    x_ref = x_BSH.detach().clone().requires_grad_()
    expected = reference(x_ref)
    torch.testing.assert_close(out_SBH.transpose(0, 1), expected, rtol=1e-10, atol=1e-12)
    upstream = torch.randn_like(expected)
    (grad,) = torch.autograd.grad((out_SBH.transpose(0, 1) * upstream).sum(), x_BSH)
    (grad_ref,) = torch.autograd.grad((expected * upstream).sum(), x_ref)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-10, atol=1e-12)
    # Gradient of the gate's weight too: the gate acts before linear_proj.
    ours.zero_grad()
    reference.zero_grad()
    ours(x_BSH.detach().transpose(0, 1), None)[0].sum().backward()
    reference(x_BSH.detach()).sum().backward()
    torch.testing.assert_close(ours.linear_gate.weight.grad, reference.g_proj.weight.grad,
                               rtol=1e-10, atol=1e-12)


def test_megatron_mla_rotates_so_the_comparison_can_fail():
    ours, reference = _pair(gated=False)
    reference.g_proj = None
    x = torch.randn(2, 9, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = ours(x.transpose(0, 1), None)[0].transpose(0, 1)
        assert not torch.allclose(out, reference(x), atol=1e-3)
        # The first token alone sees only itself at position 0: no rotation there either way.
        torch.testing.assert_close(out[:, 0], reference(x)[:, 0], rtol=1e-5, atol=1e-6)


def test_gated_nope_mla_refuses_yarn_and_missing_lora_norms():
    from megatron.core.transformer.spec_utils import build_module

    from megatron_slmoe.model.gated_nope_mla import gated_nope_mla_spec

    for overrides, message in (({"rope_type": "yarn"}, "rope-type yarn: gated NoPE MLA needs"),
                               ({"qk_layernorm": False}, "qk-layernorm: gated NoPE MLA needs")):
        config = _config(**overrides)
        with pytest.raises(ConfigError, match=message):
            build_module(gated_nope_mla_spec(_mla_spec(config)), config=config, layer_number=1)


def test_lora_adapts_the_gate_with_the_attention_inputs():
    """The ``linear_qkv`` target adapts the gate with MLA's other input projections; with the
    adapters' B drawn non-zero, the adapted attention equals the reference with every adapted
    weight W + scaling * B A (so linear_proj's adapter sees the gated heads too)."""
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.inject import inject_lora

    ours, reference = _pair(seed=3)
    adapted = inject_lora([ours], LoRAConfig(rank=2, alpha=4.0, targets=["linear_qkv",
                                                                         "linear_proj"]))
    assert sorted(adapted) == sorted(["linear_q_down_proj", "linear_q_up_proj",
                                      "linear_kv_down_proj", "linear_kv_up_proj", "linear_gate",
                                      "linear_proj"])
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for megatron_name in adapted:
            module = getattr(ours, megatron_name)
            module.lora_B.weight.copy_(torch.randn(module.lora_B.weight.shape, generator=gen))
            module.lora_A.weight.copy_(torch.randn(module.lora_A.weight.shape, generator=gen)
                                       * 0.1)
            getattr(reference, RELEASE_NAMES[megatron_name]).weight.add_(
                module.lora_scaling * module.lora_B.weight @ module.lora_A.weight)
        x = torch.randn(2, 7, HIDDEN, generator=gen)
        torch.testing.assert_close(ours(x.transpose(0, 1), None)[0].transpose(0, 1),
                                   reference(x), rtol=1e-5, atol=1e-5)
