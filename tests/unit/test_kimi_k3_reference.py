"""The K3 test reference (tests/helpers/kimi_k3_reference.py) is right, shown independently of our
package: its pieces equal transformers' Kimi-Linear where the two coincide (the KDA recurrence
given the gate, against transformers' recurrent and chunked torch paths; the KDA layer with
transformers' gate and output-gate forms swapped for K3's; the MLA without and with K3's output
gate; the MoE block without the latent width and SiTU), and what transformers lacks (SiTU, the
residual mix and its bank, the latent MoE, MXFP4) is checked against the formulas of
shared/KIMI_K3.md written out a second time here. The whole model loads a dequantised release
state dict, runs in fp32 within 2e-5 of fp64, generates greedily, and PEFT wraps it under the
release's module names."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import kimi_k3_reference as R

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

H, HEADS, HEAD_DIM = 32, 4, 8


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=_gen(seed)) * scale


def _kimi_linear_config(**overrides):
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
    from transformers.utils import logging

    logging.set_verbosity_error()
    fields = dict(
        vocab_size=64, hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, num_experts=8, num_experts_per_token=2,
        moe_intermediate_size=12, num_shared_experts=2, routed_scaling_factor=2.5,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
        linear_attn_config={"num_heads": HEADS, "head_dim": HEAD_DIM, "short_conv_kernel_size": 4,
                            "kda_layers": [1], "full_attn_layers": [2]})
    fields.update(overrides)
    config = KimiLinearConfig(**fields)
    config._attn_implementation = "eager"
    return config


def _kimi_linear():
    from transformers.models.kimi_linear import modeling_kimi_linear

    return modeling_kimi_linear


@torch.no_grad()
def _randomise(module, seed):
    gen = _gen(seed)
    for p in module.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * (1 / math.sqrt(p.shape[-1]) if p.dim() > 1
                                                      else 0.3) + (1.0 if p.dim() == 1 else 0.0))


# --------------------------------------------------------------------------------------------
# KDA
# --------------------------------------------------------------------------------------------


def _kda_inputs(B=2, T=37, seed=0):
    q = _randn(B, T, HEADS, HEAD_DIM, seed=seed)
    k = _randn(B, T, HEADS, HEAD_DIM, seed=seed + 1)
    v = _randn(B, T, HEADS, HEAD_DIM, seed=seed + 2)
    g = -5 * torch.sigmoid(_randn(B, T, HEADS, HEAD_DIM, seed=seed + 3, scale=2))
    beta = torch.sigmoid(_randn(B, T, HEADS, seed=seed + 4))
    return q, k, v, g, beta


def test_kda_recurrence_equals_transformers_recurrent_and_chunked():
    """The delta rule given the gate: output and final state equal transformers' per-token
    recurrence and its chunked form (chunk 16 over 37 tokens, so a ragged last chunk), from zero
    and from a given state."""
    kl = _kimi_linear()
    q, k, v, g, beta = _kda_inputs()
    state0 = _randn(2, HEADS, HEAD_DIM, HEAD_DIM, seed=9, scale=0.3)
    for initial in (None, state0):
        ours, ours_state = R.kda_recurrence(q, k, v, g, beta, initial)
        rec, rec_state = kl.recurrent_kimi_delta_attention(
            q, k, v, g, beta, initial_state=initial, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        chunk, chunk_state = kl.chunk_kimi_delta_attention(
            q, k, v, g, beta, chunk_size=16, initial_state=initial, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(ours, rec, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours_state, rec_state, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours, chunk, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours_state, chunk_state, rtol=1e-4, atol=1e-4)


def test_kda_recurrence_carries_its_state():
    """Two halves with the state handed over give the whole; the decay really decays."""
    q, k, v, g, beta = _kda_inputs(T=20)
    whole, whole_state = R.kda_recurrence(q, k, v, g, beta)
    first, mid = R.kda_recurrence(*(t[:, :9] for t in (q, k, v, g, beta)))
    second, end = R.kda_recurrence(*(t[:, 9:] for t in (q, k, v, g, beta)), initial_state=mid)
    torch.testing.assert_close(torch.cat([first, second], 1), whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(end, whole_state, rtol=1e-6, atol=1e-6)
    # One token, by hand: S = k (beta v)^T after L2-normalising k; o = S^T q * D^-0.5.
    o, S = R.kda_recurrence(*(t[:, :1] for t in (q, k, v, g, beta)))
    kn = F.normalize(k[:, 0], dim=-1, eps=0) * (1 / (1 + 1e-6 / (k[:, 0] ** 2).sum(-1,
                                                                     keepdim=True))) ** 0.5
    qn = F.normalize(q[:, 0], dim=-1, eps=0) * (1 / (1 + 1e-6 / (q[:, 0] ** 2).sum(-1,
                                                                     keepdim=True))) ** 0.5
    S_hand = kn.unsqueeze(-1) * (beta[:, 0, :, None] * v[:, 0]).unsqueeze(-2)
    torch.testing.assert_close(S, S_hand, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(o[:, 0], torch.einsum("bhk,bhkv->bhv", qn, S_hand) / HEAD_DIM ** 0.5,
                               rtol=1e-6, atol=1e-6)


def test_kda_gate_is_the_lower_bounded_sigmoid():
    f = _randn(2, 5, HEADS, HEAD_DIM, seed=1, scale=3)
    A_log, dt_bias = _randn(HEADS, seed=2), _randn(HEADS * HEAD_DIM, seed=3)
    g = R.kda_gate(f, A_log, dt_bias, -5.0)
    for h in range(HEADS):
        for d in range(HEAD_DIM):
            x = math.exp(A_log[h]) * (f[..., h, d] + dt_bias[h * HEAD_DIM + d])
            torch.testing.assert_close(g[..., h, d], -5.0 / (1 + torch.exp(-x)))
    assert bool((g < 0).all() and (g > -5).all())


def _kda_layer_pair(seed=0):
    """Our KDA layer and transformers' with the same weights; transformers' softplus forget gate
    and low-rank output gate swapped for K3's (the two places the layers differ)."""
    kl = _kimi_linear()
    theirs = kl.KimiLinearDeltaAttention(_kimi_linear_config(), 0).eval()
    ours = R.KimiDeltaAttention(H, HEADS, HEAD_DIM, a_log_size=128).eval()
    R.randomise_(ours, seed)
    P = HEADS * HEAD_DIM
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "b_proj", "o_proj"):
            getattr(theirs, name).weight.copy_(getattr(ours, name).weight)
        theirs.conv1d.weight.copy_(torch.cat([ours.q_conv1d.weight, ours.k_conv1d.weight,
                                              ours.v_conv1d.weight]))
        theirs.o_norm.weight.copy_(ours.o_norm.weight)
    assert theirs.conv1d.weight.shape == (3 * P, 1, 4)

    class K3ForgetGate(torch.nn.Module):
        def forward(self, x):
            f = ours.f_b_proj(ours.f_a_proj(x)).view(*x.shape[:2], HEADS, HEAD_DIM)
            return R.kda_gate(f, ours.A_log[:HEADS], ours.dt_bias, -5.0)

    theirs.forget_gate = K3ForgetGate()
    theirs.g_a_proj, theirs.g_b_proj = ours.g_proj, torch.nn.Identity()
    return ours, theirs


