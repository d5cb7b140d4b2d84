"""Enumerate the layouts of a cluster, keep those that fit, rank them by estimated step time.

``evaluate(shape, settings, device)`` prices one layout (a ``LayoutVerdict``: fits or why not,
the memory estimate, the step time). ``plan(shape, device, num_devices, options)`` enumerates TP
(within a node), PP, EP, the distributed optimizer, recomputation and micro-batch sizes, and
returns a ``Plan`` with every layout, fitting ones first and fastest first; when none fits it
also names the smallest cluster of this device on which one does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Union

from megatron_slmoe.parallel.layout import batch_split_problem, layout_problem
from megatron_slmoe.plan.devices import DeviceSpec, GiB
from megatron_slmoe.plan.memory import (
    MemoryEstimate,
    estimate_memory,
    weights_bytes_total,
)
from megatron_slmoe.plan.model_shape import ModelShape
from megatron_slmoe.plan.settings import RunSettings
from megatron_slmoe.plan.step_time import StepTime, estimate_step_time
from megatron_slmoe.plan.vision import ReplicatedTower, VisionShape

RECOMPUTE_CHOICES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("none", ("core_attn",)),
    ("selective", ("core_attn",)),
    ("selective", ("core_attn", "moe")),
    ("full", ("core_attn",)),
)
"""Recomputation the planner tries, cheapest first."""


@dataclass(frozen=True)
class PlanOptions:
    """What stays fixed while the planner varies the layout (defaults: ``RunSettings``')."""

    seq_length: int = RunSettings.seq_length
    global_batch_size: int = RunSettings.global_batch_size
    dtype: str = RunSettings.dtype
    lora_rank: int = RunSettings.lora_rank
    lora_targets: tuple[str, ...] = RunSettings.lora_targets
    moe_imbalance: float = RunSettings.moe_imbalance
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4)
    expert_lora_rank: int = 0
    moe_rank_scaling: bool = False
    expert_lora_layout: str = "per-expert"
    """The routed experts' LoRA (``RunSettings``' fields of the same names)."""
    hierarchical_alltoall: Optional[bool] = None
    """None: hierarchical whenever the expert-parallel group spans nodes."""
    vision: Optional[Union[VisionShape, ReplicatedTower]] = None
    """The run's vision tower and projector (``RunSettings.vision``; None: none)."""

    def settings(self, **layout) -> RunSettings:
        return RunSettings(seq_length=self.seq_length, global_batch_size=self.global_batch_size,
                           dtype=self.dtype, lora_rank=self.lora_rank,
                           lora_targets=self.lora_targets, moe_imbalance=self.moe_imbalance,
                           expert_lora_rank=self.expert_lora_rank,
                           moe_rank_scaling=self.moe_rank_scaling,
                           expert_lora_layout=self.expert_lora_layout, vision=self.vision,
                           **layout)


@dataclass(frozen=True)
class LayoutVerdict:
    settings: RunSettings
    fits: bool
    reason: Optional[str]
    """Why it does not fit or is invalid; None when it fits."""
    memory: Optional[MemoryEstimate] = None
    time: Optional[StepTime] = None
    usable_bytes: int = 0

    @property
    def peak_bytes(self) -> Optional[int]:
        return self.memory.peak_bytes if self.memory else None

    @property
    def step_time_s(self) -> Optional[float]:
        return self.time.step_time_s if self.time else None

    def to_dict(self) -> dict:
        s = self.settings
        data = {
            "tp": s.tp, "pp": s.pp, "ep": s.ep, "dp": s.dp,
            "distributed_optimizer": s.distributed_optimizer, "recompute": s.recompute,
            "recompute_modules": list(s.recompute_modules) if s.recompute == "selective" else [],
            "micro_batch_size": s.micro_batch_size, "hierarchical_alltoall":
                s.hierarchical_alltoall, "num_microbatches": s.num_microbatches,
            "fits": self.fits, "reason": self.reason,
            "peak_bytes_per_rank": self.peak_bytes, "usable_bytes_per_rank": self.usable_bytes,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.time.tokens_per_s if self.time else None,
        }
        if self.memory:
            peak = self.memory.peak_stage
            data["peak_stage"] = peak.stage
            data["breakdown"] = peak.breakdown()
            data["weights_by_dtype"] = peak.weights_by_dtype
            data["transient_event"] = peak.transient_event
            data["in_flight_microbatches"] = peak.in_flight
            data["stages_peak_bytes"] = [stage.peak for stage in self.memory.stages]
        if self.time:
            data["time"] = self.time.to_dict()
        return data


