"""Benchmark: tokens/s of a whole LoRA fine-tuning step against Megatron-Core's own MoE layer.

    python tools/bench/lora_step.py --ranks 2 4 --json runs/bench/lora_step.json

For each world size it starts that many gloo ranks on this machine (expert parallelism over all of
them, data parallelism for the rest of the model) and builds three Megatron-Core GPTModels that
differ only in their MoE layers:

* ``slmoe``: this project's Stable Latent MoE layer (latent projection before dispatch, the
  all-to-all dispatcher, LoRA experts on the fused grouped op);
* ``megatron_lora``: Megatron-Core's MoELayer with its all-to-all dispatcher and SequentialMLP
  experts, LoRA on every expert the usual way (base GEMM, then a separate shrink and expand);
* ``megatron_mask_loop``: the same, with the experts run by a per-expert boolean-mask loop.

All three get the same weights (copied from the first model, LoRA B included, so the adapters
matter), the same data on every rank, LoRA on attention (qkv, proj) and on every expert's fc1 and
fc2, Megatron's DDP, Adam and schedule. Before timing, the first two steps' losses of every variant
must agree with ``slmoe``'s; a variant that disagrees is not timed. Steps are timed round-robin
over the variants (load on a shared machine hits all of them alike); each step's time is the
slowest rank's. Profiled steps give the per-stage breakdown
(``tools/bench/stage_profile.py``), also round-robin: ``stages_profiled_ms`` as measured under the
profiler (which slows many small ops most), ``stages_ms`` the same shares of the timed step.

Two more figures say what bounds the ratios on a shared machine. ``cpu_ms_per_step``: process CPU
time (all threads) per timed step, averaged over ranks; when ranks outnumber cores, wall time
follows the CPU time of all ranks on a quiet machine, and the number of blocking collectives per
step (``collectives_per_step``, counted in the profiled step, size-1 groups included) on a loaded
one, where every wait costs a trip through the run queue. ``moe_floor``: the slmoe model with its
routed experts and their exchanges skipped (the layer adds zeros: router, latent projections,
shared expert, attention and the rest still run), timed with the others but not loss-checked; no
MoE path can beat it, so ``floor_speedup`` (its tokens/s over a row's) bounds what ``slmoe_speedup``
can reach against that row at these shapes.

Prints a table and writes JSON rows with at least variant, ranks, experts, topk, tokens_per_s,
plus ``slmoe_speedup`` (the slmoe variant's tokens/s over this row's) and the breakdowns.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the benchmark's helper modules

VARIANTS = ("slmoe", "megatron_lora", "megatron_mask_loop")
FLOOR = "moe_floor"
"""The slmoe model with its routed experts and their exchanges skipped: the bound of any MoE path."""
STAGES = ("router", "latent", "dispatch", "experts", "combine", "shared_expert", "attention",
          "optimizer", "other")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--latent", type=int, default=64,
                        help="latent width of the experts; 0: none (experts at the hidden width, "
                             "as Qwen3-MoE and DeepSeek-V3 have)")
    parser.add_argument("--expert-ffn", type=int, default=128)
    parser.add_argument("--shared-ffn", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--dispatcher-options", default="",
                        help="SLMoEConfig fields for the slmoe variant, e.g. "
                             "'overlap_chunks=2,hierarchical_alltoall=true,node_size=2'")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--profile-steps", type=int, default=2,
                        help="profiled steps per variant for the stage breakdown (0: none)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    if args.latent < 0:
        parser.error("--latent must be 0 (none) or positive")
    for name in ("experts", "topk", "hidden", "expert_ffn", "layers", "heads", "vocab",
                 "seq_length", "micro_batch_size", "lora_rank", "reps", "threads"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if min(args.ranks) < 1:
        parser.error("--ranks must be positive")
    for world in args.ranks:
        if args.experts % world:
            parser.error(f"--experts {args.experts} must be divisible by every --ranks ({world})")
    if args.topk > args.experts:
        parser.error(f"--topk {args.topk} exceeds --experts {args.experts}")
    if args.latent >= args.hidden:
        parser.error("--latent must be smaller than --hidden")
    if args.hidden % args.heads:
        parser.error("--hidden must be divisible by --heads")
    try:
        args.slmoe_options = _parse_options(args.dispatcher_options)
    except ValueError as exc:
        parser.error(f"--dispatcher-options: {exc}")
    return args


def _parse_options(text: str) -> dict:
    from megatron_slmoe.moe.config import SLMoEConfig

    fields = {f for f in SLMoEConfig.__dataclass_fields__}
    options = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"{item!r} is not FIELD=VALUE with a field of SLMoEConfig")
        lowered = value.lower()
        options[key] = (True if lowered == "true" else False if lowered == "false"
                        else int(value) if value.isdigit() else value)
    SLMoEConfig(**options)  # its own checks
    return options


# --- the models ----------------------------------------------------------------------------------


def transformer_config(args, world: int, latent_in_config: bool = True):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden, num_moe_experts=args.experts,
        moe_router_topk=args.topk, moe_ffn_hidden_size=args.expert_ffn,
        moe_latent_size=(args.latent or None) if latent_in_config else None,
        moe_shared_expert_intermediate_size=args.shared_ffn or None,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
        expert_model_parallel_size=world, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, bf16=False,
        init_method_std=0.02)


def _gpt(config, layer_spec, args):
    from megatron.core.models.gpt import GPTModel

    return GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=args.vocab,
                    max_sequence_length=args.seq_length, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)


def build_slmoe(args, world):
    from megatron_slmoe.moe.config import SLMoEConfig
    from megatron_slmoe.moe.specs import get_slmoe_decoder_block_spec

    config = transformer_config(args, world)
    slmoe = SLMoEConfig(**{"freeze_router": True, "dispatcher": "alltoall", **args.slmoe_options})
    return _gpt(config, get_slmoe_decoder_block_spec(config, slmoe), args), config


def skip_routed_experts(model) -> None:
    """Make every slmoe MoE layer of ``model`` add zeros in place of its routed experts (no
    exchange, no expert computation; everything else in the layer still runs)."""
    import torch

    from megatron_slmoe.moe.layer import StableLatentMoELayer

    def zeros(x_TL, probs_TE, routing_map_TE, experts, chunks):
        return torch.zeros_like(x_TL)

    layers = [m for m in model.modules() if isinstance(m, StableLatentMoELayer)]
    if not layers:
        raise RuntimeError("no StableLatentMoELayer in the model")
    for layer in layers:
        layer.dispatcher.dispatch_compute_combine = zeros


def build_megatron(args, world, expert_kind: str):
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_lora_baseline import StagedMoELayer

    config = transformer_config(args, world)
    config.perform_initialization = False  # every weight is copied from the slmoe model
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                       normalization=config.normalization)
    for layer_spec in block.layer_specs:
        mlp = layer_spec.submodules.mlp
        if isinstance(mlp, ModuleSpec) and mlp.module is MoELayer:
            layer_spec.submodules.mlp = dataclasses.replace(
                mlp, module=StagedMoELayer,
                params={**mlp.params, "expert_kind": expert_kind, "lora_rank": args.lora_rank,
                        "lora_alpha": 2.0 * args.lora_rank})
    return _gpt(config, block, args), config


def lora_config(args, targets):
    from megatron_slmoe.lora.config import LoRAConfig

    return LoRAConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank, dropout=0.0,
                      targets=list(targets))


def randomize_lora(model, seed: int) -> None:
    """LoRA B starts at zero; random A and B make the adapters part of every loss compared."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)