def test_kda_layer_equals_transformers_with_k3_gates():
    """Projections, short convolutions (transformers' fused q|k|v conv split in three), beta,
    the chunked recurrence, the gated per-head norm and o_proj coincide."""
    ours, theirs = _kda_layer_pair()
    x = _randn(2, 23, H, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-5)
    # The padded A_log entries are never read.
    with torch.no_grad():
        ours.A_log[HEADS:] = 7.0
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-5)


def test_short_convolution_is_causal_depthwise():
    conv = R.ShortConvolution(6, 4)
    with torch.no_grad():
        conv.weight.copy_(_randn(6, 1, 4, seed=1))
    x = _randn(2, 9, 6, seed=2)
    expected = F.silu(F.conv1d(x.transpose(1, 2), conv.weight, padding=3, groups=6)[..., :9])
    torch.testing.assert_close(conv(x), expected.transpose(1, 2))
    # Changing a later token changes nothing before it.
    y = x.clone()
    y[:, 5] += 1
    torch.testing.assert_close(conv(y)[:, :5], conv(x)[:, :5], rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# MLA
# --------------------------------------------------------------------------------------------


def _mla_pair(seed=0):
    kl = _kimi_linear()
    theirs = kl.KimiLinearAttention(_kimi_linear_config(), 1).eval()
    ours = R.GatedNoPEMLA(H, HEADS, 24, 16, 8, 4, 8).eval()
    R.randomise_(ours, seed)
    with torch.no_grad():
        for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                     "q_a_layernorm", "kv_a_layernorm"):
            getattr(theirs, name).weight.copy_(getattr(ours, name).weight)
    return ours, theirs