def evaluate(shape: ModelShape, settings: RunSettings, device: DeviceSpec) -> LayoutVerdict:
    """Whether ``settings`` fits ``device`` for ``shape``, with the memory and time estimates."""
    settings.validate()
    invalid = settings.layout_error(shape)
    if invalid:
        return LayoutVerdict(settings, False, invalid, usable_bytes=device.memory_bytes)
    memory = estimate_memory(shape, settings, device)
    time = estimate_step_time(shape, settings, device)
    peak = memory.peak_stage
    if peak.peak > device.memory_bytes:
        largest = max(peak.breakdown().items(), key=lambda kv: kv[1])
        reason = (f"needs {peak.peak / GiB:.1f} GiB on stage {peak.stage} > "
                  f"{device.memory_bytes / GiB:.1f} GiB (largest: {largest[0]} "
                  f"{largest[1] / GiB:.1f} GiB)")
        return LayoutVerdict(settings, False, reason, memory, time, device.memory_bytes)
    return LayoutVerdict(settings, True, None, memory, time, device.memory_bytes)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(shape: ModelShape, device: DeviceSpec, num_devices: int, options: PlanOptions,
            micro_batch_sizes: Optional[Iterable[int]] = None,
            recompute_choices=RECOMPUTE_CHOICES) -> list[RunSettings]:
    """Every candidate layout of ``num_devices`` devices (TP within a node, powers of two)."""
    node = device.devices_per_node
    candidates = []
    for tp in (t for t in (1, 2, 4, 8, 16, 32) if t <= min(node, num_devices)):
        if shape.heads % tp or shape.query_groups % tp or num_devices % tp:
            continue
        for pp in _divisors(shape.num_layers):
            if layout_problem(num_devices, tp, pp, 1):
                continue
            dp = num_devices // (tp * pp)
            for ep in _divisors(shape.experts or 1):
                if layout_problem(num_devices, tp, pp, ep):
                    continue
                spans_nodes = ep > node
                hierarchical = (options.hierarchical_alltoall if options.hierarchical_alltoall
                                is not None else spans_nodes)
                for distopt in ((False, True) if dp > 1 else (False,)):
                    for recompute, modules in recompute_choices:
                        for mbs in micro_batch_sizes or options.micro_batch_sizes:
                            if batch_split_problem(options.global_batch_size, dp, mbs):
                                continue
                            candidates.append(options.settings(
                                tp=tp, pp=pp, ep=ep, dp=dp, distributed_optimizer=distopt,
                                recompute=recompute, recompute_modules=modules,
                                micro_batch_size=mbs, hierarchical_alltoall=hierarchical,
                                devices_per_node=node))
    return candidates


@dataclass
class Plan:
    shape: ModelShape
    device: DeviceSpec
    num_devices: int
    options: PlanOptions
    verdicts: list[LayoutVerdict]
    """Fitting layouts fastest first, then the rejected ones, nearest to fitting first."""
    smallest_fitting: Optional[int] = None
    """When nothing fits: the fewest devices of this kind on which a layout does."""
    smallest_layout: Optional[LayoutVerdict] = None
    weights_bytes_total: int = field(default=0)

    @property
    def fewest_replicas(self) -> int:
        """The fewest data-parallel replicas any TP x PP of this cluster leaves (one micro-batch
        each at least: more than the global batch means no layout)."""
        splits = [tp * pp for tp in (1, 2, 4, 8, 16, 32) for pp in _divisors(self.shape.num_layers)
                  if tp <= self.device.devices_per_node and not self.num_devices % (tp * pp)]
        return self.num_devices // max(splits, default=1)

    @property
    def feasible(self) -> list[LayoutVerdict]:
        return [v for v in self.verdicts if v.fits]

    @property
    def best(self) -> Optional[LayoutVerdict]:
        return self.feasible[0] if self.feasible else None


