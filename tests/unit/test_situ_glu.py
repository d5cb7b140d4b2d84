"""SiTU-GLU (ops.activations.SiTUGLU), a fused gate|up activation, equals the K3 reference's
SiTU (tests/helpers/kimi_k3_reference.py) in value and gradient, and reaches every MLP that K3
runs it in: Megatron-Core's MLP (K3's dense layer 0) and, inside the Stable Latent MoE layer with
the latent RMSNorm (slmoe.latent_norm) and Megatron's sigmoid router with the selection-only
expert bias, our routed experts and Megatron's shared-expert MLP: the layer equals the
reference's ``block_sparse_moe``. The LoRA experts' op takes it too; the model config switches
Megatron's MLP onto the whole-fc1 path and refuses SiTU where it cannot work."""

from __future__ import annotations

import pytest
import torch

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.ops.activations import SiTUGLU, is_fused_glu
from megatron_slmoe.ops.lora_expert import LoRAGroupedWeights, expert_activation, lora_expert_mlp
from tests.helpers import kimi_k3_reference as R

HIDDEN, LATENT, EXPERTS, TOPK, FFN, SHARED = 32, 16, 6, 2, 12, 24


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_situ_glu_equals_the_reference_in_value_and_gradient():
    situ = SiTUGLU()
    assert situ == SiTUGLU(4.0, 25.0) and is_fused_glu(situ) and not is_fused_glu(torch.tanh)
    h = (torch.randn(7, 2 * 10, generator=_gen(0), dtype=torch.float64) * 30).requires_grad_()
    out = situ(h)
    gate, up = h.chunk(2, dim=-1)
    expected = R.situ_glu(gate, up)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    upstream = torch.randn_like(out)
    (grad,) = torch.autograd.grad((out * upstream).sum(), h)
    (grad_ref,) = torch.autograd.grad((expected * upstream).sum(), h)  # autograd's, fp64
    torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-12)
    # The backward keeps the input alone (in its dtype), nothing of the fp32 arithmetic.
    saved = []
    x = (torch.randn(4, 6, generator=_gen(11)) * 8).to(torch.bfloat16).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = situ(x)
    assert len(saved) == 1 and saved[0] is x
    (grad_bf16,) = torch.autograd.grad(y.float().sum(), x)
    x64 = x.detach().double().requires_grad_()
    (grad_64,) = torch.autograd.grad(R.situ_glu(*x64.chunk(2, -1)).sum(), x64)
    assert grad_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(grad_bf16.double(), grad_64, rtol=1e-2, atol=1e-2)
    # The input's dtype comes back; the arithmetic is fp32.
    bf16 = situ(h.detach().to(torch.bfloat16))
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16, R.situ_glu(*h.detach().to(torch.bfloat16).chunk(2, -1)))
    with pytest.raises(ValueError, match="even size"):
        situ(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="positive"):
        SiTUGLU(beta=0.0)


def test_expert_activation_and_the_lora_expert_op_take_situ():
    """The experts' activation hands SiTU the whole gate|up; the LoRA expert MLP (frozen W plus
    B A per projection) with SiTU equals the reference's experts one by one."""
    situ = SiTUGLU()
    h = torch.randn(5, 8, generator=_gen(1)) * 10
    torch.testing.assert_close(expert_activation(h, situ, gated=True), R.situ_glu(*h.chunk(2, -1)))
    with pytest.raises(ValueError, match="gated linear unit"):
        expert_activation(h, situ, gated=False)

    experts = [R.Expert(LATENT, FFN) for _ in range(3)]
    for e, expert in enumerate(experts):
        R.randomise_(expert, e, gain=3.0)
    r, scaling = 2, 0.5
    fc1 = LoRAGroupedWeights(
        torch.stack([torch.cat([ex.w1.weight, ex.w3.weight]) for ex in experts]).detach(),
        torch.randn(3, r, LATENT, generator=_gen(2)), torch.randn(3, 2 * FFN, r, generator=_gen(3)))
    fc2 = LoRAGroupedWeights(torch.stack([ex.w2.weight for ex in experts]).detach(),
                             torch.randn(3, r, FFN, generator=_gen(4)),
                             torch.randn(3, LATENT, r, generator=_gen(5)))
    counts = torch.tensor([2, 0, 3])
    x = torch.randn(5, LATENT, generator=_gen(6)) * 2
    out = lora_expert_mlp(x, counts, fc1, fc2, scaling, activation_func=situ)
    rows = []
    for row, e in zip(x, [0, 0, 2, 2, 2]):
        ex = experts[e]
        gate = ex.w1.weight @ row + scaling * fc1.lora_b[e, :FFN] @ (fc1.lora_a[e] @ row)
        up = ex.w3.weight @ row + scaling * fc1.lora_b[e, FFN:] @ (fc1.lora_a[e] @ row)
        act = R.situ_glu(gate, up)
        rows.append(ex.w2.weight @ act + scaling * fc2.lora_b[e] @ (fc2.lora_a[e] @ act))
    torch.testing.assert_close(out, torch.stack(rows).detach(), rtol=1e-5, atol=1e-5)


def _config(**overrides):
    from megatron_slmoe.model.validation import make_transformer_config

    fields = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=40,
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=FFN,
        moe_latent_size=LATENT, moe_shared_expert_intermediate_size=SHARED,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_router_dtype="fp32",
        gated_linear_unit=True, activation_func=SiTUGLU(), add_bias_linear=False,
        layernorm_epsilon=1e-5, normalization="RMSNorm", use_cpu_initialization=True,
        params_dtype=torch.float32)
    fields.update(overrides)
    return make_transformer_config(fields)


