"""RoutingMonitor across gloo ranks: data-parallel ranks see the sum of every rank's routing (max of
the logit maximum), computed here independently from both ranks' inputs; pipeline stages each
report only the layers they hold."""

import json
import math

import numpy as np
import pytest
import torch

from tests.helpers.ranks import run_ranks

NUM_TOKENS = 6
TOPK = 2
LAYERS = {2: 4, 5: 6}  # layer_number -> num_experts
STEPS = 2


def make_batch(rank, layer_number, step):
    """Each rank, layer and step routes different tokens; rank 1's logits are larger in layer 2
    and smaller in layer 5, so a SUM of the maximum would differ from the MAX."""
    num_experts = LAYERS[layer_number]
    gen = torch.Generator().manual_seed(1000 * rank + 10 * layer_number + step)
    scale = 1.0 + 4.0 * rank if layer_number == 2 else 5.0 - 4.0 * rank
    logits_TE = torch.randn(NUM_TOKENS, num_experts, generator=gen, dtype=torch.float64) * scale
    scores_TE = torch.softmax(logits_TE, dim=-1)
    routing_map_TE = torch.zeros(NUM_TOKENS, num_experts, dtype=torch.bool)
    routing_map_TE.scatter_(1, scores_TE.topk(TOPK, dim=-1).indices, True)
    return logits_TE, scores_TE, routing_map_TE


def monitor_ranks(layer_numbers, jsonl_path=None):
    """Runs on each rank: record this rank's batches, step the monitor, return its results."""
    from megatron_slmoe.moe.monitor import MonitorConfig, RoutingMonitor
    from megatron_slmoe.moe.routing_stats import RoutingStatsAccumulator

    rank = torch.distributed.get_rank()
    model = torch.nn.ModuleList()
    for layer_number in layer_numbers:
        router = torch.nn.Module()
        router.routing_stats = RoutingStatsAccumulator(LAYERS[layer_number])
        router.layer_number = layer_number
        model.append(router)
    monitor = RoutingMonitor([model], MonitorConfig(dominant_fraction=0.9, jsonl_path=jsonl_path))
    results = []
    for step in range(STEPS):
        for router in model:
            router.routing_stats.record(*make_batch(rank, router.layer_number, step))
        results.append(monitor.step(step))
    return results


def reference(ranks, layer_number, step):
    batches = [make_batch(rank, layer_number, step) for rank in ranks]
    logits = np.concatenate([b[0].numpy() for b in batches])
    scores = np.concatenate([b[1].numpy() for b in batches])
    routed = np.concatenate([b[2].numpy() for b in batches])
    num_tokens, num_experts = logits.shape
    tokens = routed.sum(axis=0).astype(np.float64)
    share = tokens / tokens.sum()
    nz = share[share > 0]
    probs = scores / scores.sum(axis=1, keepdims=True)
    return {
        "tokens_per_expert": [int(t) for t in tokens],
        "num_tokens": num_tokens,
        "imbalance": tokens.max() / tokens.mean(),
        "load_entropy": float(-(nz * np.log(nz)).sum() / math.log(num_experts)),
        "router_entropy": float(-(probs * np.log(probs)).sum(axis=1).mean()),
        "logit_rms": float(np.sqrt((logits ** 2).mean())),
        "logit_max_abs": float(np.abs(logits).max()),
    }


def assert_layer_matches(got, want):
    assert got["tokens_per_expert"] == want["tokens_per_expert"]
    assert got["num_tokens"] == want["num_tokens"]
    for key in ("imbalance", "load_entropy", "router_entropy", "logit_rms", "logit_max_abs"):
        assert got[key] == pytest.approx(want[key], rel=1e-12), key


def test_data_parallel_ranks_report_the_sum_over_ranks(tmp_path):
    path = tmp_path / "routing.jsonl"
    results = run_ranks(monitor_ranks, 2, layer_numbers=list(LAYERS), jsonl_path=str(path))
    assert results[0] == results[1]
    for step in range(STEPS):
        for layer_number in LAYERS:
            got = results[0][step]["layers"][layer_number]
            assert_layer_matches(got, reference([0, 1], layer_number, step))
            # The maximum comes from one rank, not from adding both.
            per_rank = [reference([r], layer_number, step)["logit_max_abs"] for r in (0, 1)]
            assert got["logit_max_abs"] == pytest.approx(max(per_rank), rel=1e-12)
    # Only rank 0 of the world writes the log: one line per step.
    lines = path.read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == list(range(STEPS))


def monitor_stage(stage_layers):
    """Runs on each rank: the layers of this rank's pipeline stage."""
    from megatron.core import parallel_state

    return monitor_ranks(stage_layers[parallel_state.get_pipeline_model_parallel_rank()])


def test_pipeline_stages_report_their_own_layers_unreduced():
    stage_layers = [[2], [5]]
    results = run_ranks(monitor_stage, 2, pp=2, stage_layers=stage_layers)
    for rank, layers in enumerate(stage_layers):
        for step in range(STEPS):
            reported = results[rank][step]["layers"]
            assert sorted(reported) == layers
            for layer_number in layers:
                assert_layer_matches(reported[layer_number], reference([rank], layer_number, step))