def _megatron_name(name: str) -> str:
    """The Megatron variants' name of a slmoe model's parameter (non-expert)."""
    return (name.replace("mlp.latent_down.", "mlp.fc1_latent_proj.")
            .replace("mlp.latent_up.", "mlp.fc2_latent_proj."))


_EXPERT_TENSORS = {  # slmoe stacked tensor -> (per-expert module path, tensor)
    "fc1_weight": ("linear_fc1", "base.weight"), "fc2_weight": ("linear_fc2", "base.weight"),
    "fc1_lora_A": ("linear_fc1", "lora_A"), "fc1_lora_B": ("linear_fc1", "lora_B"),
    "fc2_lora_A": ("linear_fc2", "lora_A"), "fc2_lora_B": ("linear_fc2", "lora_B"),
}


def copy_weights(source, target) -> None:
    """Every parameter of ``target`` from ``source`` (the slmoe model); refuses to leave one out."""
    import torch

    target_params = dict(target.named_parameters())
    assigned = set()
    with torch.no_grad():
        for name, tensor in source.named_parameters():
            head, _, leaf = name.rpartition(".")
            if head.endswith("mlp.experts") and leaf in _EXPERT_TENSORS:
                linear, what = _EXPERT_TENSORS[leaf]
                for e in range(tensor.shape[0]):
                    key = f"{head}.local_experts.{e}.{linear}.{what}"
                    target_params[key].copy_(tensor[e])
                    assigned.add(key)
            else:
                key = _megatron_name(name)
                target_params[key].copy_(tensor)
                assigned.add(key)
    missing = set(target_params) - assigned
    if missing:
        raise RuntimeError(f"parameters not copied from the slmoe model: {sorted(missing)[:5]}")


