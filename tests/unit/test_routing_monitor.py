"""RoutingMonitor on one process: every metric against a numpy computation from the same routing
inputs, the collapse detectors' timing, the stop action, the JSONL log and config validation."""

import json
import logging
import math

import numpy as np
import pytest
import torch

from megatron_slmoe.moe.config import MonitorConfig
from megatron_slmoe.moe.monitor import (RoutingCollapseError, RoutingMonitor,
                                        summary_line)
from megatron_slmoe.moe.routing_stats import RoutingStatsAccumulator

# The detectors' mechanics on a few tokens per step: judge every step from the first (the
# defaults' warm-up and token minimum are tested in test_routing_health.py).
JUDGE_EVERY_STEP = {"warmup_steps": 0, "min_routed_tokens": 0}


class FakeRouter(torch.nn.Module):
    def __init__(self, num_experts, layer_number):
        super().__init__()
        self.routing_stats = RoutingStatsAccumulator(num_experts)
        self.layer_number = layer_number


class Wrapper(torch.nn.Module):
    """Stands in for DDP / Float16Module: the model sits one level down as `.module`."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def make_model(*routers):
    layers = torch.nn.ModuleList()
    for router in routers:
        layer = torch.nn.Module()
        layer.router = router
        layer.mlp = torch.nn.Linear(2, 2)  # a module without routing_stats: skipped
        layers.append(layer)
    return Wrapper(layers)


def random_batch(num_tokens, num_experts, topk, seed):
    gen = torch.Generator().manual_seed(seed)
    logits_TE = torch.randn(num_tokens, num_experts, generator=gen, dtype=torch.float64) * 3
    scores_TE = torch.softmax(logits_TE, dim=-1)
    top_TK = scores_TE.topk(topk, dim=-1).indices
    routing_map_TE = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    routing_map_TE.scatter_(1, top_TK, True)
    return logits_TE, scores_TE, routing_map_TE


def batch_from_assignments(num_experts, experts_per_token):
    """One token per entry of `experts_per_token`, routed to that expert (top-1)."""
    num_tokens = len(experts_per_token)
    logits_TE = torch.zeros(num_tokens, num_experts, dtype=torch.float64)
    routing_map_TE = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    for t, e in enumerate(experts_per_token):
        logits_TE[t, e] = 1.0
        routing_map_TE[t, e] = True
    return logits_TE, torch.softmax(logits_TE, dim=-1), routing_map_TE


def loads_batch(counts_E):
    """Top-1 batch in which expert e receives counts_E[e] tokens."""
    experts = [e for e, count in enumerate(counts_E) for _ in range(count)]
    return batch_from_assignments(len(counts_E), experts)


def reference_metrics(batches):
    """numpy over the concatenation of a step's micro-batches, independent of the accumulator."""
    logits = np.concatenate([b[0].numpy() for b in batches])
    scores = np.concatenate([b[1].numpy() for b in batches])
    routed = np.concatenate([b[2].numpy() for b in batches])
    num_tokens, num_experts = logits.shape
    tokens = routed.sum(axis=0).astype(np.float64)
    share = tokens / tokens.sum()
    nz = share[share > 0]
    probs = scores / scores.sum(axis=1, keepdims=True)
    token_entropy = np.array([-sum(p * math.log(p) for p in row if p > 0) for row in probs])
    return {
        "tokens_per_expert": [int(t) for t in tokens],
        "num_tokens": num_tokens,
        "imbalance": tokens.max() / tokens.mean(),
        "load_entropy": float(-(nz * np.log(nz)).sum() / math.log(num_experts)),
        "router_entropy": float(token_entropy.mean()),
        "logit_rms": float(np.sqrt((logits ** 2).mean())),
        "logit_max_abs": float(np.abs(logits).max()),
        "max_share": float(share.max()),
        "dominant_expert": int(share.argmax()),
    }


def record(router, batch):
    router.routing_stats.record(*batch)


