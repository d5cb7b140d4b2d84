"""Routing health in training: the load-balancing loss lowers load imbalance against a run with
coefficient 0, a deliberately collapsing router trips the collapse detector, a healthy run with
small steps raises no alarm with the default detector settings (warm-up, minimum routed tokens)
while a collapsed one is still caught, and the expert bias stops updating when it is frozen (by
default together with the router)."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.usefixtures("megatron_single_rank")

HIDDEN, EXPERTS, TOPK = 16, 8, 2


def _layer(slmoe=None, **overrides):
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_slmoe.moe.specs import get_slmoe_decoder_block_spec

    fields = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=EXPERTS,
        moe_router_topk=TOPK, moe_ffn_hidden_size=16, moe_latent_size=8,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        use_cpu_initialization=True, params_dtype=torch.float32, moe_router_dtype="fp32",
    )
    fields.update(overrides)
    config = TransformerConfig(**fields)
    spec = get_slmoe_decoder_block_spec(config, slmoe).layer_specs[0].submodules.mlp
    layer = build_module(spec, config=config, layer_number=1)
    layer.set_layer_number(1)
    return layer, config


def _skewed_inputs(steps, gen):
    """Tokens share a common direction that the skewed router maps onto expert 0."""
    offset = torch.zeros(HIDDEN)
    offset[0] = 1.0
    return [torch.randn(16, 2, HIDDEN, generator=gen) + offset for _ in range(steps)]


def _train(aux_coeff, steps=60):
    from megatron_slmoe.moe.config import MonitorConfig
    from megatron_slmoe.moe.monitor import RoutingMonitor

    torch.manual_seed(0)
    layer, _ = _layer(moe_aux_loss_coeff=aux_coeff)
    with torch.no_grad():  # start collapsed: most tokens prefer experts 0 and 1
        layer.router.weight[0, 0] = 0.5
        layer.router.weight[1, 0] = 0.4
    teacher = torch.nn.Linear(HIDDEN, HIDDEN)
    monitor = RoutingMonitor(layer, MonitorConfig(starved_patience=1000))
    optimizer = torch.optim.Adam(layer.parameters(), lr=2e-2)
    imbalance = []
    for step, x in enumerate(_skewed_inputs(steps, torch.Generator().manual_seed(1))):
        out, _ = layer(x)
        loss = F.mse_loss(out, teacher(x).detach())
        optimizer.zero_grad()
        loss.backward()  # the aux loss rides on the router probs (MoEAuxLossAutoScaler)
        optimizer.step()
        imbalance.append(monitor.step(step)["layers"][1]["imbalance"])
    return imbalance


def test_aux_loss_lowers_load_imbalance():
    without = _train(aux_coeff=0.0)
    with_aux = _train(aux_coeff=3e-1)
    late = slice(-10, None)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(f"\nimbalance (max/mean tokens per expert), first step -> mean of last 10 steps: "
          f"coeff 0: {without[0]:.2f} -> {mean(without[late]):.2f}; "
          f"coeff 0.3: {with_aux[0]:.2f} -> {mean(with_aux[late]):.2f}")
    assert without[0] > 2.0  # the run starts collapsed
    assert mean(with_aux[late]) < 0.75 * mean(without[late])


def test_collapsing_router_trips_the_detector(caplog):
    from megatron_slmoe.moe.config import MonitorConfig
    from megatron_slmoe.moe.monitor import RoutingCollapseError, RoutingMonitor

    layer, _ = _layer()
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[3, 0] = 50.0  # every token's first choice is expert 3
    x = torch.randn(8, 2, HIDDEN, generator=torch.Generator().manual_seed(2)).abs()
    warn = RoutingMonitor(layer, MonitorConfig(starved_patience=3, dominant_fraction=0.4,
                                                warmup_steps=0, min_routed_tokens=0))
    layer(x)
    first = warn.step(0)
    print("\n" + "\n".join(first["warnings"]))
    assert any("expert 3" in w for w in first["warnings"]), first["warnings"]
    assert any("expert 3" in r.getMessage() for r in caplog.records)
    for step in (1, 2):
        layer(x)
        last = warn.step(step)
    # After `starved_patience` steps the experts that get nothing are reported as starving.
    assert any("starv" in w for w in last["warnings"]), last["warnings"]
    layer(x)
    stop = RoutingMonitor(layer, MonitorConfig(dominant_fraction=0.4, action="stop",
                                                warmup_steps=0, min_routed_tokens=0))
    with pytest.raises(RoutingCollapseError, match="layer 1"):
        stop.step(0)


def _alarms(config, steps, tokens_per_step, collapse):
    """The monitor's warnings over a run of the router alone: healthy (its random initialisation
    spreads the tokens evenly) or collapsed (every token goes to experts 3 and 5)."""
    from megatron_slmoe.moe.monitor import RoutingMonitor

    torch.manual_seed(0)
    layer, _ = _layer()
    if collapse:
        with torch.no_grad():
            layer.router.weight[3, 0], layer.router.weight[5, 0] = 50.0, 40.0
    monitor = RoutingMonitor(layer, config)
    gen = torch.Generator().manual_seed(4)
    alarms = []
    for step in range(1, steps + 1):
        x = torch.randn(tokens_per_step, 1, HIDDEN, generator=gen)
        if collapse:
            x[..., 0] = x[..., 0].abs() + 1.0
        layer.router(x)  # a training forward records the routing
        alarms += [(step, w) for w in monitor.step(step)["warnings"]]
    return alarms


def test_healthy_small_steps_raise_no_alarm_and_a_collapse_is_still_caught():
    """Four tokens a step: judged step by step, a healthy router looks dominated and starved by
    chance; with the defaults (a warm-up, then a check per 1024 routed tokens) it raises nothing,
    and the same settings catch a collapsed router right after the warm-up."""
    from megatron_slmoe.moe.config import MonitorConfig

    strict = dict(starved_patience=2, dominant_fraction=0.3)
    per_step = _alarms(MonitorConfig(**strict, warmup_steps=0, min_routed_tokens=0), 600, 4,
                       collapse=False)
    defaults = MonitorConfig(**strict)
    healthy = _alarms(defaults, 600, 4, collapse=False)
    collapsed = _alarms(defaults, 600, 4, collapse=True)
    print(f"\nhealthy router, 4 tokens/step, 600 steps: {len(per_step)} alarms judged per step, "
          f"{len(healthy)} with the defaults; collapsed router: first alarm at step "
          f"{collapsed[0][0] if collapsed else None}")
    assert len(per_step) > 10  # without the minimum these are false alarms
    assert healthy == []
    check = defaults.warmup_steps + defaults.min_routed_tokens // 4  # the first check
    assert collapsed and collapsed[0][0] == check
    assert any("dominating" in w for _, w in collapsed)
    assert any("starving" in w and "expert 0" in w for _, w in collapsed)


@pytest.mark.parametrize("slmoe_kwargs, bias_moves", [
    ({}, True),
    ({"freeze_router": True}, False),  # frozen with the router by default
    ({"freeze_router": True, "freeze_expert_bias": False}, True),
    ({"freeze_expert_bias": True}, False),
])
def test_expert_bias_updates_only_when_not_frozen(slmoe_kwargs, bias_moves):
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

    from megatron_slmoe.moe.config import SLMoEConfig

    layer, config = _layer(SLMoEConfig(**slmoe_kwargs), moe_router_score_function="sigmoid",
                           moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2)
    assert layer.router.weight.requires_grad == (not slmoe_kwargs.get("freeze_router", False))
    before = layer.router.expert_bias.clone()
    x = torch.randn(8, 2, HIDDEN, generator=torch.Generator().manual_seed(3), requires_grad=True)
    layer(x)[0].sum().backward()
    _update_router_expert_bias([layer], config)  # what Megatron's finalize_model_grads calls
    moved = not torch.equal(layer.router.expert_bias, before)
    assert moved == bias_moves


def test_monitor_reports_dispatcher_traffic_next_to_load():
    from megatron_slmoe.moe.config import MonitorConfig
    from megatron_slmoe.moe.monitor import RoutingMonitor

    layer, _ = _layer()
    monitor = RoutingMonitor(layer, MonitorConfig())
    layer(torch.randn(4, 2, HIDDEN))
    layer.traffic_stats.add(intra=100, inter=40)  # what a multi-rank exchange would have counted
    metrics = monitor.step(0)["layers"][1]
    assert (metrics["bytes_intra_node"], metrics["bytes_inter_node"]) == (100, 40)
    assert monitor.step(1)["layers"][1]["bytes_inter_node"] == 0  # counters reset each step
