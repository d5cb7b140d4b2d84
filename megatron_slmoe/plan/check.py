"""The start-up check and the out-of-memory report: the OOM checklist as code.

``check_layout(model_config, settings, device_memory_bytes)`` prices the run's own layout before any
model is built and returns a ``LayoutCheck``: whether it fits, the per-rank breakdown, a one-line
``message``, and when it does not fit the nearest layout (same devices) that does.
``format_oom_report(check)`` is the text for an out-of-memory error raised during a run: the
predicted breakdown and the next step of the checklist (recompute, distributed optimizer, more EP,
TP, PP, a smaller micro-batch, and last, since they change what is trained, a smaller expert rank
and the shared-outer expert layout), each step priced by the memory model; the expert adapter's
levers are named with what each saves per rank whatever the next step is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from megatron_slmoe.parallel.layout import layout_problem
from megatron_slmoe.plan._sources import ModelConfig
from megatron_slmoe.plan.devices import DeviceSpec, GiB, generic_device
from megatron_slmoe.plan.memory import COMPONENTS, stage_adapter_state_bytes, stage_weight_bytes
from megatron_slmoe.plan.model_shape import ModelShape
from megatron_slmoe.plan.planner import LayoutVerdict, PlanOptions, evaluate, layouts
from megatron_slmoe.plan.settings import RunSettings


@dataclass(frozen=True)
class LayoutCheck:
    verdict: LayoutVerdict
    nearest: Optional[LayoutVerdict]
    """When it does not fit: the fitting layout of the same devices that changes least."""
    device: DeviceSpec
    shape: ModelShape

    @property
    def fits(self) -> bool:
        return self.verdict.fits

    @property
    def message(self) -> str:
        """One line for the start-up log or refusal."""
        v = self.verdict
        if v.memory is None:
            return f"layout {v.settings.describe()} is invalid: {v.reason}"
        peak = v.memory.peak_stage
        head = (f"layout {v.settings.describe()}: predicted peak {peak.peak / GiB:.2f} GiB per "
                f"rank (stage {peak.stage}) of {self.device.memory_bytes / GiB:.2f} GiB")
        if v.fits:
            return head + " - fits"
        hint = (f"; nearest layout that fits: {self.nearest.settings.describe()} "
                f"({self.nearest.peak_bytes / GiB:.2f} GiB)" if self.nearest
                else "; no layout of these devices fits (python -m megatron_slmoe.plan)")
        return head + " - does not fit" + hint

    def to_dict(self) -> dict:
        return {"fits": self.fits, "message": self.message, "layout": self.verdict.to_dict(),
                "nearest": self.nearest.to_dict() if self.nearest else None}


def _shape(model: Union[ModelConfig, ModelShape]) -> ModelShape:
    return model if isinstance(model, ModelShape) else ModelShape.from_config(model)


def _changes(a: RunSettings, b: RunSettings) -> int:
    fields = ("tp", "pp", "ep", "distributed_optimizer", "recompute_label", "micro_batch_size")
    return sum(getattr(a, name) != getattr(b, name) for name in fields)


def check_layout(model: Union[ModelConfig, ModelShape], settings: RunSettings,
                 device_memory_bytes: Optional[int] = None,
                 device: Optional[DeviceSpec] = None) -> LayoutCheck:
    """Does the run fit? ``device`` (a preset, see ``megatron_slmoe.plan.devices.DEVICES``) or just
    its memory in bytes. Raises ValueError (one line naming the flag) for invalid settings."""
    if device is None:
        if device_memory_bytes is None:
            raise ValueError("check_layout needs device_memory_bytes or a device")
        device = generic_device(device_memory_bytes, settings.devices_per_node)
    shape = _shape(model)
    verdict = evaluate(shape, settings, device)
    nearest = None
    if not verdict.fits:
        options = PlanOptions(seq_length=settings.seq_length,
                              global_batch_size=settings.global_batch_size,
                              dtype=settings.dtype, lora_rank=settings.lora_rank,
                              lora_targets=settings.lora_targets,
                              expert_lora_rank=settings.expert_lora_rank,
                              moe_rank_scaling=settings.moe_rank_scaling,
                              expert_lora_layout=settings.expert_lora_layout,
                              moe_imbalance=settings.moe_imbalance,
                              micro_batch_sizes=tuple(sorted({1, settings.micro_batch_size})),
                              hierarchical_alltoall=settings.hierarchical_alltoall,
                              vision=settings.vision)
        fitting = [v for v in (evaluate(shape, s, device)
                               for s in layouts(shape, device, settings.world_size, options))
                   if v.fits]
        if fitting:
            nearest = min(fitting, key=lambda v: (_changes(settings, v.settings), v.step_time_s))
    return LayoutCheck(verdict, nearest, device, shape)


def checklist_steps(settings: RunSettings, shape: ModelShape,
                    device: DeviceSpec) -> list[tuple[str, RunSettings]]:
    """The OOM checklist in order, as (advice, changed settings) for the steps that apply."""
    steps = []
    if shape.packed_expert_bytes is not None and not settings.experts_packed(shape):
        packed = settings.replace(expert_weights="packed")
        saved = (stage_weight_bytes(shape, settings, device)
                 - stage_weight_bytes(shape, packed, device)) / GiB
        steps.append((f"hold the experts packed: --expert-weights packed saves {saved:.3g} "
                      f"GiB/rank", packed))
    if settings.recompute == "none":
        steps.append(("recompute the core attention (--recompute-granularity selective "
                      "--recompute-modules core_attn)",
                      settings.replace(recompute="selective", recompute_modules=("core_attn",))))
    if settings.recompute != "full" and not settings.recomputes("moe"):
        modules = tuple(sorted(set(settings.recompute_modules) | {"moe"})) \
            if settings.recompute == "selective" else ("core_attn", "moe")
        steps.append(("recompute the MoE layers (--recompute-modules "
                      f"{' '.join(modules)})",
                      settings.replace(recompute="selective", recompute_modules=modules)))
    if settings.recompute != "full":
        steps.append(("recompute whole layers (--recompute-granularity full)",
                      settings.replace(recompute="full")))
    if not settings.distributed_optimizer and settings.dp > 1:
        steps.append(("shard the optimizer state (--use-distributed-optimizer)",
                      settings.replace(distributed_optimizer=True)))
    if shape.experts and (settings.tp * settings.dp) % (settings.ep * 2) == 0 \
            and shape.experts % (settings.ep * 2) == 0:
        steps.append((f"more expert parallelism (--expert-model-parallel-size {settings.ep * 2})",
                      settings.replace(ep=settings.ep * 2)))
    if settings.dp % 2 == 0 and settings.tp * 2 <= settings.devices_per_node:
        steps.append((f"more tensor parallelism (--tensor-model-parallel-size {settings.tp * 2})",
                      _regrid(settings, tp=settings.tp * 2)))
    if settings.dp % 2 == 0:
        steps.append((f"more pipeline stages (--pipeline-model-parallel-size {settings.pp * 2})",
                      _regrid(settings, pp=settings.pp * 2)))
    if settings.micro_batch_size > 1:
        smaller = settings.micro_batch_size // 2
        steps.append((f"a smaller micro-batch (--micro-batch-size {smaller})",
                      settings.replace(micro_batch_size=smaller)))
    return steps + expert_adapter_steps(settings, shape)


def expert_adapter_steps(settings: RunSettings,
                         shape: ModelShape) -> list[tuple[str, RunSettings]]:
    """Smaller routed-expert adapters, each with the adapter state it saves per rank: the
    experts' rank (--moe-rank-scaling's rank // top-k where that is smaller, else 2) and the
    shared-outer layout."""
    if not shape.experts or not {"linear_fc1", "linear_fc2"} & set(settings.lora_targets):
        return []
    candidates = []
    rank, scaled = settings.expert_rank(shape), settings.lora_rank // shape.topk
    if settings.lora_rank % shape.topk == 0 and 1 <= scaled < rank:
        candidates.append((f"--moe-rank-scaling (experts at rank {scaled})",
                           settings.replace(expert_lora_rank=0, moe_rank_scaling=True)))
    elif rank > 2:
        candidates.append(("--expert-lora-rank 2",
                           settings.replace(expert_lora_rank=2, moe_rank_scaling=False)))
    if settings.expert_lora_layout == "per-expert":
        candidates.append(("--expert-lora-layout shared-outer (serve it with SGLang, or export "
                           "--export-hf-layout shared-outer-expanded)",
                           settings.replace(expert_lora_layout="shared-outer")))
    steps = []
    for flags, changed in candidates:
        saved = stage_adapter_state_bytes(shape, settings) - stage_adapter_state_bytes(shape,
                                                                                      changed)
        if saved > 0:
            steps.append((f"smaller expert adapters: {flags} saves {saved / GiB:.3g} GiB/rank",
                          changed))
    return steps


def _regrid(settings: RunSettings, **changes) -> RunSettings:
    """Same devices with more TP or PP: data parallelism shrinks; EP shrinks to still divide."""
    tp, pp = changes.get("tp", settings.tp), changes.get("pp", settings.pp)
    dp = settings.world_size // (tp * pp)
    ep = settings.ep
    while layout_problem(settings.world_size, tp, pp, ep):
        ep //= 2
    return settings.replace(tp=tp, pp=pp, dp=dp, ep=ep)


def next_checklist_step(check: LayoutCheck) -> Optional[tuple[str, LayoutVerdict]]:
    """The first checklist step that the memory model says lowers the peak (the first that fits,
    if one does), with its verdict; None when no step helps."""
    current = check.verdict.peak_bytes
    candidates = []
    for advice, changed in checklist_steps(check.verdict.settings, check.shape, check.device):
        if changed.layout_error(check.shape):
            continue
        verdict = evaluate(check.shape, changed, check.device)
        if current is None or (verdict.peak_bytes is not None and verdict.peak_bytes < current):
            candidates.append((advice, verdict))
    fitting = [c for c in candidates if c[1].fits]
    return (fitting or candidates or [None])[0]


def format_oom_report(check: LayoutCheck, error: Optional[BaseException] = None) -> str:
    """The report for an out-of-memory error: what the planner predicted, by component, and the
    next step of the checklist."""
    v = check.verdict
    lines = ["out of memory" + (f": {str(error).splitlines()[0]}" if error else ""),
             check.message]
    if v.memory is not None:
        peak = v.memory.peak_stage
        lines.append(f"predicted per rank on stage {peak.stage} (layers {peak.layers[0]}-"
                     f"{peak.layers[1] - 1}, {peak.in_flight} micro-batches in flight):")
        for name in COMPONENTS:
            lines.append(f"  {name:<20}{peak.component(name) / GiB:>10.2f} GiB")
        lines.append(f"  {'total':<20}{peak.peak / GiB:>10.2f} GiB")
    levers = [advice.partition(": ")[2] for advice, _ in
              expert_adapter_steps(v.settings, check.shape)] if v.memory is not None else []
    if levers:
        lines.append("expert adapter levers: " + "; ".join(levers))
    step = next_checklist_step(check)
    if step is None:
        lines.append("next step: none of the checklist's steps lowers the predicted peak on "
                     "these devices; add devices (python -m megatron_slmoe.plan)")
    else:
        advice, verdict = step
        outcome = "fits" if verdict.fits else "still over"
        lines.append(f"next step: {advice} -> predicted {verdict.peak_bytes / GiB:.2f} GiB "
                     f"({outcome})")
    return "\n".join(lines)