def test_metrics_match_numpy_over_micro_batches_and_layers_of_different_sizes():
    routers = [FakeRouter(8, 3), FakeRouter(6, 5)]
    monitor = RoutingMonitor(make_model(*routers), MonitorConfig(dominant_fraction=0.9))
    assert monitor.layer_numbers == [3, 5]
    for it in range(1, 3):
        batches = {}
        for router in routers:
            E = router.routing_stats.num_experts
            batches[router.layer_number] = [random_batch(7, E, 2, seed=100 * it + E + mb)
                                            for mb in range(3)]
            for batch in batches[router.layer_number]:
                record(router, batch)
        result = monitor.step(it)
        assert result["iteration"] == it and result["warnings"] == []
        assert sorted(result["layers"]) == [3, 5]
        for layer_number, layer_batches in batches.items():
            got, want = result["layers"][layer_number], reference_metrics(layer_batches)
            assert got["tokens_per_expert"] == want["tokens_per_expert"]
            assert got["num_tokens"] == want["num_tokens"]
            assert got["dominant_expert"] == want["dominant_expert"]
            for key in ("imbalance", "load_entropy", "router_entropy", "logit_rms",
                        "logit_max_abs", "max_share"):
                assert got[key] == pytest.approx(want[key], rel=1e-12), key
            assert got["dead_experts_window"] == sum(t == 0 for t in want["tokens_per_expert"])


def test_balanced_and_collapsed_loads_hit_the_ends_of_the_scale():
    router = FakeRouter(4, 1)
    monitor = RoutingMonitor(make_model(router), MonitorConfig(dominant_fraction=1.0))
    record(router, loads_batch([5, 5, 5, 5]))
    layer = monitor.step(1)["layers"][1]
    assert layer["imbalance"] == pytest.approx(1.0) and layer["load_entropy"] == pytest.approx(1.0)
    record(router, loads_batch([12, 0, 0, 0]))
    layer = monitor.step(2)["layers"][1]
    assert layer["imbalance"] == pytest.approx(4.0) and layer["load_entropy"] == 0.0


def test_accumulators_are_reset_after_step():
    routers = [FakeRouter(4, 1), FakeRouter(4, 2)]
    monitor = RoutingMonitor(make_model(*routers), MonitorConfig())
    for router in routers:
        record(router, random_batch(5, 4, 2, seed=1))
    first = monitor.step(1)
    for router in routers:
        assert torch.count_nonzero(router.routing_stats.state) == 0
    # The reported figures were taken before the reset.
    assert first["layers"][1]["num_tokens"] == 5


def test_dead_experts_follow_a_rolling_window():
    window, E = 3, 5
    router = FakeRouter(E, 1)
    config = MonitorConfig(window=window, dominant_fraction=1.0)
    monitor = RoutingMonitor(make_model(router), config)
    rng = np.random.default_rng(0)
    loads = []
    for it in range(12):
        # Each expert gets tokens in a step with probability 0.3, so windows go dead and revive.
        counts = [int(rng.integers(1, 4)) if rng.random() < 0.3 else 0 for _ in range(E)]
        counts[0] = 2  # keep every step non-empty
        loads.append(counts)
        record(router, loads_batch(counts))
        got = monitor.step(it)["layers"][1]["dead_experts_window"]
        recent = loads[max(0, it - window + 1): it + 1]
        want = sum(all(step[e] == 0 for step in recent) for e in range(E))
        assert got == want, (it, recent)


def test_dead_experts_window_by_hand():
    router = FakeRouter(4, 1)
    monitor = RoutingMonitor(make_model(router), MonitorConfig(window=3, dominant_fraction=1.0))
    dead = []
    for counts in ([2, 2, 0, 1], [2, 2, 0, 0], [2, 2, 0, 0], [2, 2, 0, 0], [2, 2, 1, 0]):
        record(router, loads_batch(counts))
        dead.append(monitor.step(0)["layers"][1]["dead_experts_window"])
    # Expert 2 is dead until step 5; expert 3 drops out of the window at step 4.
    assert dead == [1, 1, 1, 2, 1]


def run_steps(monitor, router, loads):
    warnings = []
    for it, counts in enumerate(loads, start=1):
        record(router, loads_batch(counts))
        warnings.append(monitor.step(it)["warnings"])
    return warnings