def _causal_mask(T):
    return torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]


def test_mla_equals_transformers_kimi_linear_mla():
    """Without the output gate our MLA is transformers' Kimi-Linear MLA: NoPE (the rope dims
    unrotated, k_pe one head for all), softmax scale 12^-0.5, LoRA norms with eps 1e-6. With
    the gate it is transformers' with sigmoid(g_proj(x)) multiplied in before o_proj."""
    ours, theirs = _mla_pair()
    assert theirs.q_a_layernorm.variance_epsilon == 1e-6 == ours.q_a_layernorm.eps
    assert theirs.kv_a_layernorm.variance_epsilon == 1e-6 == ours.kv_a_layernorm.eps
    assert theirs.scaling == ours.scale == 12 ** -0.5
    x = _randn(2, 11, H, seed=3)
    with torch.no_grad():
        expected, _ = theirs(x, _causal_mask(11))
        gate = ours.g_proj
        ours.g_proj = None
        torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-6)
        ours.g_proj = gate

        class GatedOProj(torch.nn.Module):
            def __init__(self, o_proj):
                super().__init__()
                self.inner = o_proj

            def forward(self, o):
                return self.inner(o * torch.sigmoid(gate(x)))

        theirs.o_proj = GatedOProj(theirs.o_proj)
        expected_gated, _ = theirs(x, _causal_mask(11))
        torch.testing.assert_close(ours(x), expected_gated, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(expected, expected_gated, atol=1e-3)


def test_mla_is_causal_and_position_free():
    """No position enters: a token's output depends on the set of earlier tokens only through
    attention, so swapping two earlier tokens leaves a later output unchanged (NoPE), and a
    later token never changes an earlier output."""
    ours, _ = _mla_pair()
    x = _randn(1, 6, H, seed=4)
    with torch.no_grad():
        out = ours(x)
        swapped = x[:, [1, 0, 2, 3, 4, 5]]
        torch.testing.assert_close(ours(swapped)[:, 2:], out[:, 2:], rtol=1e-5, atol=1e-6)
        later = x.clone()
        later[:, 4] += 1
        torch.testing.assert_close(ours(later)[:, :4], out[:, :4], rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# MoE
# --------------------------------------------------------------------------------------------


def test_moe_without_latent_equals_transformers_kimi_linear_moe():
    """Sigmoid router whose correction bias only selects, renormalised top-k weights times the
    scaling factor, SwiGLU experts, shared experts of twice the width: transformers' MoE."""
    kl = _kimi_linear()
    config = _kimi_linear_config()
    theirs = kl.KimiLinearMoE(config).eval()
    ours = R.LatentMoE(H, 8, 2, 12, 2, latent_size=None, scaling=2.5, act=R.silu_glu).eval()
    R.randomise_(ours, 3)
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.gate.weight)
        theirs.gate.e_score_correction_bias.copy_(ours.gate.e_score_correction_bias)
        for e, expert in enumerate(ours.experts):
            theirs.experts.gate_up_proj[e].copy_(torch.cat([expert.w1.weight, expert.w3.weight]))
            theirs.experts.down_proj[e].copy_(expert.w2.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(theirs.shared_experts, name).weight.copy_(
                getattr(ours.shared_experts, name).weight)
        x = _randn(3, 7, H, seed=6)
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-6)
        # The bias changes which experts are chosen but never a chosen expert's weight.
        chosen, weights = ours.gate.route(ours.gate(x.view(-1, H)))
        scores = torch.sigmoid(x.view(-1, H) @ ours.gate.weight.t())
        unbiased = scores.topk(2, dim=-1)[1]
        assert (chosen.sort(-1)[0] != unbiased.sort(-1)[0]).any()
        expected = scores.gather(1, chosen)
        torch.testing.assert_close(weights, 2.5 * expected / expected.sum(-1, keepdim=True))


def test_latent_moe_by_hand():
    """The latent MoE token by token: z = down(x); sum of the chosen experts' SiTU outputs on z
    with their weights; RMSNorm of the sum (eps 1e-5, then the weight); up; + the shared SiTU
    MLP on x."""
    moe = R.LatentMoE(H, 8, 3, 12, 2, latent_size=16).eval()
    R.randomise_(moe, 4, gain=2.0)
    x = _randn(5, H, seed=7)
    with torch.no_grad():
        out = moe(x)
        logits = x @ moe.gate.weight.t()
        for t in range(5):
            s = torch.sigmoid(logits[t])
            chosen = (s + moe.gate.e_score_correction_bias).topk(3).indices.tolist()
            w = s[chosen] / s[chosen].sum()
            z = moe.routed_expert_down_proj.weight @ x[t]
            acc = torch.zeros(16)
            for weight, e in zip(w, chosen):
                ex = moe.experts[e]
                g, u = ex.w1.weight @ z, ex.w3.weight @ z
                acc += weight * (ex.w2.weight @ (4 * torch.tanh(g / 4) * torch.sigmoid(g)
                                                 * 25 * torch.tanh(u / 25)))
            normed = acc / torch.sqrt((acc ** 2).mean() + 1e-5) * moe.routed_expert_norm.weight
            sh = moe.shared_experts
            g, u = sh.gate_proj.weight @ x[t], sh.up_proj.weight @ x[t]
            shared = sh.down_proj.weight @ (4 * torch.tanh(g / 4) * torch.sigmoid(g)
                                            * 25 * torch.tanh(u / 25))
            torch.testing.assert_close(out[t], moe.routed_expert_up_proj.weight @ normed + shared,
                                       rtol=1e-5, atol=1e-5)


def test_situ_glu_formula_and_bounds():
    g = torch.tensor([-50.0, -2.0, 0.0, 0.5, 3.0, 50.0], dtype=torch.float64)
    u = torch.tensor([-500.0, -1.0, 2.0, 0.0, 30.0, 500.0], dtype=torch.float64)
    expected = (4 * torch.tanh(g / 4) / (1 + torch.exp(-g))) * (25 * torch.tanh(u / 25))
    torch.testing.assert_close(R.situ_glu(g, u), expected)
    assert abs(R.situ_glu(torch.tensor(1e4), torch.tensor(1e4)).item() - 100.0) < 1e-3
    half = R.situ_glu(torch.tensor([2.0], dtype=torch.bfloat16), torch.tensor([3.0]))
    assert half.dtype == torch.bfloat16


# --------------------------------------------------------------------------------------------
# Attention Residuals
# --------------------------------------------------------------------------------------------


def test_attn_res_mix_by_hand():
    norm, proj = R.RMSNorm(H, 1e-5), torch.nn.Linear(H, 1, bias=False)
    R.randomise_(torch.nn.ModuleList([norm, proj]), 1)
    with torch.no_grad():
        proj.weight.mul_(4)
    bank = [_randn(2, 3, H, seed=s) for s in range(3)]
    running = _randn(2, 3, H, seed=9, scale=3)
    with torch.no_grad():
        mixed = R.attn_res_mix(running, bank, norm, proj)
    for b in range(2):
        for t in range(3):
            cands = [v[b, t] for v in [*bank, running]]
            scores = torch.stack([
                (norm.weight * (c / torch.sqrt((c ** 2).mean() + 1e-5)) * proj.weight[0]).sum()
                for c in cands])
            p = scores.softmax(0)
            torch.testing.assert_close(mixed[b, t], sum(pi * c for pi, c in zip(p, cands)),
                                       rtol=1e-5, atol=1e-6)


def test_bank_restarts_every_block():
    """The tiny model's bank: the embedding, then the running sum at layers 3, 6, 9, 12 (blocks
    of 3): 5 entries and the running sum at the output mix."""
    model = R.build()
    ids = torch.randint(0, 128, (2, 7), generator=_gen(0))
    entries = []
    for layer in model.language_model.model.layers:
        layer.register_forward_hook(
            lambda mod, args, out: entries.append((mod.index, len(out[1]))))
    with torch.no_grad():
        _, running, bank = model.language_model.model(ids, return_bank=True)
    assert [n for _, n in entries] == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 5]
    assert len(bank) == 5
    torch.testing.assert_close(bank[0], model.language_model.model.embed_tokens(ids))


