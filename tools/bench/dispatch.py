"""Benchmark: token dispatch + combine (forward and backward) of the MoE dispatchers.

Run under torchrun; every rank is one expert-parallel rank:

    torchrun --nproc-per-node 4 tools/bench/dispatch.py --node-size 2 --json runs/bench/dispatch.json

For each shape (experts, top-k, routing, tokens) it times Megatron-Core's all-gather dispatcher
(the baseline) and all-to-all dispatcher, and ours (all-gather, flat all-to-all, and hierarchical
all-to-all when there is more than one node), at the hidden width and at the latent width, on the
same ranks with the same routing. Routing is uniform top-k, or node-limited (``--routing
node_limited``: the experts form one group per node and each token picks its k experts within
``--group-topk`` groups, as Megatron's group-limited routing does). The "expert" between dispatch
and combine only weights rows by their router probability, so the figures are the dispatcher's own
cost. Bytes are token rows sent to other ranks in one forward (dispatch + combine), summed over
ranks, by the dispatchers' accounting rule (``flat_traffic_rows``; Megatron's all-to-all sends one
row per (token, expert) pair, counted from the routing map); the backward sends as many again.
``meta_bytes_per_token`` is what rides along per token in the dispatch: our 12-byte entries
(probability, row, expert) per (token, expert) pair sent off-rank, Megatron's all-to-all its fp32
probability per row sent, the all-gather the [E] probabilities and routing mask of every token to
every peer. Every variant's combined output is checked against the baseline's before it is timed.
Prints a table and writes JSON rows with at least dispatcher, ep_size, experts, topk, routing,
latent, tokens, fwd_bwd_ms, bytes_intra_node, bytes_inter_node, bytes_per_token,
inter_bytes_per_token.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

ROUTINGS = ("uniform", "node_limited")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024], help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--latent", type=int, default=128)
    parser.add_argument("--experts", type=int, nargs="+", default=[64, 256],
                        help="routed experts (all ranks together)")
    parser.add_argument("--topk", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--routing", choices=ROUTINGS, nargs="+", default=list(ROUTINGS))
    parser.add_argument("--group-topk", type=int, default=1,
                        help="node-limited routing: nodes (expert groups) a token may use")
    parser.add_argument("--node-size", type=int, default=None,
                        help="ranks per node (default LOCAL_WORLD_SIZE); smaller than the world "
                             "emulates several nodes on one machine")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the rows here (rank 0)")
    args = parser.parse_args(argv)
    if args.latent >= args.hidden:
        parser.error("--latent must be smaller than --hidden")
    if min(args.tokens + args.topk + args.experts) <= 0 or args.reps <= 0 or args.group_topk <= 0:
        parser.error("--tokens, --topk, --experts, --group-topk and --reps must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    import megatron_slmoe
    from megatron.core import parallel_state

    from megatron_slmoe.utils.atomic import write_json_atomic

    platform = megatron_slmoe.PLATFORM
    platform.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.distributed.init_process_group(platform.backend, timeout=timedelta(minutes=10))
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    nodes = world // min(args.node_size or world, world)
    for experts in args.experts:
        if experts % world:
            print(f"error: --experts {experts} is not divisible by the {world} ranks",
                  file=sys.stderr)
            return 2
        if max(args.topk) > experts:
            print(f"error: --topk {max(args.topk)} exceeds --experts {experts}", file=sys.stderr)
            return 2
        if "node_limited" in args.routing and (args.group_topk > nodes
                                               or max(args.topk) > args.group_topk * experts // nodes):
            print(f"error: node-limited routing of top-{max(args.topk)} within {args.group_topk} "
                  f"of {nodes} nodes needs more experts per node than {experts // nodes}",
                  file=sys.stderr)
            return 2
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    torch.manual_seed(1234)
    rows = []
    for experts in args.experts:
        for topk in args.topk:
            for routing in args.routing:
                for tokens in args.tokens:
                    for width in (args.hidden, args.latent):
                        rows += bench_shape(args, tokens, width, experts, topk, routing, nodes,
                                            platform)
    if rank == 0:
        print_table(rows)
        if args.json:
            write_json_atomic(args.json, rows)
            print(f"wrote {args.json}")
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return 0


def _megatron_dispatcher(kind, num_experts, width, topk, ep):
    import torch
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import (
        MoEAllGatherTokenDispatcher,
        MoEAlltoAllTokenDispatcher,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=width, num_attention_heads=1,
                               num_moe_experts=num_experts, moe_router_topk=topk,
                               moe_ffn_hidden_size=width,
                               moe_token_dispatcher_type=kind, expert_model_parallel_size=ep,
                               add_bias_linear=False, params_dtype=torch.float32)
    cls = MoEAllGatherTokenDispatcher if kind == "allgather" else MoEAlltoAllTokenDispatcher
    local = num_experts // ep
    rank = torch.distributed.get_rank()
    return cls(local, list(range(rank * local, (rank + 1) * local)), config=config,
               pg_collection=get_default_pg_collection())


class _MegatronAdapter:
    """Megatron's six-stage dispatcher API behind our dispatch/combine contract (Megatron keeps
    its per-call state on the dispatcher, so the plan is empty)."""

    def __init__(self, dispatcher):
        self.d = dispatcher

    def dispatch(self, x_TL, probs_TE, routing_map_TE):
        from megatron_slmoe.moe.dispatch.base import Dispatched

        h, p = self.d.dispatch_preprocess(x_TL.unsqueeze(1), routing_map_TE, probs_TE)
        h, p = self.d.token_dispatch(h, p)
        rows, tokens_per_expert, probs = self.d.dispatch_postprocess(h, p)
        return Dispatched(rows, tokens_per_expert, probs, plan=None)

    def combine(self, out_RL, plan):
        return self.d.combine_postprocess(self.d.token_combine(self.d.combine_preprocess(out_RL))).view(
            -1, out_RL.shape[-1])


def _routing(logits, topk: int, routing: str, nodes: int, group_topk: int):
    """Top-k probabilities and map; node-limited: only experts of the ``group_topk`` nodes whose
    best two experts score highest (Megatron's group score) are eligible."""
    import torch

    if routing == "node_limited" and nodes > 1:
        tokens, experts = logits.shape
        grouped = logits.view(tokens, nodes, experts // nodes)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)
        chosen = group_score.topk(group_topk, dim=-1).indices
        allowed = torch.zeros(tokens, nodes, dtype=torch.bool).scatter(1, chosen, True)
        logits = logits.masked_fill(~allowed.repeat_interleave(experts // nodes, dim=1),
                                    float("-inf"))
    top_logits, top_idx = logits.topk(topk, dim=-1)
    probs = torch.zeros_like(logits).scatter(1, top_idx, top_logits.softmax(-1))
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_idx, True)
    return probs, routing_map


def bench_shape(args, tokens, width, num_experts, topk, routing, nodes, platform):
    import torch
    from megatron.core import parallel_state

    from megatron_slmoe.moe.dispatch.allgather import AllGatherDispatcher
    from megatron_slmoe.moe.dispatch.alltoall import AllToAllDispatcher
    from megatron_slmoe.moe.dispatch.traffic import flat_traffic_rows

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    ep_group = parallel_state.get_expert_model_parallel_group()
    per_rank = num_experts // world
    local = list(range(rank * per_rank, (rank + 1) * per_rank))
    gen = torch.Generator().manual_seed(100 + rank)
    # Routing first, so the hidden-width and latent-width runs route identically.
    logits = torch.randn(tokens, num_experts, generator=gen)
    probs, routing_map = _routing(logits, topk, routing, nodes, args.group_topk)
    probs, routing_map = probs.to(platform.device()), routing_map.to(platform.device())
    x = torch.randn(tokens, width, generator=gen).to(platform.device())
    grad = torch.randn(tokens, width, generator=gen).to(platform.device())

    variants = {
        "megatron_allgather": _MegatronAdapter(_megatron_dispatcher("allgather", num_experts, width, topk, world)),
        "megatron_alltoall": _MegatronAdapter(_megatron_dispatcher("alltoall", num_experts, width, topk, world)),
        "slmoe_allgather": AllGatherDispatcher(num_experts, local, ep_group, args.node_size),
        "slmoe_alltoall": AllToAllDispatcher(num_experts, local, ep_group, node_size=args.node_size),
    }
    hier = AllToAllDispatcher(num_experts, local, ep_group, hierarchical=True, node_size=args.node_size)
    if hier.hierarchical:
        variants["slmoe_alltoall_hierarchical"] = hier
    node_of = variants["slmoe_alltoall"].layout.node_of_group_rank

    def run(dispatcher, backward=True):
        xi = x.clone().requires_grad_(backward)
        pi = probs.clone().requires_grad_(backward)
        d = dispatcher.dispatch(xi, pi, routing_map)
        y = dispatcher.combine(d.rows_RL * d.probs_R.unsqueeze(-1).to(d.rows_RL.dtype), d.plan)
        if backward:
            y.backward(grad)
        return y.detach()

    # Pairs and rows by destination, for bytes the dispatchers do not count themselves.
    pairs_to_rank = routing_map.view(tokens, world, per_rank).sum(-1)  # (token, expert) per rank
    row_bytes = width * x.element_size()
    reference = run(variants["megatron_allgather"], backward=False)
    results = []
    for name, dispatcher in variants.items():
        row = {"dispatcher": name, "ep_size": world, "nodes": nodes, "latent": width != args.hidden,
               "width": width, "tokens": tokens, "experts": num_experts, "topk": topk,
               "routing": routing, "device": platform.name, "node_size": args.node_size or world}
        y = run(dispatcher, backward=False)
        err = ((y - reference).norm() / reference.norm()).item()
        err_t = torch.tensor([err], dtype=torch.float64)
        torch.distributed.all_reduce(err_t, op=torch.distributed.ReduceOp.MAX)
        row["max_rel_err"] = err_t.item()
        if err_t.item() > 1e-5:
            row["status"] = "disagrees with baseline: not timed"
            results.append(row)
            continue
        traffic = getattr(dispatcher, "traffic", None)
        for backward, key in ((False, "fwd_ms"), (True, "fwd_bwd_ms")):
            times = []
            for i in range(args.warmup + args.reps):
                if traffic is not None:
                    traffic.reset()
                torch.distributed.barrier()
                platform.synchronize()
                start = time.perf_counter()
                run(dispatcher, backward)
                platform.synchronize()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
                if i >= args.warmup:
                    times.append(elapsed.item() * 1e3)
            row[key] = statistics.median(times)
        meta = 0.0
        if name == "megatron_alltoall":  # one row per (token, expert) pair, there and back
            intra, inter = flat_traffic_rows(pairs_to_rank.sum(0).tolist(), node_of, rank)
            counted = torch.tensor([2.0 * intra * row_bytes, 2.0 * inter * row_bytes],
                                   dtype=torch.float64)
            meta = 4.0 * (intra + inter)  # its fp32 probability per row
        elif traffic is not None:  # one forward (dispatch + combine), as counted by ours
            counted = traffic.state.clone()
            if name == "slmoe_alltoall":
                off_rank = pairs_to_rank.sum().item() - pairs_to_rank[:, rank].sum().item()
                meta = 12.0 * off_rank
            elif name == "slmoe_alltoall_hierarchical":
                meta = 12.0 * _hierarchical_entries_sent(routing_map, world, nodes, rank)
            else:  # our all-gather: probabilities and mask of every token to every peer
                meta = (4.0 + 1.0) * num_experts * tokens * (world - 1)
        else:  # Megatron's all-gather: every rank's rows to every peer and back, as ours counts
            counted = torch.tensor(list(_allgather_bytes(tokens, width, x.element_size(), world,
                                                         args.node_size or world).values()),
                                   dtype=torch.float64)
            meta = (4.0 + 1.0) * num_experts * tokens * (world - 1)
        counted = torch.cat([counted, torch.tensor([meta], dtype=torch.float64)])
        torch.distributed.all_reduce(counted)  # summed over ranks
        row["bytes_intra_node"], row["bytes_inter_node"] = int(counted[0]), int(counted[1])
        all_tokens = tokens * world
        row["bytes_per_token"] = (counted[0] + counted[1]).item() / all_tokens
        row["inter_bytes_per_token"] = counted[1].item() / all_tokens
        row["meta_bytes_per_token"] = counted[2].item() / all_tokens
        row["status"] = "ok"
        results.append(row)
    base = next(r for r in results if r["dispatcher"] == "megatron_allgather")
    a2a = next(r for r in results if r["dispatcher"] == "megatron_alltoall")
    for r in results:
        if "fwd_bwd_ms" in r:
            r["fwd_bwd_vs_megatron_allgather"] = r["fwd_bwd_ms"] / base["fwd_bwd_ms"]
            if "fwd_bwd_ms" in a2a:
                r["fwd_bwd_vs_megatron_alltoall"] = r["fwd_bwd_ms"] / a2a["fwd_bwd_ms"]
    return results


def _hierarchical_entries_sent(routing_map, world, nodes, rank):
    """(token, expert) entries our hierarchical dispatch sends off-rank from this rank: in hop A
    those of its own tokens with the expert on another node; in hop B those that hop A delivered
    to it (from this slot of every node) with the expert on another rank of its node."""
    import torch

    tokens, experts = routing_map.shape
    maps = [torch.empty_like(routing_map) for _ in range(world)]
    torch.distributed.all_gather(maps, routing_map)
    per_node, per_rank = world // nodes, experts // world
    node, slot = divmod(rank, per_node)
    node_experts = slice(node * per_node * per_rank, (node + 1) * per_node * per_rank)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    hop_a = routing_map.sum().item() - routing_map[:, node_experts].sum().item()
    hop_b = 0
    for other_node in range(nodes):
        sender = maps[other_node * per_node + slot]
        hop_b += sender[:, node_experts].sum().item() - sender[:, mine].sum().item()
    return hop_a + hop_b


def _allgather_bytes(tokens, width, elem, world, node_size):
    per_node = min(node_size, world)
    intra_peers, inter_peers = per_node - 1, world - per_node
    rows = 2 * tokens * world  # dispatch + combine, every rank
    return {"bytes_intra_node": rows * intra_peers * width * elem,
            "bytes_inter_node": rows * inter_peers * width * elem}


def print_table(rows):
    header = ("dispatcher", "E", "k", "routing", "width", "tokens", "fwd_bwd_ms", "x_mcore_a2a",
              "x_mcore_ag", "B/token", "inter_B/tok", "meta_B/tok", "status")
    print(" | ".join(f"{h:>11}" if i else f"{h:<28}" for i, h in enumerate(header)))
    for r in rows:
        def fmt(v, spec):
            return "-" if v is None else format(v, spec)
        cells = [r["dispatcher"], r["experts"], r["topk"], r["routing"], r["width"], r["tokens"],
                 fmt(r.get("fwd_bwd_ms"), ".1f"), fmt(r.get("fwd_bwd_vs_megatron_alltoall"), ".2f"),
                 fmt(r.get("fwd_bwd_vs_megatron_allgather"), ".2f"),
                 fmt(r.get("bytes_per_token"), ".0f"), fmt(r.get("inter_bytes_per_token"), ".0f"),
                 fmt(r.get("meta_bytes_per_token"), ".0f"), r["status"]]
        print(" | ".join(f"{c:>11}" if i else f"{c:<28}" for i, c in enumerate(map(str, cells))))


if __name__ == "__main__":
    sys.exit(main())