def test_starving_fires_exactly_at_patience_once_per_episode_and_rearms(caplog):
    router = FakeRouter(4, 7)
    monitor = RoutingMonitor(make_model(router),
                             MonitorConfig(starved_fraction=0.1, starved_patience=3,
                                           **JUDGE_EVERY_STEP))
    starving, healthy = [10, 10, 10, 0], [10, 10, 10, 10]
    # Expert 3's share is 1/40 = 0.025 at the threshold 0.1 x 1/4: not starving (strictly below).
    edge = [13, 13, 13, 1]
    loads = [starving] * 5 + [healthy] + [starving] * 2 + [edge] + [starving] * 3
    with caplog.at_level(logging.WARNING, logger="megatron_slmoe.moe.monitor"):
        warnings = run_steps(monitor, router, loads)
    fired = [it for it, w in enumerate(warnings, start=1) if w]
    assert fired == [3, 12]
    message = warnings[2][0]
    assert "\n" not in message
    assert "layer 7" in message and "expert 3" in message and "3 steps" in message
    assert "share 0 " in message and "fair share 0.25" in message
    assert [r.getMessage() for r in caplog.records] == [warnings[2][0], warnings[11][0]]
    assert all(r.name == "megatron_slmoe.moe.monitor" for r in caplog.records)


def test_starving_counter_is_reported_and_survives_an_empty_step():
    router = FakeRouter(4, 1)
    monitor = RoutingMonitor(make_model(router),
                             MonitorConfig(starved_patience=3, **JUDGE_EVERY_STEP))
    record(router, loads_batch([4, 4, 4, 0]))
    assert monitor.step(1)["layers"][1]["starving"] == [[3, 1]]
    record(router, loads_batch([4, 4, 4, 0]))
    monitor.step(2)
    empty = monitor.step(3)["layers"][1]  # nothing recorded: no evidence, state kept
    assert empty["num_tokens"] == 0 and empty["imbalance"] == 0.0 and empty["starving"] == [[3, 2]]
    record(router, loads_batch([4, 4, 4, 0]))
    result = monitor.step(4)
    assert len(result["warnings"]) == 1 and result["layers"][1]["starving"] == [[3, 3]]


def test_dominance_fires_at_once_once_per_episode_and_rearms():
    router = FakeRouter(4, 2)
    monitor = RoutingMonitor(make_model(router),
                             MonitorConfig(dominant_fraction=0.5, starved_fraction=0.0,
                                           **JUDGE_EVERY_STEP))
    dominant, balanced = [6, 2, 1, 1], [3, 3, 2, 2]
    warnings = run_steps(monitor, router, [dominant, dominant, balanced, dominant])
    assert [len(w) for w in warnings] == [1, 0, 0, 1]
    message = warnings[0][0]
    assert "layer 2" in message and "expert 0" in message and "dominating" in message
    assert "0.6 > dominant_fraction 0.5" in message


def test_stop_raises_one_line_error_after_logging_the_record(tmp_path):
    path = tmp_path / "routing.jsonl"
    router = FakeRouter(4, 9)
    monitor = RoutingMonitor(make_model(router),
                             MonitorConfig(action="stop", jsonl_path=str(path),
                                           **JUDGE_EVERY_STEP))
    record(router, loads_batch([7, 1, 1, 1]))
    with pytest.raises(RoutingCollapseError) as info:
        monitor.step(5)
    assert isinstance(info.value, RuntimeError)
    message = str(info.value)
    assert "\n" not in message and "layer 9" in message and "expert 0" in message
    assert "0.7" in message
    (line,) = path.read_text().splitlines()
    assert json.loads(line)["warnings"] == [message]
    assert torch.count_nonzero(router.routing_stats.state) == 0


def test_jsonl_lines_parse_and_match_the_returned_dicts(tmp_path):
    path = tmp_path / "logs" / "nested" / "routing.jsonl"
    routers = [FakeRouter(4, 1), FakeRouter(4, 2)]
    monitor = RoutingMonitor(make_model(*routers),
                             MonitorConfig(jsonl_path=str(path), starved_patience=1,
                                           **JUDGE_EVERY_STEP))
    results = []
    for it in (10, 20):
        for router in routers:
            record(router, random_batch(6, 4, 1, seed=it + router.layer_number))
        results.append(monitor.step(it))
    assert any(r["warnings"] for r in results)  # the record carries warnings too
    text = path.read_text()
    assert text.endswith("\n")
    lines = text.splitlines()
    assert len(lines) == 2
    for line, result in zip(lines, results):
        parsed = json.loads(line)
        assert parsed["iteration"] == result["iteration"]
        assert parsed["warnings"] == result["warnings"]
        # JSON object keys are strings; everything else round-trips as is.
        assert parsed["layers"] == {str(n): m for n, m in result["layers"].items()}