# --------------------------------------------------------------------------------------------
# Configuration, weights, the whole model
# --------------------------------------------------------------------------------------------


def test_layer_kinds_from_the_release_lists():
    """K3's 1-based lists give 0-based MLA layers 3, 7, ..., 91, 92; dense layer 0 only."""
    full = list(range(4, 93, 4)) + [93]
    kda = [i for i in range(1, 94) if i not in full]
    text = R.tiny_config().to_text_config()
    text.update(num_hidden_layers=93, linear_attn_config={
        **text["linear_attn_config"], "full_attn_layers": full, "kda_layers": kda})
    config = R.KimiK3TextConfig.from_text_config(text)
    mla = [i for i, (a, _) in enumerate(config.layer_kinds()) if a == "mla"]
    assert mla == list(range(3, 92, 4)) + [92] and len(mla) == 24
    assert [m for _, m in config.layer_kinds()].count("dense") == 1
    assert config.layer_kinds()[0] == ("kda", "dense")
    with pytest.raises(ValueError, match="split the 1-based layers"):
        R.tiny_config(full_attn_layers=[4, 8, 12], kda_layers=[1, 2, 3, 5, 6, 7, 9, 10, 11])
    assert R.KimiK3TextConfig.from_text_config(R.tiny_config().to_text_config()) == R.tiny_config()


