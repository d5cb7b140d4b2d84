"""Routing stability under LoRA (megatron_slmoe.moe.stability), each against a pure-torch
computation from the router logits captured in the same forward:

- Megatron's own aux loss still acts with the router frozen: its gradient reaches the adapters
  before the router, equal to the gradient of Megatron's seq-aux formula written out by hand,
  which counts the top-k of the scores *without* the expert bias;
- the routed load-balancing loss is the switch loss over the routing actually used (expert bias
  included), value and gradient;
- routing preservation is the per-token KL (Bernoulli gates for a sigmoid router) to the routing
  of the base model, whose routing comes from a pass with the adapters disabled; zero at step 0;
- drift on a probe batch: zero against itself, and KL / top-k overlap / load change by hand;
- disabling the adapters gives the base model's output bitwise.
"""

import pytest
import torch

from tests.helpers.lora_models import build_model, lora_config, model_config, randomize

pytestmark = pytest.mark.usefixtures("megatron_single_rank")

SEQ, BATCH = 16, 2


@pytest.fixture(scope="module")
def mc(tmp_path_factory):
    return model_config(tmp_path_factory)


@pytest.fixture(autouse=True)
def unit_aux_loss_scale():
    """Megatron keeps the aux-loss backward scale in a class attribute that a schedule sets."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))  # the shape Megatron's schedules set
    yield


def _tokens(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (BATCH, SEQ), generator=gen), torch.arange(SEQ).expand(BATCH, SEQ)


def _lora_model(mc, targets, seed=0, **overrides):
    from megatron_slmoe.lora.inject import inject_lora

    model = build_model(mc, seed=seed, **overrides)
    inject_lora(model, lora_config(targets=targets))
    randomize(model, seed=seed + 1)
    return model


def _router(model):
    from megatron_slmoe.moe.router import SLMoERouter

    (router,) = [m for m in model.modules() if isinstance(m, SLMoERouter)]
    return router


def _capture_logits(router):
    captured = []
    router.routing_hooks.append(
        lambda r, logits_TE, probs, routing_map, valid: captured.append(
            (logits_TE, routing_map)) or probs)
    return captured


def _lora_params(model):
    from megatron_slmoe.lora.inject import lora_modules

    return [p for m in lora_modules(model) for p in m.lora_parameters()]


def _backward_zero_main_loss(model):
    """A forward whose main loss is 0: every gradient comes from the attached routing losses."""
    tokens, positions = _tokens()
    model.train()
    output = model(tokens, positions, None)
    (0.0 * output.sum()).backward(retain_graph=True)  # the tests differentiate again


def _switch_loss(norm_scores_TE, routed_TE, topk, coeff, groups):
    """Megatron's switch loss written out, per group of tokens (sequences), averaged."""
    num_experts = norm_scores_TE.shape[-1]
    total = 0.0
    for rows in groups:
        p_E = norm_scores_TE[rows].sum(dim=0)
        f_E = routed_TE[rows].sum(dim=0).float()
        tokens = len(rows)
        total = total + coeff * num_experts * (p_E * f_E).sum() / (topk * tokens * tokens)
    return total / len(groups)


def _normalised_sigmoid(logits_TE):
    scores = torch.sigmoid(logits_TE.float())
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def test_megatron_aux_loss_reaches_adapters_before_a_frozen_router(mc):
    """Megatron's seq aux loss, with the router frozen: the gradient it puts on the attention
    adapters is the gradient of its formula by hand, whose expert counts are the bias-free top-k."""
    coeff = 0.5
    model = _lora_model(mc, ["linear_qkv", "linear_proj"], moe_aux_loss_coeff=coeff)
    router = _router(model)
    assert not router.weight.requires_grad
    with torch.no_grad():  # an expert bias that changes the routing actually used
        router.expert_bias.copy_(torch.tensor([0.3, -0.3, 0.1, -0.1]))
    captured = _capture_logits(router)
    params = _lora_params(model)
    _backward_zero_main_loss(model)
    got = [p.grad.clone() for p in params]
    assert all(g.abs().sum() > 0 for g in got[:4])  # layer 0 and layer 1 attention adapters

    (logits_TE, used_TE), = captured
    norm = _normalised_sigmoid(logits_TE)
    biasless_TE = torch.zeros_like(used_TE).scatter(1, norm.topk(router.topk, dim=1).indices, True)
    assert not torch.equal(biasless_TE, used_TE)  # the bias changes the top-k
    sequences = [list(range(b, SEQ * BATCH, BATCH)) for b in range(BATCH)]  # rows are [s, b]
    by_hand = _switch_loss(norm, biasless_TE, router.topk, coeff, sequences)
    want = torch.autograd.grad(by_hand, params, allow_unused=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, torch.zeros_like(g) if w is None else w,
                                   rtol=1e-3, atol=1e-8)


