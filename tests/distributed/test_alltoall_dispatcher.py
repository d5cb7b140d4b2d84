"""The all-to-all dispatcher on real gloo ranks: with expert parallelism 1, 2 and 4 the layer's
outputs and all gradients equal a single-process per-token reference, for uniform and highly
skewed routing (ranks that receive nothing), with and without a latent width, and with capacity
dropping against an independent reference of which tokens drop. Hierarchical mode (2 logical
nodes x 2 ranks) equals flat mode and sends fewer bytes between nodes."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import moe_reference
from tests.helpers.ranks import run_ranks

HIDDEN, LATENT, EXPERTS, TOPK, FFN, TOKENS_PER_RANK = 16, 8, 8, 2, 12, 12


def _params(latent: bool, skewed: bool) -> dict:
    gen = torch.Generator().manual_seed(7)
    width = LATENT if latent else HIDDEN
    params = {
        "router": torch.randn(EXPERTS, HIDDEN, generator=gen) * 0.5,
        "fc1": torch.randn(EXPERTS, 2 * FFN, width, generator=gen) * 0.3,
        "fc2": torch.randn(EXPERTS, width, FFN, generator=gen) * 0.3,
    }
    if latent:
        params["down"] = torch.randn(LATENT, HIDDEN, generator=gen) * 0.3
        params["up"] = torch.randn(HIDDEN, LATENT, generator=gen) * 0.3
    if skewed:  # every token prefers experts 0, 1, 2: the ranks holding 4..7 get nothing
        params["router"][:3, 0] += torch.tensor([6.0, 5.0, 4.0])
    return params


def _tokens(world: int, skewed: bool) -> torch.Tensor:
    x = torch.randn(world * TOKENS_PER_RANK, HIDDEN, generator=torch.Generator().manual_seed(8))
    if skewed:
        x[:, 0] = x[:, 0].abs() + 1.0
    return x


def _layer(latent: bool, slmoe_kwargs: dict, capacity=None):
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_slmoe.moe.config import SLMoEConfig
    from megatron_slmoe.moe.specs import get_slmoe_decoder_block_spec

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=EXPERTS,
        moe_router_topk=TOPK, moe_ffn_hidden_size=FFN, moe_latent_size=LATENT if latent else None,
        moe_aux_loss_coeff=0.0, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, use_cpu_initialization=True, params_dtype=torch.float32,
        moe_router_dtype="fp32", moe_expert_capacity_factor=capacity,
        moe_token_drop_policy=(slmoe_kwargs.pop("drop_policy", "probs")),
        expert_model_parallel_size=torch.distributed.get_world_size(),
        **slmoe_kwargs.pop("routing", {}),
    )
    spec = get_slmoe_decoder_block_spec(config, SLMoEConfig(**slmoe_kwargs))
    layer = build_module(spec.layer_specs[0].submodules.mlp, config=config, layer_number=1)
    layer.set_layer_number(1)
    return layer


def _load(layer, params):
    first, count = layer.local_expert_indices[0], layer.num_local_experts
    with torch.no_grad():
        layer.router.weight.copy_(params["router"])
        layer.experts.fc1_weight.copy_(params["fc1"][first:first + count])
        layer.experts.fc2_weight.copy_(params["fc2"][first:first + count])
        if "down" in params:
            layer.latent_down.weight.copy_(params["down"])
            layer.latent_up.weight.copy_(params["up"])


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _run_layer(case: dict):
    """This rank's output, input grad and parameter grads (router/latent summed over ranks)."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    params = _params(case["latent"], case["skewed"])
    x_all = _tokens(world, case["skewed"])
    mine = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    layer = _layer(case["latent"], dict(case.get("slmoe", {})), case.get("capacity"))
    _load(layer, params)
    upstream = torch.randn(x_all.shape, generator=torch.Generator().manual_seed(9))
    x = x_all[mine].clone().view(TOKENS_PER_RANK, 1, HIDDEN).requires_grad_(True)
    out, _ = layer(x)
    (out.view(TOKENS_PER_RANK, HIDDEN) * upstream[mine]).sum().backward()
    grads = {"router": layer.router.weight.grad.clone()}
    if case["latent"]:
        grads["down"] = layer.latent_down.weight.grad.clone()
        grads["up"] = layer.latent_up.weight.grad.clone()
    for shared in grads.values():  # replicated parameters: each rank saw its own tokens
        torch.distributed.all_reduce(shared)
    grads["fc1"] = layer.experts.fc1_weight.grad
    grads["fc2"] = layer.experts.fc2_weight.grad
    traffic = layer.dispatcher.traffic.state.clone() if hasattr(layer.dispatcher, "traffic") else None
    return out.detach().view(TOKENS_PER_RANK, HIDDEN), x.grad.view(TOKENS_PER_RANK, HIDDEN), \
        grads, traffic, (params, x_all, upstream, mine, layer.local_expert_indices)