def _rank(verdicts: list[LayoutVerdict]) -> list[LayoutVerdict]:
    fitting = sorted((v for v in verdicts if v.fits), key=lambda v: v.step_time_s)
    rejected = sorted((v for v in verdicts if not v.fits),
                      key=lambda v: (v.peak_bytes is None, v.peak_bytes or 0))
    return fitting + rejected


def plan(shape: ModelShape, device: DeviceSpec, num_devices: int,
         options: PlanOptions = PlanOptions()) -> Plan:
    """Every layout of ``num_devices`` devices, ranked; the smallest cluster when none fits."""
    verdicts = _rank([evaluate(shape, s, device)
                      for s in layouts(shape, device, num_devices, options)])
    result = Plan(shape, device, num_devices, options, verdicts,
                  weights_bytes_total=weights_bytes_total(shape, options.dtype))
    if not result.feasible:
        result.smallest_fitting, result.smallest_layout = smallest_cluster(
            shape, device, num_devices, options)
    return result


def _fastest_fit(shape, device, num_devices, options, lean: bool) -> Optional[LayoutVerdict]:
    # lean: only the memory-thriftiest choices (micro-batch 1, recomputing the MoE layer or all).
    kwargs = {"micro_batch_sizes": (1,), "recompute_choices": RECOMPUTE_CHOICES[2:]} if lean else {}
    best = None
    for settings in layouts(shape, device, num_devices, options, **kwargs):
        verdict = evaluate(shape, settings, device)
        if verdict.fits and (best is None or verdict.step_time_s < best.step_time_s):
            best = verdict
    return best


def _prime_factors(n: int) -> set[int]:
    found, p = set(), 2
    while p * p <= n:
        while n % p == 0:
            found.add(p)
            n //= p
        p += 1
    return found | ({n} if n > 1 else set())


def _growing_sizes(shape: ModelShape, start: int, node: int, limit: int) -> list[int]:
    """The cluster sizes to try, ascending from ``start``: doublings, and between them the node
    multiples of the odd primes of the layer and expert counts (the pipeline sizes divide the
    layers and the expert-parallel sizes the experts: Kimi K3's 93 layers take PP 3 or 31 and its
    896 experts EP 7 x 2^k, none of which a power-of-two cluster holds)."""
    primes = _prime_factors(shape.num_layers) | _prime_factors(shape.experts or 1)
    steps = [node] + [node * p for p in sorted(primes - {2})]
    sizes = set()
    for k in range(limit.bit_length()):
        for step in steps:  # the first multiple of the step at or above the doubling
            sizes.add(-(-(start << k) // step) * step)
    return sorted(size for size in sizes if start <= size <= limit)


def smallest_cluster(shape: ModelShape, device: DeviceSpec, num_devices: int,
                     options: PlanOptions, limit: int = 1 << 20
                     ) -> tuple[Optional[int], Optional[LayoutVerdict]]:
    """The fewest devices (a multiple of a node) with a fitting layout: above ``num_devices``
    when some of its layouts exist but none fits, else from one node up (a cluster too large to
    split the global batch over has smaller ones that fit)."""
    node = device.devices_per_node
    if not layouts(shape, device, num_devices, options):
        num_devices = 0
    low = num_devices
    found = None
    for high in _growing_sizes(shape, max(node, -(-num_devices // node) * node), node, limit):
        found = _fastest_fit(shape, device, high, options, lean=True)
        if found:
            break
        low = high
    if not found:
        return None, None
    # Search the node multiples between the last failure and the first fit.
    for size in range(-(-(low + 1) // node) * node, high, node):
        verdict = _fastest_fit(shape, device, size, options, lean=True)
        if verdict:
            return size, verdict
    return high, found
