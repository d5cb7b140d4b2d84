"""Routing quality during a run: the routing monitor's per-layer metrics and collapse warnings,
Megatron's load-balancing losses, and (LoRA) routing stability: the routed load-balancing loss,
routing preservation toward the base model, and drift from the base on a probe batch
(``megatron_slmoe.moe.stability``)."""

from __future__ import annotations

from functools import partial

import torch
from megatron.core import parallel_state

from megatron_slmoe.lora.inject import adapters_disabled
from megatron_slmoe.moe.config import MoERunConfig, MonitorConfig
from megatron_slmoe.moe.monitor import RoutingMonitor
from megatron_slmoe.moe.stability import DRIFT_FIELDS, RoutingStability
from megatron_slmoe.training.callbacks.base import Callback
from megatron_slmoe.training.context import RunContext

RECORDED_FIELDS = ("tokens_per_expert", "imbalance", "load_entropy", "router_entropy",
                   "dead_experts_window", "logit_rms")
"""The monitor's per-layer metrics that go into each step's record (with the drift fields)."""


class RoutingQuality(Callback):
    """``lora``: the router is frozen, so routing is held and watched against the base model
    (a trained router and its expert bias keep routing balanced themselves)."""

    name = "routing"

    def __init__(self, moe: MoERunConfig, monitor: MonitorConfig, lora: bool) -> None:
        self.moe, self.monitor_config, self.lora = moe, monitor, lora
        self.drift_interval = monitor.drift_interval if lora else 0
        self.collapse_warnings = 0
        self.last_routing = None
        self._aux_names = None

    def setup(self, ctx: RunContext) -> None:
        self.monitor = RoutingMonitor([ctx.model], self.monitor_config)
        self.stability = RoutingStability(
            [ctx.model], balance_coeff=self.moe.routed_balance_coeff if self.lora else 0.0,
            kl_coeff=self.moe.routing_kl_coeff if self.lora else 0.0,
            base_model=partial(adapters_disabled, [ctx.model]) if self.lora else None)
        # The drift probe: this rank's share of the first held-out global batch.
        self.probe = ctx.microbatches(ctx.valid, 0)

    def before_step(self, ctx: RunContext, microbatches: list) -> None:
        self.stability.reference_pass(lambda: ctx.forward_only(microbatches))

    def after_step(self, ctx: RunContext, record: dict) -> None:
        routing = self.monitor.step(ctx.iteration)
        record["aux_losses"] = self._aux_losses(ctx)
        for layer, drift in self._drift(ctx).items():
            routing["layers"][layer].update(drift)
        self.collapse_warnings += len(routing["warnings"])
        record["moe"] = self.last_routing = _routing_record(_gather_over_pipeline(routing))

    def _drift(self, ctx: RunContext) -> dict[int, dict]:
        """Every ``drift_interval`` steps (and at the last): each layer's drift from the base
        routing on the probe batch, by layer number ({} otherwise). Collective."""
        last = ctx.iteration == ctx.train_iters
        if not self.drift_interval or not (ctx.iteration % self.drift_interval == 0 or last):
            return {}
        group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        return self.stability.measure_drift(lambda: ctx.forward_only(self.probe), group)

    def _aux_losses(self, ctx: RunContext) -> dict[str, float]:
        """The step's load-balancing / z losses from Megatron's aux-loss tracker (summed over
        layers, averaged over micro-batches and data-parallel ranks), then cleared."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        if self._aux_names is None:
            # Every rank must reduce the same names in the same order; the set is fixed by the
            # model after its first training step, so agree on it once, not every step.
            names = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(names, sorted(tracker))
            self._aux_names = sorted(set().union(*names))
        microbatches = ctx.global_batch_size // (ctx.micro_batch_size * ctx.dp_size)
        result = {}
        for name in self._aux_names:
            if name in tracker:
                values = tracker[name]["values"].detach().clone().double()
            else:  # this stage logged no such loss
                values = torch.zeros(ctx.transformer_config.num_layers, dtype=torch.float64)
            values = values.to(ctx.device)
            # Stages hold different layers: sum over the pipeline. gloo has no AVG: sum, divide.
            torch.distributed.all_reduce(values,
                                         group=parallel_state.get_pipeline_model_parallel_group())
            torch.distributed.all_reduce(values, group=parallel_state.get_data_parallel_group())
            result[name] = values.sum().item() / (ctx.dp_size * microbatches)
            if name in tracker:
                tracker[name]["values"].zero_()
        return result

    def finish(self, ctx: RunContext, summary: dict) -> None:
        load = {layer: {k: m[k] for k in ("imbalance", "load_entropy", "dead_experts_window")}
                for layer, m in (self.last_routing or {"layers": {}})["layers"].items()}
        dead = sum(m["dead_experts_window"] for m in load.values())
        summary.update(expert_load_last_step=load, collapse_warnings=self.collapse_warnings,
                       dead_experts_end=dead)
        worst = max((m["imbalance"] for m in load.values()), default=float("nan"))
        ctx.info(f"[finetune] expert load: worst imbalance (max/mean) {worst:.2f} over "
                 f"{len(load)} MoE layers, {dead} experts without tokens in the last window, "
                 f"{self.collapse_warnings} collapse warnings")


def _gather_over_pipeline(routing: dict) -> list[dict]:
    """Every pipeline stage's layers, so rank 0's record covers the whole model."""
    group = parallel_state.get_pipeline_model_parallel_group()
    gathered = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, routing, group=group)
    return gathered


def _routing_record(per_stage: list[dict]) -> dict:
    layers, warnings = {}, []
    for stage in per_stage:
        warnings += stage["warnings"]
        for number, metrics in stage["layers"].items():
            layers[str(number)] = {k: metrics[k] for k in (*RECORDED_FIELDS, *DRIFT_FIELDS)
                                   if k in metrics}
    return {"layers": layers, "warnings": warnings}
