"""The fine-tuning entry point with its steps measured, for benchmarks (one rank of a torchrun job).

    python -m torch.distributed.run --nproc-per-node 2 tools/bench/measured_run.py OUT_DIR \\
        STEPS [--profile] -- <slmoe-finetune flags>

Runs ``megatron_slmoe.training.finetune.main`` with an Engine whose ``train_step`` records, per
step: the live tensor bytes before it and their peak during it (``plan.live_bytes``, the CPU
stand-in for ``max_memory_allocated``), its wall time and loss; at step 2, the bytes held by the
training state (parameters, buffers, DDP buffers, optimizer state); after set-up, the process's
peak resident memory and the bytes of the parameters this rank holds (its shard of the model: what
a rank-local import must not exceed by much). With ``--profile`` the last step runs under
torch.profiler and its time is split by stage (``stage_profile``). After STEPS steps each rank
writes ``OUT_DIR/rank<r>.json`` and the job ends (the end-of-run evaluation and checkpoint are
not training steps).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time


def read_ranks(out: str, proc, name: str) -> list[dict]:
    """The per-rank records a finished run of this script wrote into ``out`` (``proc``: its
    ``subprocess.run`` result); RuntimeError naming run ``name`` when it failed."""
    files = sorted(f for f in os.listdir(out) if f.startswith("rank"))
    if proc.returncode != 0 or len(files) != 2:
        raise RuntimeError(f"run {name} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    ranks = []
    for file in files:
        with open(os.path.join(out, file)) as f:
            ranks.append(json.load(f))
    return ranks


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None and not t.is_meta:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def held_by_training_state(ctx) -> int:
    """Bytes of parameters, buffers, DDP buffers and optimizer state (the counted statics)."""
    import torch

    tensors = list(ctx.model.parameters()) + list(ctx.model.buffers())
    for buffer in (getattr(ctx.ddp, "buffers", []) +
                   getattr(ctx.ddp, "expert_parallel_buffers", [])):
        tensors += [buffer.grad_data, buffer.param_data]
    for opt in getattr(ctx.optimizer, "chained_optimizers", [ctx.optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            tensors += list(group["params"])
        for state in inner.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return _storage_bytes(tensors)


def _name_stages(ctx) -> None:
    """Attention, the output layer and the optimizer step as profiler stages beside the MoE
    layer's own."""
    from stage_profile import wrap_forward

    from megatron_slmoe.moe.stages import stage

    for name, module in ctx.model.named_modules():
        if name.endswith("self_attention"):
            wrap_forward(module, "attention")
        elif name.endswith("output_layer"):  # the vocabulary projection (its loss is "other")
            wrap_forward(module, "output_layer")
    step = ctx.optimizer.step

    def staged_step(*args, **kwargs):
        with stage("optimizer"):
            return step(*args, **kwargs)

    ctx.optimizer.step = staged_step


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def worker(out_dir: str, total_steps: int, profile: bool, argv: list[str]) -> None:
    from megatron_slmoe.plan.live_bytes import LiveTensorBytes

    live = LiveTensorBytes()
    live.__enter__()  # before anything allocates
    import torch

    from megatron_slmoe.training import engine, finetune, recipe

    record: dict = {"steps": []}
    steps = record["steps"]

    class MeasuredEngine(engine.Engine):
        def setup(self):
            ctx = super().setup()
            if profile:
                _name_stages(ctx)
            record["rss_after_setup_bytes"] = _rss_bytes()
            record["shard_bytes"] = _storage_bytes(list(ctx.model.parameters()))
            record["threads"] = torch.get_num_threads()
            return ctx

        def train_step(self):
            before = live.current
            held = held_by_training_state(self.ctx) if len(steps) == 1 else None
            live.reset_peak()
            last = len(steps) + 1 == total_steps
            started = time.perf_counter()
            if profile and last:
                from stage_profile import profiled, stage_times_us

                with profiled() as prof:
                    result = super().train_step()
                wall = (time.perf_counter() - started) * 1e6
                record["stage_us"] = stage_times_us(prof.events(), wall)
            else:
                result = super().train_step()
            steps.append({"before": before, "peak": live.peak, "held_by_state": held,
                          "seconds": time.perf_counter() - started, "loss": result["loss"]})
            if len(steps) == total_steps:
                record["rss_peak_bytes"] = _rss_bytes()
                torch.distributed.barrier()
                rank = torch.distributed.get_rank()
                with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                    json.dump(record, f)
                torch.distributed.barrier()
                os._exit(0)
            return result

    recipe.Engine = MeasuredEngine  # what finetune.main builds (recipe.build_engine)
    finetune.main(argv)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # stage_profile
    args = sys.argv[1:]
    split = args.index("--")
    head, flags = args[:split], args[split + 1:]
    worker(head[0], int(head[1]), "--profile" in head[2:], flags)
