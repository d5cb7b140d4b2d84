"""Kimi Delta Attention: the chunked core equals the per-token recurrence and transformers'
Kimi-Linear paths; the Megatron layer equals the plain K3 reference layer, inside a
TransformerLayer too, and its decode steps equal one forward over the whole sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_slmoe.ops import kda as kda_ops
from megatron_slmoe.ops.kda import kda, kda_backend, kda_chunked, kda_recurrent

TOL = dict(atol=2e-6, rtol=1e-5)


def _inputs(B=2, T=100, H=2, K=16, V=12, seed=0, gate="k3", requires_grad=False):
    """q, k, v, g, beta, initial state; g as K3 computes it (-5 sigmoid(.)) or a strong decay
    (transformers' -exp(A) softplus(.) form with large A)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    pre = torch.randn(B, T, H, K, generator=gen)
    g = -5 * torch.sigmoid(2 * pre) if gate == "k3" else -16 * F.softplus(4 * pre)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    h0 = 0.5 * torch.randn(B, H, K, V, generator=gen)
    tensors = [q, k, v, g, beta, h0]
    if requires_grad:
        for t in tensors:
            t.requires_grad_(True)
    return tensors


# --- the core -------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [37, 64, 150])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrence(T, with_state):
    q, k, v, g, beta, h0 = _inputs(T=T, seed=T)
    h0 = h0 if with_state else None
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                 qk_l2norm=True)
    o, s = kda_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                       qk_l2norm=True)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(s, s_ref, **TOL)


def test_chunked_gradients_equal_recurrence():
    inputs = _inputs(T=100, seed=1, requires_grad=True)
    gen = torch.Generator().manual_seed(2)
    w_o = torch.randn(2, 100, 2, 12, generator=gen)
    w_s = torch.randn(2, 2, 16, 12, generator=gen)
    grads = []
    for fn in (kda_recurrent, kda_chunked):
        q, k, v, g, beta, h0 = inputs
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, qk_l2norm=True)
        grads.append(torch.autograd.grad((o * w_o).sum() + (s * w_s).sum(), inputs))
    for name, ref, ours in zip("q k v g beta h0".split(), *grads):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4, msg=name)


def test_strong_decay_stays_finite_and_exact():
    """Decays far below K3's bound (transformers' softplus gate with A = 16): the chunked path
    cannot factor them around a sub-block's middle and takes pairs one by one."""
    q, k, v, g, beta, h0 = _inputs(T=80, seed=3, gate="strong")
    assert g.min() < -200  # 8 such tokens overflow a factored exp in float32
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                 qk_l2norm=True)
    o, s = kda_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                       qk_l2norm=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(s, s_ref, **TOL)


@pytest.mark.parametrize("gate", ["k3", "strong"])
def test_core_equals_transformers_kimi_linear(gate):
    """transformers' Kimi-Linear KDA takes the decay and beta as computed, as ours does: given
    the same (and its in-kernel L2 norm and K^-0.5 scale), both torch paths agree with ours."""
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    q, k, v, g, beta, h0 = _inputs(T=70, H=2, K=16, V=16, seed=4, gate=gate)
    o, s = kda_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                       qk_l2norm=True)
    for fn in (hf.chunk_kimi_delta_attention, hf.recurrent_kimi_delta_attention):
        o_hf, s_hf = fn(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o, o_hf, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(s, s_hf, atol=1e-5, rtol=1e-4)


def test_one_step_after_a_prefix_continues_the_sequence():
    q, k, v, g, beta, h0 = _inputs(T=41, seed=5)
    o_all, s_all = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                       qk_l2norm=True)
    o_head, s_head = kda(q[:, :40], k[:, :40], v[:, :40], g[:, :40], beta[:, :40],
                         initial_state=h0, output_final_state=True, qk_l2norm=True)
    o_step, s_step = kda(q[:, 40:], k[:, 40:], v[:, 40:], g[:, 40:], beta[:, 40:],
                         initial_state=s_head, output_final_state=True, qk_l2norm=True)
    torch.testing.assert_close(torch.cat([o_head, o_step], 1), o_all, **TOL)
    torch.testing.assert_close(s_step, s_all, **TOL)


def test_backend_choice(monkeypatch):
    monkeypatch.delenv("SLMOE_KERNELS", raising=False)
    assert kda_backend("cpu") == "chunked"
    monkeypatch.setattr(kda_ops, "_fla_chunk_kda", lambda: object())  # as if fla were installed
    assert kda_backend("cuda") == "fla" and kda_backend("cpu") == "chunked"
    monkeypatch.setenv("SLMOE_KERNELS", "reference")
    assert kda_backend("cuda") == "chunked"
    monkeypatch.setenv("SLMOE_KERNELS", "native")
    with pytest.raises(RuntimeError, match="fla-core"):
        kda_backend("cpu")


def test_bad_inputs_are_refused():
    q, k, v, g, beta, h0 = _inputs(T=10)
    with pytest.raises(ValueError, match="log-decay"):
        kda_chunked(q, k, v, -g, beta)
    with pytest.raises(ValueError, match="beta"):
        kda(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="initial_state"):
        kda(q, k, v, g, beta, initial_state=h0[:1])


@pytest.mark.skipif(not torch.cuda.is_available() or kda_ops._fla_chunk_kda() is None,
                    reason="fla-core's chunk_kda needs CUDA and fla")