def test_routed_balance_loss_counts_the_routing_actually_used(mc):
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from megatron_slmoe.moe.stability import RoutingStability

    coeff = 0.3
    model = _lora_model(mc, ["linear_qkv", "linear_proj"], moe_aux_loss_coeff=0.0)
    router = _router(model)
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([0.3, -0.3, 0.1, -0.1]))
    captured = _capture_logits(router)
    RoutingStability([model], balance_coeff=coeff)
    params = _lora_params(model)
    _backward_zero_main_loss(model)
    (logits_TE, used_TE), = captured
    by_hand = _switch_loss(_normalised_sigmoid(logits_TE), used_TE, router.topk, coeff,
                           [list(range(SEQ * BATCH))])
    logged = get_moe_layer_wise_logging_tracker()["routed_load_balancing_loss"]["values"]
    torch.testing.assert_close(logged[router.layer_number - 1], by_hand.detach() / coeff)
    want = torch.autograd.grad(by_hand, params, allow_unused=True)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, torch.zeros_like(p) if w is None else w,
                                   rtol=1e-3, atol=1e-8)


def _bernoulli_kl(p_TE, q_TE):
    return (p_TE * (p_TE / q_TE).log() + (1 - p_TE) * ((1 - p_TE) / (1 - q_TE)).log()).sum(-1)


def test_routing_preservation_is_the_kl_to_the_base_routing(mc):
    from megatron_slmoe.lora.inject import adapters_disabled
    from megatron_slmoe.moe.stability import RoutingStability

    coeff = 2.0
    model = _lora_model(mc, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                        moe_aux_loss_coeff=0.0)
    router = _router(model)
    captured = _capture_logits(router)
    stability = RoutingStability([model], kl_coeff=coeff,
                                 base_model=lambda: adapters_disabled([model]))
    tokens, positions = _tokens()
    stability.reference_pass(lambda: model(tokens, positions, None))
    params = _lora_params(model)
    _backward_zero_main_loss(model)
    (base_logits, _), (logits_TE, _) = captured
    kl_T = _bernoulli_kl(torch.sigmoid(base_logits.detach()), torch.sigmoid(logits_TE))
    by_hand = coeff * kl_T.mean()
    assert by_hand > 0
    want = torch.autograd.grad(by_hand, params, allow_unused=True)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, torch.zeros_like(p) if w is None else w,
                                   rtol=1e-3, atol=1e-8)

    # A fresh adapter (B = 0) is the base model: no divergence, no gradient.
    with torch.no_grad():
        for p in params:
            p.grad = None
            if p.shape[-1] == lora_config().rank:  # B [out, r]
                p.zero_()
    stability.reference_pass(lambda: model(tokens, positions, None))
    _backward_zero_main_loss(model)
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in params)


def test_a_step_without_its_reference_pass_is_refused(mc):
    from megatron_slmoe.lora.inject import adapters_disabled
    from megatron_slmoe.moe.stability import RoutingStability

    model = _lora_model(mc, ["linear_qkv"])
    RoutingStability([model], kl_coeff=1.0, base_model=lambda: adapters_disabled([model]))
    with pytest.raises(RuntimeError, match="no base routing"):
        _backward_zero_main_loss(model)


def test_drift_on_the_probe_batch(mc):
    from megatron_slmoe.lora.inject import adapters_disabled
    from megatron_slmoe.moe.stability import RoutingStability

    model = _lora_model(mc, ["linear_qkv", "linear_proj"])
    router = _router(model)
    stability = RoutingStability([model], base_model=lambda: adapters_disabled([model]))
    tokens, positions = _tokens(seed=3)
    probe = lambda: model(tokens, positions, None)  # noqa: E731

    # Against itself (the adapters disabled for the measurement too): no drift.
    with adapters_disabled([model]):
        (same,) = stability.measure_drift(probe, group=None).values()
    assert same == {"drift_kl": 0.0, "drift_topk_overlap": 1.0, "drift_load_change": 0.0}

    captured = _capture_logits(router)
    (drift,) = stability.measure_drift(probe, group=None).values()
    with adapters_disabled([model]), torch.no_grad():
        model.eval()
        model(tokens, positions, None)
    (now_logits, now_TE), (base_logits, base_TE) = captured
    kl = _bernoulli_kl(torch.sigmoid(base_logits), torch.sigmoid(now_logits)).mean()
    overlap = (now_TE & base_TE).sum() / (router.topk * now_TE.shape[0])
    base_share, now_share = base_TE.sum(0) / base_TE.sum(), now_TE.sum(0) / now_TE.sum()
    assert drift["drift_kl"] == pytest.approx(kl.item(), rel=1e-5)
    assert drift["drift_topk_overlap"] == pytest.approx(overlap.item())
    assert drift["drift_load_change"] == pytest.approx(
        0.5 * (base_share - now_share).abs().sum().item())
    assert drift["drift_kl"] > 0 and drift["drift_topk_overlap"] < 1


def test_disabled_adapters_give_the_base_model_bitwise(mc):
    # One thread: a multi-threaded GEMM may split its sums differently when the machine is
    # busy (seen once beside another test run), which is not what this test is about.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _disabled_adapters_bitwise(mc)
    finally:
        torch.set_num_threads(threads)


def _disabled_adapters_bitwise(mc):
    from megatron_slmoe.lora.inject import adapters_disabled, inject_lora

    model = build_model(mc, seed=5)
    tokens, positions = _tokens()
    with torch.no_grad():
        want = model.eval()(tokens, positions, None)
    inject_lora(model, lora_config())
    randomize(model, seed=6)
    with torch.no_grad():
        model.eval()
        assert not torch.equal(model(tokens, positions, None), want)
        with adapters_disabled([model]):
            assert torch.equal(model(tokens, positions, None), want)
        assert not torch.equal(model(tokens, positions, None), want)  # scaling restored
