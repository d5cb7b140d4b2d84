"""Without a latent width, the Stable Latent MoE layer equals Megatron-Core's own MoELayer
(SequentialMLP experts, all-gather dispatcher) given the same weights: outputs, aux losses as
Megatron tracks them, and the gradients of the input and of every parameter."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.usefixtures("megatron_single_rank")

HIDDEN, EXPERTS, TOPK, FFN, SHARED = 16, 8, 2, 12, 20


def _config(**overrides):
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.transformer_config import TransformerConfig

    if overrides.get("activation_func") == "squared_relu":
        overrides["activation_func"] = squared_relu

    fields = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=EXPERTS,
        moe_router_topk=TOPK, moe_ffn_hidden_size=FFN, moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        moe_shared_expert_intermediate_size=SHARED, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
        params_dtype=torch.float32, moe_router_dtype="fp32",
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def _megatron_layer(config):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module

    spec = get_moe_module_spec(use_te=False, num_experts=EXPERTS, moe_grouped_gemm=False)
    layer = build_module(spec, config=config, layer_number=1)
    layer.set_layer_number(1)  # as TransformerLayer does; the aux-loss tracker needs it
    return layer


def _our_layer(config, dispatcher):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module

    from megatron_slmoe.moe.config import SLMoEConfig
    from megatron_slmoe.moe.specs import slmoe_mlp_spec

    megatron_spec = get_moe_module_spec(use_te=False, num_experts=EXPERTS, moe_grouped_gemm=False)
    layer = build_module(slmoe_mlp_spec(megatron_spec, SLMoEConfig(dispatcher=dispatcher)),
                         config=config, layer_number=1)
    layer.set_layer_number(1)
    return layer


def _copy_weights(megatron_layer, ours):
    with torch.no_grad():
        ours.router.weight.copy_(megatron_layer.router.weight)
        if megatron_layer.router.expert_bias is not None:
            bias = torch.randn(EXPERTS, generator=torch.Generator().manual_seed(3)) * 0.1
            megatron_layer.router.expert_bias.copy_(bias)
            ours.router.expert_bias.copy_(bias)
        for e, expert in enumerate(megatron_layer.experts.local_experts):
            ours.experts.fc1_weight[e].copy_(expert.linear_fc1.weight)
            ours.experts.fc2_weight[e].copy_(expert.linear_fc2.weight)
        ours.shared_experts.load_state_dict(megatron_layer.shared_experts.state_dict())


def _grads(layer):
    """Gradients keyed by Megatron's parameter names (ours mapped onto theirs)."""
    grads = {"router.weight": layer.router.weight.grad}
    if hasattr(layer.experts, "fc1_weight"):
        for e in range(EXPERTS):
            grads[f"experts.{e}.fc1"] = layer.experts.fc1_weight.grad[e]
            grads[f"experts.{e}.fc2"] = layer.experts.fc2_weight.grad[e]
    else:
        for e, expert in enumerate(layer.experts.local_experts):
            grads[f"experts.{e}.fc1"] = expert.linear_fc1.weight.grad
            grads[f"experts.{e}.fc2"] = expert.linear_fc2.weight.grad
    for name, param in layer.shared_experts.named_parameters():
        grads[f"shared.{name}"] = param.grad
    return grads


def _run(layer, x, upstream):
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    clear_aux_losses_tracker()
    x = x.clone().requires_grad_(True)
    out, bias = layer(x)
    assert bias is None
    (out * upstream).sum().backward()
    tracked = {name: entry["values"].clone()
               for name, entry in get_moe_layer_wise_logging_tracker().items()}
    return out.detach(), x.grad, tracked


CASES = {
    "softmax-aux": {},
    "sigmoid-aux": dict(moe_router_score_function="sigmoid"),
    "softmax-seq-aux": dict(moe_router_load_balancing_type="seq_aux_loss"),
    "softmax-global-aux": dict(moe_router_load_balancing_type="global_aux_loss"),
    "combined-aux": dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                         moe_aux_loss_coeff=[1e-2, 5e-3]),
    "sigmoid-group-limited-bias": dict(
        moe_router_score_function="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2,
        moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5),
    "softmax-group-limited-zloss-prenorm": dict(
        moe_router_num_groups=4, moe_router_group_topk=2, moe_z_loss_coeff=1e-3,
        moe_router_pre_softmax=True),
    # Non-gated experts (and shared expert) with squared ReLU, as Megatron-Core chooses them.
    "nongated-squared-relu": dict(gated_linear_unit=False, activation_func="squared_relu"),
}


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_megatron_moe_layer(case, dispatcher):
    torch.manual_seed(0)
    config = _config(**CASES[case])
    megatron_layer = _megatron_layer(config)
    ours = _our_layer(_config(**CASES[case]), dispatcher)
    _copy_weights(megatron_layer, ours)

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 3, HIDDEN, generator=gen)  # [S, B, d]
    upstream = torch.randn(6, 3, HIDDEN, generator=gen)
    out_ref, dx_ref, tracked_ref = _run(megatron_layer, x, upstream)
    out, dx, tracked = _run(ours, x, upstream)

    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-6)
    assert tracked.keys() == tracked_ref.keys() and tracked_ref, "aux losses not tracked"
    for name in tracked_ref:
        torch.testing.assert_close(tracked[name], tracked_ref[name], rtol=1e-6, atol=0)
    grads, grads_ref = _grads(ours), _grads(megatron_layer)
    for name, grad_ref in grads_ref.items():
        torch.testing.assert_close(grads[name], grad_ref, rtol=1e-5, atol=1e-6, msg=name)
