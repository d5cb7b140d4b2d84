"""The progress line every ``--log-interval`` steps: loss, learning rate, gradient norm, training
throughput (tokens per second of the steps themselves, evaluation and probes excluded), peak
memory and the time left."""

from __future__ import annotations

from megatron_slmoe.training.callbacks.base import Callback, RunContext
from megatron_slmoe.training.metrics import format_progress


def peak_memory(platform) -> int:
    """Peak accelerator memory; on the CPU, the process's peak resident memory."""
    peak = platform.max_memory_allocated()
    if peak == 0:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return peak


class ProgressLog(Callback):
    name = "progress"

    def __init__(self, log_interval: int) -> None:
        self.log_interval = log_interval
        self._steps, self._seconds = 0, 0.0

    def after_step(self, ctx: RunContext, record: dict) -> None:
        self._steps += 1
        self._seconds += record["step_s"]
        if not (ctx.iteration % self.log_interval == 0 or ctx.iteration == ctx.train_iters):
            return
        tokens = ctx.global_batch_size * ctx.seq_length * self._steps
        record["tokens_per_s"] = tokens / max(self._seconds, 1e-9)
        record["memory_bytes"] = peak_memory(ctx.platform)
        eta = self._seconds / self._steps * (ctx.train_iters - ctx.iteration)
        ctx.info("[finetune] " + format_progress(
            ctx.iteration, ctx.train_iters, record["loss"], record["lr"], record["grad_norm"],
            record["tokens_per_s"], record["memory_bytes"], eta))
        self._steps, self._seconds = 0, 0.0