def reference_check_run(cases: list[dict]) -> dict:
    """For each case: relative errors of this rank's results against the per-token reference."""
    world = torch.distributed.get_world_size()
    report = {}
    for case in cases:
        out, dx, grads, _, (params, x_all, upstream, mine, local) = _run_layer(case)
        ref_params = {k: v.double().requires_grad_(True) for k, v in params.items()}
        x_ref = x_all.double().requires_grad_(True)
        slices = [slice(r * TOKENS_PER_RANK, (r + 1) * TOKENS_PER_RANK) for r in range(world)]
        ref_out, routing = moe_reference.moe_forward(
            x_ref, ref_params, TOPK, rank_slices=slices, capacity_factor=case.get("capacity"),
            drop_policy=case.get("slmoe", {}).get("drop_policy", "probs"))
        (ref_out * upstream.double()).sum().backward()
        experts = slice(local[0], local[-1] + 1)
        errors = {"output": _rel(out, ref_out[mine].detach()), "input_grad": _rel(dx, x_ref.grad[mine])}
        for name, grad in grads.items():
            ref_grad = ref_params[name].grad
            ref_grad = ref_grad[experts] if name in ("fc1", "fc2") else ref_grad
            errors[name] = 0.0 if ref_grad.norm() == 0 and grad.norm() == 0 else _rel(grad, ref_grad)
        errors["rows_on_this_rank"] = int(routing[:, experts].sum().item())
        report[case["name"]] = errors
    return report


def flat_vs_hierarchical_run(routing: dict) -> dict:
    """Outputs, grads and traffic of flat and hierarchical mode on the same inputs."""
    results = {}
    for mode, hierarchical in (("flat", False), ("hierarchical", True)):
        case = {"latent": True, "skewed": False,
                "slmoe": {"dispatcher": "alltoall", "hierarchical_alltoall": hierarchical,
                          "node_size": 2, "routing": dict(routing)}}
        out, dx, grads, traffic, _ = _run_layer(case)
        torch.distributed.all_reduce(traffic)  # bytes over all ranks
        results[mode] = {"out": out, "dx": dx, "grads": grads, "traffic": traffic.tolist()}
    return results


CASES = [
    {"name": f"{dispatch}-{'latent' if latent else 'full'}-{'skewed' if skewed else 'uniform'}",
     "latent": latent, "skewed": skewed, "slmoe": {"dispatcher": dispatch}}
    for dispatch in ("alltoall",) for latent in (False, True) for skewed in (False, True)
] + [
    {"name": "alltoall-capacity-probs", "latent": True, "skewed": True, "capacity": 1.0,
     "slmoe": {"dispatcher": "alltoall", "drop_policy": "probs"}},
    {"name": "alltoall-capacity-position", "latent": False, "skewed": True, "capacity": 1.0,
     "slmoe": {"dispatcher": "alltoall", "drop_policy": "position"}},
    {"name": "allgather-latent-skewed", "latent": True, "skewed": True,
     "slmoe": {"dispatcher": "allgather"}},
    {"name": "alltoall-overlap3-latent-skewed", "latent": True, "skewed": True,
     "slmoe": {"dispatcher": "alltoall", "overlap_chunks": 3}},
    {"name": "alltoall-overlap4-full-uniform", "latent": False, "skewed": False,
     "slmoe": {"dispatcher": "alltoall", "overlap_chunks": 4}},
]
TOL = 1e-5


@pytest.mark.parametrize("world", [1, 2, 4])
def test_expert_parallel_layer_matches_single_process_reference(world):
    results = run_ranks(reference_check_run, world, ep=world, cases=CASES)
    for rank, report in enumerate(results):
        for case, errors in report.items():
            bad = {k: v for k, v in errors.items() if k != "rows_on_this_rank" and v > TOL}
            assert not bad, f"EP={world} rank {rank} case {case}: {bad}"
    if world == 4:  # the skewed cases really leave ranks without rows
        empty = [r for r, rep in enumerate(results)
                 if rep["alltoall-full-skewed"]["rows_on_this_rank"] == 0]
        assert empty, "skewed routing should leave some expert-parallel rank empty"


@pytest.mark.parametrize("name, routing", [
    ("uniform", {}),
    ("node-limited-1", {"moe_router_num_groups": 2, "moe_router_group_topk": 1}),
    ("node-limited-2", {"moe_router_num_groups": 2, "moe_router_group_topk": 2}),
])
def test_hierarchical_equals_flat_and_saves_inter_node_bytes(name, routing):
    results = run_ranks(flat_vs_hierarchical_run, 4, ep=4, routing=routing)
    for rank, result in enumerate(results):
        flat, hier = result["flat"], result["hierarchical"]
        assert _rel(hier["out"], flat["out"]) < TOL, f"rank {rank} output"
        assert _rel(hier["dx"], flat["dx"]) < TOL, f"rank {rank} input grad"
        for key in flat["grads"]:
            assert _rel(hier["grads"][key], flat["grads"][key]) < TOL, f"rank {rank} {key}"
    flat_inter, hier_inter = results[0]["flat"]["traffic"][1], results[0]["hierarchical"]["traffic"][1]
    print(f"\n{name}: inter-node bytes flat {flat_inter:.0f}, hierarchical {hier_inter:.0f}, "
          f"ratio {hier_inter / flat_inter:.3f}")
    assert hier_inter < flat_inter


def _timeout_minutes(group) -> float:
    backend = group._get_backend(torch.device("cpu"))
    return backend.options._timeout.total_seconds() / 60


def timeout_run() -> dict:
    from megatron.core import parallel_state

    layer = _layer(True, {"dispatcher": "alltoall", "hierarchical_alltoall": True, "node_size": 2,
                          "distributed_timeout_minutes": 7})
    return {"ep": _timeout_minutes(parallel_state.get_expert_model_parallel_group()),
            "inter": _timeout_minutes(layer.dispatcher.inter_group),
            "intra": _timeout_minutes(layer.dispatcher.intra_group)}


def test_expert_parallel_groups_honour_the_configured_timeout():
    for result in run_ranks(timeout_run, 4, ep=4, timeout_minutes=7):
        assert result == {"ep": 7.0, "inter": 7.0, "intra": 7.0}