def test_routers_are_found_through_wrappers_and_chunks():
    shared = FakeRouter(4, 4)
    exposer = torch.nn.Module()  # e.g. an MoE layer that exposes its router's accumulator
    exposer.routing_stats = shared.routing_stats
    exposer.layer_number = 4
    not_stats = torch.nn.Module()
    not_stats.routing_stats = {"tokens": 0}
    not_stats.layer_number = 8
    chunk0 = Wrapper(make_model(FakeRouter(4, 1), shared))
    chunk1 = make_model(FakeRouter(6, 9))
    chunk1.module.append(exposer)
    chunk1.module.append(not_stats)
    monitor = RoutingMonitor([chunk0, chunk1], MonitorConfig())
    assert monitor.layer_numbers == [1, 4, 9]
    assert sorted(monitor.step(1)["layers"]) == [1, 4, 9]


def test_no_routers_gives_an_empty_report():
    monitor = RoutingMonitor(torch.nn.Linear(2, 2), MonitorConfig())
    result = monitor.step(1)
    assert result == {"iteration": 1, "layers": {}, "warnings": []}
    assert summary_line(result) == "routing: no MoE layers on this rank"


@pytest.mark.parametrize("bad, field", [
    ({"window": 0}, "window"),
    ({"window": 2.5}, "window"),
    ({"window": True}, "window"),
    ({"starved_fraction": -0.1}, "starved_fraction"),
    ({"starved_fraction": 1.0}, "starved_fraction"),
    ({"starved_fraction": float("nan")}, "starved_fraction"),
    ({"starved_patience": 0}, "starved_patience"),
    ({"dominant_fraction": 0.0}, "dominant_fraction"),
    ({"dominant_fraction": 1.5}, "dominant_fraction"),
    ({"action": "halt"}, "action"),
    ({"jsonl_path": ""}, "jsonl_path"),
    ({"jsonl_path": 3}, "jsonl_path"),
])
def test_invalid_config_raises_one_line_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=f"monitor.{field}") as info:
        MonitorConfig(**bad)
    assert "\n" not in str(info.value)


def test_dominant_fraction_must_exceed_fair_share_of_the_model():
    config = MonitorConfig(dominant_fraction=0.2)
    RoutingMonitor(make_model(FakeRouter(8, 1)), config)  # 0.2 > 1/8
    with pytest.raises(ValueError, match="monitor.dominant_fraction") as info:
        RoutingMonitor(make_model(FakeRouter(8, 1), FakeRouter(4, 2)), config)  # 0.2 <= 1/4
    assert "\n" not in str(info.value) and "layer 2" in str(info.value)


@pytest.mark.parametrize("build, match", [
    (lambda: make_model(FakeRouter(4, 1), FakeRouter(4, 1)), "two routers report layer_number=1"),
    (lambda: make_model(FakeRouter(4, None)), "layer_number=None"),
    (lambda: make_model(FakeRouter(1, 1)), "at least 2"),
])
def test_bad_models_are_rejected_in_one_line(build, match):
    with pytest.raises(ValueError, match=match) as info:
        RoutingMonitor(build(), MonitorConfig(dominant_fraction=1.0))
    assert "\n" not in str(info.value)


def test_summary_line_names_the_worst_layers():
    routers = [FakeRouter(4, 1), FakeRouter(4, 2), FakeRouter(4, 3)]
    monitor = RoutingMonitor(make_model(*routers), MonitorConfig(dominant_fraction=1.0))
    record(routers[0], loads_batch([3, 3, 3, 3]))
    record(routers[1], loads_batch([9, 1, 1, 1]))  # layer 3 routes nothing this step
    result = monitor.step(1)
    line = summary_line(result)
    assert "\n" not in line
    assert "imbalance max 3.000 (layer 2)" in line
    assert f"load entropy min {result['layers'][2]['load_entropy']:.3f} (layer 2)" in line
    assert "dead experts 4" in line  # all four of the idle layer 3