def _k3_text_config() -> dict:
    """The release's text_config (shared/KIMI_K3.md), the fields the text model reads."""
    full = list(range(4, 93, 4)) + [93]
    return dict(
        vocab_size=163840, hidden_size=7168, num_hidden_layers=93, intermediate_size=33792,
        rms_norm_eps=1e-5, hidden_act="situ", activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0, attn_res_block_size=12, num_attention_heads=96,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mla_use_nope=True, mla_use_output_gate=True,
        linear_attn_config=dict(num_heads=96, head_dim=128, short_conv_kernel_size=4,
                                gate_lower_bound=-5.0, use_full_rank_gate=True,
                                full_attn_layers=full,
                                kda_layers=[i for i in range(1, 94) if i not in full]),
        num_experts=896, num_experts_per_token=16, num_shared_experts=2,
        moe_intermediate_size=3072, routed_expert_hidden_size=3584, latent_moe_use_norm=True,
        first_k_dense_replace=1, moe_layer_freq=1, moe_router_activation_func="sigmoid",
        moe_renormalize=True, routed_scaling_factor=1.0, num_expert_group=1, topk_group=1)


def test_full_k3_shapes_follow_the_tensor_table():
    """On the meta device with K3's own config: the tensor table's shapes, and the parameter
    count 2,779,484,476,000 of the text model plus the A_log padding (69 KDA layers x 32
    zeros), counted per layer kind (a MoE layer's experts from the difference of 1 and 2)."""
    config = R.KimiK3TextConfig.from_text_config(_k3_text_config())
    kinds = config.layer_kinds()
    assert kinds.count(("kda", "moe")) == 68 and kinds.count(("mla", "moe")) == 24

    def count(module):
        return sum(p.numel() for p in module.parameters())

    with torch.device("meta"):
        top = R.KimiK3Reference(config.replace(num_hidden_layers=1, full_attn_layers=[],
                                               kda_layers=[1]))
        outside = count(top) - count(top.language_model.model.layers)
        dense = R.DecoderLayer(config, 0)
        per_kind = {}
        for index in (1, 3):
            one, two = (R.DecoderLayer(config.replace(num_experts=e, num_experts_per_token=1),
                                       index) for e in (1, 2))
            per_kind[kinds[index][0]] = count(one) + 895 * (count(two) - count(one))
        shapes = {k: tuple(v.shape) for k, v in R.DecoderLayer(
            config.replace(num_experts=2, num_experts_per_token=1), 1).state_dict().items()}
        mla_shapes = {k: tuple(v.shape) for k, v in R.DecoderLayer(
            config.replace(num_experts=2, num_experts_per_token=1), 3).state_dict().items()}
    total = outside + count(dense) + 68 * per_kind["kda"] + 24 * per_kind["mla"]
    assert total == 2_779_484_476_000 + 69 * 32
    H, P, L, I = 7168, 12288, 3584, 3072
    assert {k: shapes[k] for k in (
        "self_attn.q_conv1d.weight", "self_attn.f_a_proj.weight", "self_attn.f_b_proj.weight",
        "self_attn.A_log", "self_attn.dt_bias", "self_attn.b_proj.weight",
        "self_attn.g_proj.weight", "self_attn.o_norm.weight", "self_attn.o_proj.weight",
        "self_attention_res_proj.weight", "block_sparse_moe.gate.weight",
        "block_sparse_moe.gate.e_score_correction_bias",
        "block_sparse_moe.routed_expert_down_proj.weight",
        "block_sparse_moe.routed_expert_up_proj.weight", "block_sparse_moe.routed_expert_norm.weight",
        "block_sparse_moe.shared_experts.gate_proj.weight", "block_sparse_moe.experts.1.w1.weight",
        "block_sparse_moe.experts.1.w2.weight")} == {
        "self_attn.q_conv1d.weight": (P, 1, 4), "self_attn.f_a_proj.weight": (128, H),
        "self_attn.f_b_proj.weight": (P, 128), "self_attn.A_log": (128,),
        "self_attn.dt_bias": (P,), "self_attn.b_proj.weight": (96, H),
        "self_attn.g_proj.weight": (P, H), "self_attn.o_norm.weight": (128,),
        "self_attn.o_proj.weight": (H, P), "self_attention_res_proj.weight": (1, H),
        "block_sparse_moe.gate.weight": (2, H), "block_sparse_moe.gate.e_score_correction_bias": (2,),
        "block_sparse_moe.routed_expert_down_proj.weight": (L, H),
        "block_sparse_moe.routed_expert_up_proj.weight": (H, L),
        "block_sparse_moe.routed_expert_norm.weight": (L,),
        "block_sparse_moe.shared_experts.gate_proj.weight": (6144, H),
        "block_sparse_moe.experts.1.w1.weight": (I, L), "block_sparse_moe.experts.1.w2.weight": (L, I)}
    assert {k: mla_shapes["self_attn." + k] for k in (
        "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight",
        "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight",
        "g_proj.weight", "o_proj.weight")} == {
        "q_a_proj.weight": (1536, H), "q_a_layernorm.weight": (1536,),
        "q_b_proj.weight": (96 * 192, 1536), "kv_a_proj_with_mqa.weight": (576, H),
        "kv_a_layernorm.weight": (512,), "kv_b_proj.weight": (96 * 256, 512),
        "g_proj.weight": (P, H), "o_proj.weight": (H, P)}