def test_model_config_switches_megatron_mlp_to_the_whole_fc1_and_refuses_misuse():
    config = _config()
    assert config.use_te_activation_func and is_fused_glu(config.activation_func)
    assert not _config(activation_func=torch.nn.functional.silu).use_te_activation_func
    with pytest.raises(ConfigError, match="^--swiglu: activation_func situ is the activation of"):
        _config(gated_linear_unit=False)
    with pytest.raises(ConfigError, match="bias-activation-fusion: activation_func situ has no"):
        _config(bias_activation_fusion=True)


@pytest.mark.usefixtures("megatron_single_rank")
def test_megatron_mlp_with_situ_equals_the_reference_dense_mlp():
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec
    from megatron.core.transformer.spec_utils import build_module

    config = _config(num_moe_experts=None, moe_latent_size=None, moe_ffn_hidden_size=None,
                     moe_shared_expert_intermediate_size=None, moe_router_enable_expert_bias=False)
    mlp = build_module(get_mlp_module_spec(use_te=False), config=config)
    reference = R.GatedMLP(HIDDEN, 40, act=R.situ_glu)
    R.randomise_(reference, 7, gain=3.0)
    with torch.no_grad():
        mlp.linear_fc1.weight.copy_(torch.cat([reference.gate_proj.weight,
                                               reference.up_proj.weight]))
        mlp.linear_fc2.weight.copy_(reference.down_proj.weight)
    x = torch.randn(6, 2, HIDDEN, generator=_gen(8)) * 2
    out, _ = mlp(x)
    torch.testing.assert_close(out, reference(x), rtol=1e-5, atol=1e-5)
    # SiTU, not SwiGLU: the same weights under Megatron's SwiGLU give something else.
    swiglu = reference.down_proj(R.silu_glu(reference.gate_proj(x), reference.up_proj(x)))
    assert not torch.allclose(out, swiglu, atol=1e-2)


@pytest.mark.usefixtures("megatron_single_rank")
def test_latent_moe_layer_equals_the_reference_block_sparse_moe():
    """Router (sigmoid, expert bias for selection only, renormalised), latent down-projection,
    SiTU experts in the latent width, the latent RMSNorm, up-projection, and Megatron's shared
    expert MLP with SiTU: our layer's output and input gradient equal the reference's."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron_slmoe.moe.config import SLMoEConfig
    from megatron_slmoe.moe.specs import get_slmoe_decoder_block_spec

    config = _config()
    spec = get_slmoe_decoder_block_spec(config, SLMoEConfig(latent_norm=True))
    layer = build_module(spec.layer_specs[0].submodules.mlp, config=config, layer_number=1)
    layer.set_layer_number(1)
    layer.eval()
    reference = R.LatentMoE(HIDDEN, EXPERTS, TOPK, FFN, SHARED // FFN, latent_size=LATENT)
    R.randomise_(reference, 9, gain=2.0)
    with torch.no_grad():
        layer.router.weight.copy_(reference.gate.weight)
        layer.router.expert_bias.copy_(reference.gate.e_score_correction_bias)
        layer.latent_down.weight.copy_(reference.routed_expert_down_proj.weight)
        layer.latent_up.weight.copy_(reference.routed_expert_up_proj.weight)
        layer.latent_norm.weight.copy_(reference.routed_expert_norm.weight)
        for e, expert in enumerate(reference.experts):
            layer.experts.fc1_weight[e].copy_(torch.cat([expert.w1.weight, expert.w3.weight]))
            layer.experts.fc2_weight[e].copy_(expert.w2.weight)
        shared = reference.shared_experts
        layer.shared_experts.linear_fc1.weight.copy_(torch.cat([shared.gate_proj.weight,
                                                                shared.up_proj.weight]))
        layer.shared_experts.linear_fc2.weight.copy_(shared.down_proj.weight)
    x = (torch.randn(5, 2, HIDDEN, generator=_gen(10)) * 2).requires_grad_()
    out, _ = layer(x)
    x_ref = x.detach().clone().requires_grad_()
    expected = reference(x_ref)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    upstream = torch.randn_like(out)
    (grad,) = torch.autograd.grad((out * upstream).sum(), x)
    (grad_ref,) = torch.autograd.grad((expected * upstream).sum(), x_ref)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-4, atol=1e-5)
    # The norm is there: without it the layer differs.
    with torch.no_grad():
        layer.latent_norm.weight.mul_(2)
        assert not torch.allclose(layer(x)[0], expected, atol=1e-3)


@pytest.mark.usefixtures("megatron_single_rank")
def test_latent_norm_needs_a_latent_width():
    from megatron.core.transformer.spec_utils import build_module

    from megatron_slmoe.moe.config import SLMoEConfig
    from megatron_slmoe.moe.specs import get_slmoe_decoder_block_spec

    config = _config(moe_latent_size=None)
    spec = get_slmoe_decoder_block_spec(config, SLMoEConfig(latent_norm=True))
    with pytest.raises(ConfigError, match="latent_norm .* needs --moe-latent-size"):
        build_module(spec.layer_specs[0].submodules.mlp, config=config, layer_number=1)