def test_fla_kernel_equals_chunked_path():
    inputs = [t.cuda() for t in _inputs(T=300, H=2, K=64, V=64, seed=6, requires_grad=False)]
    q, k, v, g, beta, h0 = inputs
    o, s = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, qk_l2norm=True)
    o_ref, s_ref = kda_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                               qk_l2norm=True)
    torch.testing.assert_close(o, o_ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(s, s_ref, atol=2e-3, rtol=2e-3)


# --- the layer ------------------------------------------------------------------------------------


@pytest.fixture
def layers(megatron_single_rank):
    from tests.helpers import kda_case

    reference = kda_case.reference_layer(seed=7)
    return reference, kda_case.build_layer(reference)


def _hidden(S=70, B=2, seed=8, requires_grad=False):
    from tests.helpers.kda_case import HIDDEN

    x = torch.randn(S, B, HIDDEN, generator=torch.Generator().manual_seed(seed))
    return x.requires_grad_(requires_grad)


def test_layer_equals_reference_with_gradients(layers):
    reference, layer = layers
    x = _hidden(requires_grad=True)
    x_ref = x.detach().transpose(0, 1).clone().requires_grad_(True)
    out, bias = layer(x, attention_mask=None)
    out_ref = reference(x_ref)
    assert bias is None
    torch.testing.assert_close(out.transpose(0, 1), out_ref, atol=1e-5, rtol=1e-4)

    w = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(9))
    (out.transpose(0, 1) * w).sum().backward()
    (out_ref * w).sum().backward()
    torch.testing.assert_close(x.grad.transpose(0, 1), x_ref.grad, atol=1e-5, rtol=1e-4)
    ref_params = dict(reference.named_parameters())
    for name, param in layer.named_parameters():
        want = ref_params[name].grad[:param.shape[0]] if name == "A_log" else ref_params[name].grad
        torch.testing.assert_close(param.grad, want, atol=1e-5, rtol=1e-4, msg=name)


def test_decode_steps_equal_the_whole_sequence(layers):
    """A prefill and single-token steps through Megatron's StaticInferenceContext, and an explicit
    state carried over uneven pieces, give the whole-sequence forward."""
    from megatron.core.inference.contexts import StaticInferenceContext

    _, layer = layers
    x = _hidden(S=40)
    with torch.no_grad():
        whole, _ = layer(x)
        context = StaticInferenceContext(max_batch_size=2, max_sequence_length=40)
        pieces = []
        for start, stop in [(0, 29)] + [(t, t + 1) for t in range(29, 40)]:
            out, _ = layer(x[start:stop], inference_context=context)
            context.increment_sequence_len_offset(stop - start)
            pieces.append(out)
        torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-5, rtol=1e-4)

        state, pieces = None, []
        for start, stop in [(0, 2), (2, 3), (3, 21), (21, 40)]:
            out, _, state = layer.forward_with_state(x[start:stop], state, return_state=True)
            pieces.append(out)
        torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-5, rtol=1e-4)

        # A new prompt (offset 0) starts from zero again, not from the last prompt's state.
        context.reset()
        again, _ = layer(x, inference_context=context)
        torch.testing.assert_close(again, whole, atol=1e-5, rtol=1e-4)


def test_layer_as_self_attention_of_a_transformer_layer(layers):
    """Megatron-Core's TransformerLayer takes it as its self_attention: out = x + KDA(norm(x))."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    from megatron_slmoe.model.kda_attention import kda_attention_spec
    from tests.helpers import kda_case

    reference, _ = layers
    config = kda_case.transformer_config()
    submodules = TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm, self_attention=kda_attention_spec(kda_case.kda_config()),
        self_attn_bda=get_bias_dropout_add)
    block = TransformerLayer(config, submodules, layer_number=1)
    kda_case.load_reference_weights(block.self_attention, reference)
    x = _hidden(S=20)
    with torch.no_grad():
        out, _ = block(x, attention_mask=None)
        want = x + reference(block.input_layernorm(x).transpose(0, 1)).transpose(0, 1)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)


def test_a_log_padding_rules():
    from megatron_slmoe.model.kda_attention import a_log_from_checkpoint, a_log_to_checkpoint

    a = torch.tensor([0.5, -1.0, 2.0])
    stored = a_log_to_checkpoint(a, 8)
    assert stored.shape == (8,) and torch.equal(a_log_from_checkpoint(stored, 3), a)
    with pytest.raises(ValueError, match="non-zero"):
        a_log_from_checkpoint(torch.ones(8), 3)
    with pytest.raises(ValueError, match="cannot hold"):
        a_log_from_checkpoint(torch.zeros(2), 3)


def test_config_from_the_release_linear_attn_config():
    from megatron_slmoe.model.kda_attention import KDAConfig

    k3 = {"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
          "use_full_rank_gate": True, "full_attn_layers": [4, 8], "kda_layers": [1, 2, 3]}
    assert KDAConfig.from_linear_attn_config(k3, norm_eps=1e-5) == KDAConfig(
        num_heads=96, head_dim=128, conv_kernel_size=4, gate_lower_bound=-5.0, norm_eps=1e-5)
    with pytest.raises(ValueError, match="low-rank output gate"):
        KDAConfig.from_linear_attn_config({**k3, "use_full_rank_gate": False})
    with pytest.raises(ValueError, match="gate_lower_bound"):
        KDAConfig.from_linear_attn_config({**k3, "gate_lower_bound": 0.0})