def enable_expert_lora(model) -> None:
    """inject_lora freezes what it did not adapt; the baseline's expert LoRA trains too."""
    from megatron_lora_baseline import LoRAExpertLinear

    for module in model.modules():
        if isinstance(module, LoRAExpertLinear):
            module.lora_A.requires_grad_(True)
            module.lora_B.requires_grad_(True)


# --- one step ------------------------------------------------------------------------------------


class Trainer:
    def __init__(self, name, model, config, args):
        from megatron_slmoe.training.config import OptimizerConfig, ScheduleConfig
        from megatron_slmoe.training.model_setup import wrap_and_optimize
        from stage_profile import wrap_forward

        for layer in model.decoder.layers:
            wrap_forward(layer.self_attention, "attention")
        self.name, self.args = name, args
        self.ddp, self.optimizer, self.scheduler = wrap_and_optimize(
            model, config,
            OptimizerConfig(lr=1e-3, lr_warmup_iters=0, lr_decay_style="constant", clip_grad=1.0),
            ScheduleConfig(train_iters=1000), use_distributed_optimizer=False, bf16=False)

    def step(self, batch) -> float:
        from functools import partial

        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_slmoe.moe.stages import stage

        def forward_step(data_iterator, model):
            b = next(data_iterator)
            output = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
            return output, partial(_loss, b["loss_mask"])

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([batch]), model=[self.ddp],
            num_microbatches=1, seq_length=self.args.seq_length,
            micro_batch_size=self.args.micro_batch_size, forward_only=False)
        with stage("optimizer"):
            self.optimizer.step()
            self.scheduler.step(1)
        return float(losses[0]["lm loss"])


def _loss(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1)
    loss = (losses * mask).sum() / mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def make_batch(args, rank: int):
    import torch

    gen = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, args.vocab, (args.micro_batch_size, args.seq_length + 1), generator=gen)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(args.micro_batch_size, args.seq_length),
            "position_ids": torch.arange(args.seq_length).expand(args.micro_batch_size, -1)}


# --- a world of ranks ----------------------------------------------------------------------------