def test_mxfp4_decode_by_hand_and_round_trip():
    """Byte c: element 2c in the low nibble, 2c+1 in the high; bit 3 the sign; scale 2^(s-127)."""
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x2F  # low 0xF = -6, high 0x2 = 1.0
    packed[0, 1] = 0x97  # low 0x7 = 6, high 0x9 = -0.5
    scale = torch.tensor([[125]], dtype=torch.uint8)  # 2^-2
    w = R.mxfp4_decode(packed, scale)
    assert w[0, :4].tolist() == [-1.5, 0.25, 1.5, -0.125] and w[0, 4:].abs().sum() == 0
    assert math.isnan(R.mxfp4_decode(packed, torch.tensor([[255]], dtype=torch.uint8))[0, 1])
    weight = _randn(4, 64, seed=3)
    once = R.mxfp4_decode(*R.mxfp4_encode(weight))
    assert (once - weight).abs().max() < 0.5 * weight.abs().max()
    torch.testing.assert_close(R.mxfp4_decode(*R.mxfp4_encode(once)), once, rtol=0, atol=0)


def test_release_state_dict_loads_and_gives_the_same_logits():
    """The release layout (MXFP4-packed experts) decoded back loads into a fresh model with the
    same logits; an A_log stored with another padding loads, one with non-zero padding is
    refused."""
    model = R.round_experts_to_mxfp4_(R.build(seed=1))
    state = R.release_state_dict(model)
    key = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight"
    assert state[key + "_packed"].dtype == torch.uint8 and key not in state
    assert state[key + "_packed"].shape == (32, 16) and state[key + "_scale"].shape == (32, 1)
    assert state["language_model.model.layers.0.self_attn.A_log"].shape == (128,)
    fresh = R.KimiK3Reference(R.tiny_config()).eval()
    fresh.load_state_dict(R.dequantise_release_state_dict(state))
    ids = torch.randint(0, 128, (2, 9), generator=_gen(1))
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids), model(ids), rtol=0, atol=0)
    plain = R.dequantise_release_state_dict(state)
    a_log = "language_model.model.layers.0.self_attn.A_log"
    plain[a_log] = plain[a_log][:8].clone()
    fresh.load_state_dict(plain)
    assert fresh.language_model.model.layers[0].self_attn.A_log.shape == (8,)
    plain[a_log][6] = 1.0
    with pytest.raises(ValueError, match="padding"):
        R.KimiK3Reference(R.tiny_config()).load_state_dict(plain)


