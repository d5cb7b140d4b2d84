"""With a latent width the layer equals a straightforward per-token implementation written here:
top-k on full-width fp32 logits with softmax over the chosen experts, down-projection, each chosen expert's SwiGLU in
the latent width weighted by its probability, up-projection, plus the full-width shared expert.
Also: the layer works under activation recomputation with identical results."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.usefixtures("megatron_single_rank")

HIDDEN, LATENT, EXPERTS, TOPK, FFN, SHARED = 24, 8, 6, 2, 10, 16


def _layer(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_slmoe.moe.specs import get_slmoe_decoder_block_spec
    from megatron.core.transformer.spec_utils import build_module

    fields = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=EXPERTS,
        moe_router_topk=TOPK, moe_ffn_hidden_size=FFN, moe_latent_size=LATENT,
        moe_shared_expert_intermediate_size=SHARED, moe_aux_loss_coeff=0.0,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        use_cpu_initialization=True, params_dtype=torch.float32, moe_router_dtype="fp32",
        init_method_std=0.3,  # large enough that the routed experts dominate the output
    )
    fields.update(overrides)
    config = TransformerConfig(**fields)
    block = get_slmoe_decoder_block_spec(config)
    layer = build_module(block.layer_specs[0].submodules.mlp, config=config, layer_number=1)
    layer.set_layer_number(1)
    return layer


def _reference(layer, x_SBD):
    """Token by token, from the layer's parameters, with nothing shared with its code."""
    x_TD = x_SBD.reshape(-1, HIDDEN)
    logits_TE = x_TD.double() @ layer.router.weight.double().t()
    down, up = layer.latent_down.weight.double(), layer.latent_up.weight.double()
    fc1, fc2 = layer.experts.fc1_weight.double(), layer.experts.fc2_weight.double()
    shared = layer.shared_experts
    rows = []
    for t in range(x_TD.shape[0]):
        latent = down @ x_TD[t].double()
        top_logits, top_e = logits_TE[t].topk(TOPK)
        top_p = top_logits.softmax(dim=-1)
        acc = torch.zeros(LATENT, dtype=torch.float64)
        for p, e in zip(top_p, top_e):
            gate, value = (fc1[e] @ latent).chunk(2)
            acc = acc + p * (fc2[e] @ (F.silu(gate) * value))
        sh_gate, sh_value = (shared.linear_fc1.weight.double() @ x_TD[t].double()).chunk(2)
        shared_out = shared.linear_fc2.weight.double() @ (F.silu(sh_gate) * sh_value)
        rows.append(up @ acc + shared_out)
    return torch.stack(rows).view(*x_SBD.shape[:-1], HIDDEN)


def test_latent_layer_matches_straightforward_reference():
    torch.manual_seed(0)
    layer = _layer()
    x = torch.randn(5, 2, HIDDEN, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out, _ = layer(x)
    assert out.shape == x.shape
    x_ref = x.detach().clone().requires_grad_(True)
    params = dict(layer.named_parameters())
    ref = _reference(layer, x_ref)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    # The routed path carries real weight in this comparison, not just the shared expert.
    shared_only = layer.shared_experts(x.detach())[0].double()
    assert (ref - shared_only).norm() > 0.5 * ref.norm()

    # Gradients of the input and of every parameter agree too.
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad((out * upstream).sum(), [x, *params.values()])
    ref_grads = torch.autograd.grad((ref * upstream.double()).sum(), [x_ref, *params.values()],
                                    allow_unused=True)
    for name, g, g_ref in zip(["input", *params], grads, ref_grads):
        rel = (g.double() - g_ref).norm() / g_ref.norm()
        assert rel < 1e-5, f"gradient of {name}: relative error {rel:.2e}"


def test_latent_traffic_width():
    layer = _layer()
    seen = {}
    original = layer.dispatcher.dispatch

    def spy(x_TL, probs, routing_map):
        seen["width"] = x_TL.shape[-1]
        return original(x_TL, probs, routing_map)

    layer.dispatcher.dispatch = spy
    layer(torch.randn(3, 2, HIDDEN))
    assert seen["width"] == LATENT  # rows travel in the latent width


def test_recomputation_gives_identical_results():
    torch.manual_seed(0)
    plain = _layer()
    torch.manual_seed(0)
    recomputed = _layer(recompute_granularity="selective", recompute_modules=["moe"])
    recomputed.load_state_dict(plain.state_dict())
    assert recomputed.moe_layer_recompute
    x = torch.randn(4, 2, HIDDEN, generator=torch.Generator().manual_seed(2))
    results = []
    for layer in (plain, recomputed):
        xi = x.clone().requires_grad_(True)
        out, _ = layer(xi)
        out.square().sum().backward()
        results.append((out.detach(), xi.grad, [p.grad.clone() for p in layer.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1])
    for g1, g0 in zip(results[1][2], results[0][2]):
        torch.testing.assert_close(g1, g0)
