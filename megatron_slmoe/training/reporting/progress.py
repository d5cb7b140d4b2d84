"""The progress line every ``--log-interval`` steps: loss, learning rate, gradient norm, training
throughput (tokens per second of the steps themselves, evaluation and probes excluded), MFU (the
model FLOPs those tokens take, ``plan.flops``, over the peak matrix rate of the devices:
``platform.peak``, measured once on a CPU), peak memory and the time left."""

from __future__ import annotations

import math
from typing import Optional

from megatron_slmoe.plan.flops import token_flops
from megatron_slmoe.plan.model_shape import ModelShape
from megatron_slmoe.platform.peak import peak_flops
from megatron_slmoe.training.callbacks.base import Callback
from megatron_slmoe.training.context import RunContext


def format_progress(step: int, total: int, loss: float, lr: float, grad_norm: Optional[float],
                    tokens_per_s: float, memory_bytes: int, eta_s: float,
                    mfu: Optional[float] = None) -> str:
    memory = f"{memory_bytes / 2**30:.2f} GiB" if memory_bytes else "n/a"
    grad = "n/a" if grad_norm is None or not math.isfinite(grad_norm) else f"{grad_norm:.3f}"
    utilisation = "n/a" if mfu is None else f"{mfu:.1%}"
    return (f"step {step}/{total} | loss {loss:.4f} | lr {lr:.3e} | grad norm {grad} | "
            f"{tokens_per_s:,.0f} tokens/s | MFU {utilisation} | mem {memory} | "
            f"ETA {_duration(eta_s)}")


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def peak_memory(platform) -> int:
    """Peak accelerator memory; on the CPU, the process's peak resident memory."""
    peak = platform.max_memory_allocated()
    if peak == 0:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return peak


class ProgressLog(Callback):
    """``lora``: the run's LoRA section (None in a full fine-tune), for the model FLOPs."""

    name = "progress"

    def __init__(self, log_interval: int, lora=None) -> None:
        self.log_interval, self.lora = log_interval, lora
        self._steps, self._seconds = 0, 0.0
        self.flops_per_token = self.peak = None

    def setup(self, ctx: RunContext) -> None:
        shape = ModelShape.from_config(ctx.model_config)
        lora = self.lora
        self.flops_per_token = token_flops(
            shape, ctx.seq_length, lora.rank if lora else 0, tuple(lora.targets) if lora else (),
            full_finetune=lora is None).training
        self.peak = peak_flops(ctx.device, ctx.transformer_config.params_dtype)

    def after_step(self, ctx: RunContext, record: dict) -> None:
        self._steps += 1
        self._seconds += record["step_s"]
        if not (ctx.iteration % self.log_interval == 0 or ctx.iteration == ctx.train_iters):
            return
        tokens = ctx.global_batch_size * ctx.seq_length * self._steps
        record["tokens_per_s"] = tokens / max(self._seconds, 1e-9)
        record["memory_bytes"] = peak_memory(ctx.platform)
        if self.peak:
            record["mfu"] = (record["tokens_per_s"] * self.flops_per_token
                             / (ctx.world_size * self.peak))
        eta = self._seconds / self._steps * (ctx.train_iters - ctx.iteration)
        ctx.info("[finetune] " + format_progress(
            ctx.iteration, ctx.train_iters, record["loss"], record["lr"], record["grad_norm"],
            record["tokens_per_s"], record["memory_bytes"], eta, record.get("mfu")))
        self._steps, self._seconds = 0, 0.0