def test_model_fp32_close_to_fp64_and_greedy_decode():
    model, exact = R.build(seed=2), R.build(seed=2, dtype=torch.float64)
    ids = torch.randint(0, 128, (2, 16), generator=_gen(2))
    with torch.no_grad():
        logits = model(ids)
        torch.testing.assert_close(logits.double(), exact(ids), rtol=2e-5, atol=2e-5)
    out = R.greedy_decode(model, ids[:, :5], 4)
    assert out.shape == (2, 9) and torch.equal(out[:, :5], ids[:, :5])
    with torch.no_grad():  # causal: one forward of the result predicts each generated token
        assert torch.equal(model(out[:, :-1])[:, 4:].argmax(-1), out[:, 5:])
    stop = int(out[0, 5])
    stopped = R.greedy_decode(model, ids[:, :5], 2, eos_token_id=stop)
    assert (stopped[0, 5:] == stop).all()
    # Prompts of different lengths, each alone; the answer cut after the stop token.
    answers = R.greedy_decode(model, [ids[0, :5].tolist(), ids[1, :3].tolist()], 2,
                              eos_token_id=stop)
    assert answers[0] == [stop] and len(answers[1]) in (1, 2)
    assert answers[1] == R.greedy_decode(model, ids[1:, :3], 2, stop)[0, 3:3 + len(answers[1])
                                                                          ].tolist()


def test_peft_wraps_the_reference_under_the_release_names(tmp_path):
    """LoRA on the router, experts, shared experts, latent projections, KDA and MLA projections:
    PEFT's keys are the release's module names; at initialisation (B = 0) the logits are unchanged; a
    saved adapter loads with PeftModel.from_pretrained onto a fresh reference with the same
    logits."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file

    model = R.build(seed=3)
    ids = torch.randint(0, 128, (1, 8), generator=_gen(3))
    with torch.no_grad():
        before = model(ids)
    targets = ["gate", "w1", "w2", "w3", "gate_proj", "up_proj", "down_proj",
               "routed_expert_down_proj",
               "routed_expert_up_proj", "q_proj", "k_proj", "v_proj", "o_proj", "g_proj",
               "b_proj", "f_a_proj", "f_b_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
               "kv_b_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=targets))
    keys = set(peft_model.state_dict())
    for name in ("language_model.model.layers.1.block_sparse_moe.experts.5.w1",
                 "language_model.model.layers.0.self_attn.f_b_proj",
                 "language_model.model.layers.3.self_attn.kv_b_proj",
                 "language_model.model.layers.4.block_sparse_moe.routed_expert_up_proj",
                 "language_model.model.layers.5.block_sparse_moe.gate",
                 "language_model.model.layers.0.mlp.down_proj"):
        assert f"base_model.model.{name}.lora_A.default.weight" in keys, name
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids, attention_mask=torch.ones_like(ids)),
                                   before, rtol=0, atol=0)
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=_gen(4)))
        adapted = peft_model(input_ids=ids)
    assert not torch.allclose(adapted, before, atol=1e-3)
    peft_model.save_pretrained(str(tmp_path))
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert ("base_model.model.language_model.model.layers.2.block_sparse_moe.experts.7.w2."
            "lora_B.weight") in saved
    loaded = PeftModel.from_pretrained(R.build(seed=3), str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids), adapted, rtol=0, atol=0)