def run_world(args, world: int) -> list[dict]:
    """On every rank: build, check, time and profile the variants; rank 0 returns the rows."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_slmoe.lora.inject import inject_lora
    from stage_profile import profiled, stage_times_us

    rank = torch.distributed.get_rank()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)

    slmoe_model, slmoe_config = build_slmoe(args, world)
    inject_lora(slmoe_model, lora_config(args, ["linear_qkv", "linear_proj", "linear_fc1",
                                                "linear_fc2"]))
    randomize_lora(slmoe_model, seed=77 + rank)  # expert LoRA differs per EP rank, as experts do
    _sync_dense_lora(slmoe_model)
    models = {"slmoe": (slmoe_model, slmoe_config)}
    for name, kind in (("megatron_lora", "sequential"), ("megatron_mask_loop", "mask_loop")):
        model, config = build_megatron(args, world, kind)
        inject_lora(model, lora_config(args, ["linear_qkv", "linear_proj"]))
        enable_expert_lora(model)
        copy_weights(slmoe_model, model)
        models[name] = (model, config)
    floor_model, floor_config = build_slmoe(args, world)
    inject_lora(floor_model, lora_config(args, ["linear_qkv", "linear_proj", "linear_fc1",
                                                "linear_fc2"]))
    floor_model.load_state_dict(slmoe_model.state_dict())
    skip_routed_experts(floor_model)
    models[FLOOR] = (floor_model, floor_config)
    trainers = {name: Trainer(name, model, config, args) for name, (model, config) in models.items()}
    batch = make_batch(args, rank)

    # Same losses before anything is timed: the forward of step 1, and step 2 after a backward
    # and an optimizer step.
    losses = {name: [trainer.step(batch) for _ in range(2)] for name, trainer in trainers.items()}
    agree = {FLOOR: 0.0}  # computes another function: nothing to compare, timed regardless
    for name, values in losses.items():
        if name == FLOOR:
            continue
        err = max(abs(a - b) / abs(b) for a, b in zip(values, losses["slmoe"]))
        err_t = torch.tensor([err], dtype=torch.float64)
        torch.distributed.all_reduce(err_t, op=torch.distributed.ReduceOp.MAX)
        agree[name] = err_t.item()

    times = {name: [] for name in trainers}
    cpu_s = {name: 0.0 for name in trainers}  # this rank's process CPU time over the timed steps
    for i in range(args.warmup + args.reps):
        for name, trainer in trainers.items():
            if agree[name] > 1e-4:
                continue
            torch.distributed.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            trainer.step(batch)
            if i >= args.warmup:
                cpu_s[name] += time.process_time() - cpu_start
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
            if i >= args.warmup:
                times[name].append(elapsed.item())

    cpu_total = torch.tensor([cpu_s[name] for name in trainers], dtype=torch.float64)
    torch.distributed.all_reduce(cpu_total)
    cpu_ms = {name: v / world / args.reps * 1e3 for name, v in zip(trainers, cpu_total.tolist())}

    # Profiled steps, round-robin like the timed ones; the profiler slows small ops most, so the
    # breakdown is also given as shares of the profiled step and scaled to the timed step.
    stage_sums = {name: torch.zeros(len(STAGES), dtype=torch.float64) for name in trainers}
    collectives = {}
    profiled_names = [n for n in trainers if agree[n] <= 1e-4] if args.profile_steps else []
    for _ in range(args.profile_steps):
        for name in profiled_names:
            torch.distributed.barrier()
            with profiled() as prof:
                start = time.perf_counter()
                trainers[name].step(batch)
                wall_us = (time.perf_counter() - start) * 1e6
            per_stage = stage_times_us(prof.events(), wall_us)
            collectives[name] = collective_counts(prof.events())
            stage_sums[name] += torch.tensor([per_stage.get(s, 0.0) / 1e3 for s in STAGES],
                                             dtype=torch.float64)
    stages = {}
    for name in profiled_names:
        vector = stage_sums[name] / args.profile_steps
        torch.distributed.all_reduce(vector)  # mean over ranks
        stages[name] = {s: v / world for s, v in zip(STAGES, vector.tolist())}

    rows = []
    tokens_per_step = world * args.micro_batch_size * args.seq_length
    for name in trainers:
        row = {"variant": name, "ranks": world, "experts": args.experts, "topk": args.topk,
               "hidden": args.hidden, "latent": args.latent, "expert_ffn": args.expert_ffn,
               "layers": args.layers, "seq_length": args.seq_length,
               "micro_batch_size": args.micro_batch_size, "lora_rank": args.lora_rank,
               "tokens_per_step": tokens_per_step, "losses": losses[name],
               "loss_rel_err_vs_slmoe": None if name == FLOOR else agree[name],
               "threads_per_rank": args.threads,
               "slmoe_options": args.slmoe_options if name == "slmoe" else None}
        row["collectives_per_step"] = collectives.get(name)
        if times[name]:
            row["cpu_ms_per_step"] = cpu_ms[name]
            row["step_s"] = statistics.median(times[name])
            row["tokens_per_s"] = tokens_per_step / row["step_s"]
            row["status"] = "ok"
        else:
            row["tokens_per_s"] = None
            row["status"] = "loss disagrees with slmoe: not timed"
        row["stages_profiled_ms"] = stages.get(name)
        row["stages_ms"] = None
        if stages.get(name) and row.get("step_s"):
            total = sum(stages[name].values())
            row["stages_ms"] = {s: v / total * row["step_s"] * 1e3 for s, v in stages[name].items()}
        rows.append(row)
    ours = rows[0]["tokens_per_s"]
    floor = next(r["tokens_per_s"] for r in rows if r["variant"] == FLOOR)
    for row in rows:
        tps = row["tokens_per_s"]
        row["slmoe_speedup"] = ours / tps if ours and tps else None
        row["floor_speedup"] = floor / tps if floor and tps else None
    parallel_state.destroy_model_parallel()
    return rows if rank == 0 else []


def collective_counts(events) -> dict[str, int]:
    """Collectives issued in a profiled region, by c10d op name (each blocks its caller once)."""
    counts: dict[str, int] = {}
    for event in events:
        if event.name.startswith("c10d::"):
            op = event.name[len("c10d::"):]
            counts[op] = counts.get(op, 0) + 1
    return counts


def _sync_dense_lora(model) -> None:
    """Attention LoRA is replicated over data-parallel ranks: take rank 0's draw everywhere."""
    import torch

    for name, param in model.named_parameters():
        if param.requires_grad and getattr(param, "allreduce", True):
            torch.distributed.broadcast(param.data, src=0)


