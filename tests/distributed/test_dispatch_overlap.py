"""The all-to-all dispatcher at realistic sparsity, on 4 gloo ranks as 2 nodes x 2, with LoRA experts
on the native op.

* Overlap changes nothing: ``dispatch_compute_combine`` with 2 and 3 chunks (exchanges of one
  chunk in flight while another computes, forward and backward) equals the same chunks run one
  after another through ``dispatch``/``experts``/``combine`` under autograd, bit for bit: outputs,
  gradients of the rows and router probabilities, and every LoRA parameter's gradient. In flat and
  in hierarchical mode.
* A token is sent at most once to each rank (flat) and crosses to each other node at most once
  (hierarchical): the dispatcher's byte counts equal the (token, rank) and (token, node) pairs
  counted here from the routing map.
"""

import torch

from tests.helpers.ranks import run_ranks

EXPERTS, TOPK, TOKENS, LATENT, FFN, RANK, NODE_SIZE = 16, 4, 20, 8, 12, 4, 2


def _experts(world: int):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.experts import LoRALatentSwiGLUExperts

    config = TransformerConfig(
        num_layers=1, hidden_size=2 * LATENT, num_attention_heads=2, num_moe_experts=EXPERTS,
        moe_router_topk=TOPK, moe_ffn_hidden_size=FFN, moe_latent_size=LATENT,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        use_cpu_initialization=True, params_dtype=torch.float32, init_method_std=0.3,
        expert_model_parallel_size=world)
    local = EXPERTS // world
    rank = torch.distributed.get_rank()
    experts = LoRALatentSwiGLUExperts(
        config, local, rank * local,
        LoRAConfig(rank=RANK, alpha=2.0 * RANK, targets=["linear_fc1", "linear_fc2"]))
    gen = torch.Generator().manual_seed(50 + rank)
    with torch.no_grad():
        for param in experts.lora_parameters():  # B starts at zero: make the adapters count
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return experts


def _routing(rank: int):
    gen = torch.Generator().manual_seed(10 + rank)
    logits = torch.randn(TOKENS, EXPERTS, generator=gen)
    top, idx = logits.topk(TOPK, dim=-1)
    probs = torch.zeros_like(logits).scatter(1, idx, top.softmax(-1))
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
    x = torch.randn(TOKENS, LATENT, generator=gen)
    upstream = torch.randn(TOKENS, LATENT, generator=gen)
    return x, probs, routing_map, upstream


def _step(experts, run, x, probs, upstream):
    """Output, gradients of x and probs, and of every trainable expert parameter."""
    experts.zero_grad(set_to_none=True)
    x, probs = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    y = run(x, probs)
    (y * upstream).sum().backward()
    grads = {name: p.grad.clone() for name, p in experts.named_parameters() if p.requires_grad}
    return {"y": y.detach(), "x": x.grad, "probs": probs.grad, **grads}


def overlap_run() -> dict:
    from megatron.core import parallel_state

    from megatron_slmoe.moe.dispatch.alltoall import AllToAllDispatcher

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    experts = _experts(world)
    local = list(range(rank * EXPERTS // world, (rank + 1) * EXPERTS // world))
    x, probs, routing_map, upstream = _routing(rank)
    report = {}
    for mode in ("flat", "hierarchical"):
        dispatcher = AllToAllDispatcher(EXPERTS, local, parallel_state.get_expert_model_parallel_group(),
                                        hierarchical=mode == "hierarchical", node_size=NODE_SIZE)
        assert dispatcher.hierarchical == (mode == "hierarchical")
        for chunks in (2, 3):
            bounds = torch.linspace(0, TOKENS, chunks + 1).long().tolist()
            parts = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]

            def one_by_one(x_, probs_):
                outs = []
                for part in parts:
                    d = dispatcher.dispatch(x_[part], probs_[part], routing_map[part])
                    out = experts(d.rows_RL, d.tokens_per_expert_E, d.probs_R)
                    outs.append(dispatcher.combine(out, d.plan))
                return torch.cat(outs)

            def overlapped(x_, probs_):
                return dispatcher.dispatch_compute_combine(x_, probs_, routing_map, experts, chunks)

            want = _step(experts, one_by_one, x, probs, upstream)
            got = _step(experts, overlapped, x, probs, upstream)
            report[f"{mode}-{chunks}"] = {
                k: (torch.equal(got[k], want[k]), (got[k] - want[k]).abs().max().item())
                for k in want}
            report[f"{mode}-{chunks}-grads-nonzero"] = all(
                v.abs().sum() > 0 for v in want.values())
        # Bytes of one dispatch: every token once per other rank / other node holding its experts.
        dispatcher.traffic.reset()
        dispatcher.dispatch(x, probs, routing_map)
        report[f"{mode}-bytes"] = (dispatcher.traffic.bytes_intra_node,
                                   dispatcher.traffic.bytes_inter_node)
    row = LATENT * x.element_size()
    ranks_hit = routing_map.view(TOKENS, world, EXPERTS // world).any(-1)  # [T, rank]
    nodes_hit = ranks_hit.view(TOKENS, world // NODE_SIZE, NODE_SIZE).any(-1)  # [T, node]
    my_node = rank // NODE_SIZE
    same_node = [r for r in range(world) if r // NODE_SIZE == my_node and r != rank]
    other = [r for r in range(world) if r // NODE_SIZE != my_node]
    report["expected-flat-bytes"] = (int(ranks_hit[:, same_node].sum()) * row,
                                     int(ranks_hit[:, other].sum()) * row)
    report["expected-hierarchical-inter-bytes"] = int(
        nodes_hit.sum() - nodes_hit[:, my_node].sum()) * row
    return report


def test_overlap_equals_one_chunk_after_another_and_tokens_go_once_per_destination():
    results = run_ranks(overlap_run, 4, ep=4, timeout=600)
    for rank, report in enumerate(results):
        for case in ("flat-2", "flat-3", "hierarchical-2", "hierarchical-3"):
            unequal = {k: diff for k, (same, diff) in report[case].items() if not same}
            assert not unequal, f"rank {rank} {case}: overlapped differs by {unequal}"
            assert report[f"{case}-grads-nonzero"], f"rank {rank} {case}: a gradient is all zero"
        assert report["flat-bytes"] == report["expected-flat-bytes"], f"rank {rank}"
        assert report["hierarchical-bytes"][1] == report["expected-hierarchical-inter-bytes"], \
            f"rank {rank}"
    # Hop A sends a token once per other node, flat once per rank there: fewer inter-node bytes.
    flat_inter = sum(r["flat-bytes"][1] for r in results)
    hier_inter = sum(r["hierarchical-bytes"][1] for r in results)
    assert hier_inter < flat_inter
