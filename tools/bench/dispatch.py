"""Benchmark: token dispatch + combine (forward and backward) of the MoE dispatchers.

Run under torchrun; every rank is one expert-parallel rank:

    torchrun --nproc-per-node 4 tools/bench/dispatch.py --node-size 2 --json runs/bench/dispatch.json

For each shape it times Megatron-Core's all-gather dispatcher (the baseline) and all-to-all
dispatcher, and ours (all-gather, flat all-to-all, and hierarchical all-to-all when there is more
than one node), at the hidden width and at the latent width, on the same ranks with the same
routing. The "expert" between dispatch and combine only weights rows by their router probability,
so the figures are the dispatcher's own cost. Bytes are token rows sent to other ranks in one
forward (dispatch + combine), summed over ranks; the backward sends as many again. Every variant's combined output is checked against
the baseline's before it is timed. Prints a table and writes JSON rows with at least
dispatcher, ep_size, latent, tokens, fwd_bwd_ms, bytes_intra_node, bytes_inter_node.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024],
                        help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--latent", type=int, default=128)
    parser.add_argument("--experts-per-rank", type=int, default=4)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--node-size", type=int, default=None,
                        help="ranks per node (default LOCAL_WORLD_SIZE); smaller than the world "
                             "emulates several nodes on one machine")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the rows here (rank 0)")
    args = parser.parse_args(argv)
    if args.latent >= args.hidden:
        parser.error("--latent must be smaller than --hidden")
    if min(args.tokens) <= 0 or args.topk <= 0 or args.experts_per_rank <= 0 or args.reps <= 0:
        parser.error("--tokens, --topk, --experts-per-rank and --reps must be positive")
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
    num_experts = args.experts_per_rank * world
    if args.topk > num_experts:
        print(f"error: --topk {args.topk} exceeds the {num_experts} experts", file=sys.stderr)
        return 2
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    torch.manual_seed(1234)
    rows = []
    for tokens in args.tokens:
        for width in (args.hidden, args.latent):
            rows += bench_shape(args, tokens, width, num_experts, platform)
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
        from megatron_slmoe.moe.dispatch import Dispatched

        h, p = self.d.dispatch_preprocess(x_TL.unsqueeze(1), routing_map_TE, probs_TE)
        h, p = self.d.token_dispatch(h, p)
        rows, tokens_per_expert, probs = self.d.dispatch_postprocess(h, p)
        return Dispatched(rows, tokens_per_expert, probs, plan=None)

    def combine(self, out_RL, plan):
        return self.d.combine_postprocess(self.d.token_combine(self.d.combine_preprocess(out_RL))).view(
            -1, out_RL.shape[-1])


def bench_shape(args, tokens, width, num_experts, platform):
    import torch
    from megatron.core import parallel_state

    from megatron_slmoe.moe.dispatch import AllGatherDispatcher, AllToAllDispatcher

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    ep_group = parallel_state.get_expert_model_parallel_group()
    local = list(range(rank * args.experts_per_rank, (rank + 1) * args.experts_per_rank))
    gen = torch.Generator().manual_seed(100 + rank)
    # Routing first, so the hidden-width and latent-width runs route identically.
    logits = torch.randn(tokens, num_experts, generator=gen).to(platform.device())
    x = torch.randn(tokens, width, generator=gen).to(platform.device())
    top_logits, top_idx = logits.topk(args.topk, dim=-1)
    probs = torch.zeros_like(logits).scatter(1, top_idx, top_logits.softmax(-1))
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_idx, True)
    grad = torch.randn(tokens, width, generator=gen).to(platform.device())

    variants = {
        "megatron_allgather": _MegatronAdapter(_megatron_dispatcher("allgather", num_experts, width, args.topk, world)),
        "megatron_alltoall": _MegatronAdapter(_megatron_dispatcher("alltoall", num_experts, width, args.topk, world)),
        "slmoe_allgather": AllGatherDispatcher(num_experts, local, ep_group, args.node_size),
        "slmoe_alltoall": AllToAllDispatcher(num_experts, local, ep_group, node_size=args.node_size),
    }
    hier = AllToAllDispatcher(num_experts, local, ep_group, hierarchical=True, node_size=args.node_size)
    if hier.hierarchical:
        variants["slmoe_alltoall_hierarchical"] = hier

    def run(dispatcher, backward=True):
        xi = x.clone().requires_grad_(backward)
        pi = probs.clone().requires_grad_(backward)
        d = dispatcher.dispatch(xi, pi, routing_map)
        y = dispatcher.combine(d.rows_RL * d.probs_R.unsqueeze(-1).to(d.rows_RL.dtype), d.plan)
        if backward:
            y.backward(grad)
        return y.detach()

    reference = run(variants["megatron_allgather"], backward=False)
    results = []
    for name, dispatcher in variants.items():
        row = {"dispatcher": name, "ep_size": world, "latent": width != args.hidden,
               "width": width, "tokens": tokens, "experts": num_experts, "topk": args.topk,
               "device": platform.name, "node_size": args.node_size or world}
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
        if traffic is not None:  # bytes of one forward (dispatch + combine), summed over ranks;
            # the backward moves the same again
            counted = traffic.state.clone()
            torch.distributed.all_reduce(counted)
            row["bytes_intra_node"], row["bytes_inter_node"] = int(counted[0]), int(counted[1])
        else:  # Megatron's all-gather: every rank's rows to every peer and back, as ours counts
            row.update(_allgather_bytes(tokens, width, x.element_size(), world,
                                        args.node_size or world))
        if name == "megatron_alltoall":  # per (token, expert) row like our flat mode
            row.update({k: None for k in ("bytes_intra_node", "bytes_inter_node")})
        total = (row["bytes_intra_node"] or 0) + (row["bytes_inter_node"] or 0)
        row["bytes_per_token"] = total / (tokens * world) if row["bytes_intra_node"] is not None else None
        row["status"] = "ok"
        results.append(row)
    base = next(r for r in results if r["dispatcher"] == "megatron_allgather")
    for r in results:
        if "fwd_bwd_ms" in r:
            r["fwd_bwd_vs_megatron_allgather"] = r["fwd_bwd_ms"] / base["fwd_bwd_ms"]
    return results


def _allgather_bytes(tokens, width, elem, world, node_size):
    per_node = min(node_size, world)
    intra_peers, inter_peers = per_node - 1, world - per_node
    rows = 2 * tokens * world  # dispatch + combine, every rank
    return {"bytes_intra_node": rows * intra_peers * width * elem,
            "bytes_inter_node": rows * inter_peers * width * elem}


def print_table(rows):
    header = ("dispatcher", "ep", "width", "tokens", "fwd_ms", "fwd_bwd_ms", "x_megatron_ag",
              "bytes/token", "intra_MB", "inter_MB", "status")
    print(" | ".join(f"{h:>14}" if i else f"{h:<28}" for i, h in enumerate(header)))
    for r in rows:
        def fmt(v, spec):
            return "-" if v is None else format(v, spec)
        cells = [r["dispatcher"], r["ep_size"], r["width"], r["tokens"], fmt(r.get("fwd_ms"), ".2f"),
                 fmt(r.get("fwd_bwd_ms"), ".2f"), fmt(r.get("fwd_bwd_vs_megatron_allgather"), ".2f"),
                 fmt(r.get("bytes_per_token"), ".0f"),
                 fmt(None if r.get("bytes_intra_node") is None else r["bytes_intra_node"] / 1e6, ".2f"),
                 fmt(None if r.get("bytes_inter_node") is None else r["bytes_inter_node"] / 1e6, ".2f"),
                 r["status"]]
        print(" | ".join(f"{c:>14}" if i else f"{c:<28}" for i, c in enumerate(map(str, cells))))


if __name__ == "__main__":
    sys.exit(main())