def _rank_main(rank, world, port, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch

    torch.set_num_threads(args.threads)
    import megatron_slmoe

    platform = megatron_slmoe.PLATFORM
    platform.set_device(rank)
    torch.distributed.init_process_group(platform.backend, rank=rank, world_size=world,
                                         timeout=timedelta(minutes=30))
    try:
        rows = run_world(args, world)
        if rank == 0:
            results.put(rows)
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch.multiprocessing as mp

    from megatron_slmoe.utils.atomic import write_json_atomic

    ctx = mp.get_context("spawn")
    rows = []
    for world in args.ranks:
        load_before = os.getloadavg()[0]
        world_rows = _run_ranks(ctx, world, args)
        if world_rows is None:
            print(f"error: a rank of the {world}-rank run failed (its traceback is above)",
                  file=sys.stderr)
            return 1
        for row in world_rows:
            row["load_avg_1m"] = [load_before, os.getloadavg()[0]]  # before, after
        rows += world_rows
        print_table(world_rows)
    if args.json:
        write_json_atomic(args.json, rows)
        print(f"wrote {args.json}")
    return 0


def _run_ranks(ctx, world, args):
    import queue

    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, args, results))
             for r in range(world)]
    for proc in procs:
        proc.start()
    rows = None
    while rows is None:
        try:
            rows = results.get(timeout=5.0)
        except queue.Empty:
            if any(proc.exitcode not in (None, 0) for proc in procs):
                break
    for proc in procs:
        proc.join(None if rows is not None else 30)
        if proc.is_alive():
            proc.kill()
    return rows


def print_table(rows):
    header = ("variant", "ranks", "E", "k", "step_s", "tokens/s", "slmoe_x", "floor_x", "cpu_ms",
              "colls", *STAGES)
    print(" | ".join(f"{h:>9}" if i else f"{h:<20}" for i, h in enumerate(header)))
    for r in rows:
        def fmt(v, spec):
            return "-" if v is None else format(v, spec)
        st = r.get("stages_ms") or {}
        cells = [r["variant"], r["ranks"], r["experts"], r["topk"], fmt(r.get("step_s"), ".3f"),
                 fmt(r["tokens_per_s"], ".0f"), fmt(r["slmoe_speedup"], ".2f"),
                 fmt(r["floor_speedup"], ".2f"), fmt(r.get("cpu_ms_per_step"), ".0f"),
                 fmt(sum((r.get("collectives_per_step") or {}).values()) or None, "d"),
                 *(fmt(st.get(s), ".0f") for s in STAGES)]
        print(" | ".join(f"{c:>9}" if i else f"{c:<20}" for i, c in enumerate(map(str, cells))))


if __name__ == "__main__":
    sys.exit(main())
