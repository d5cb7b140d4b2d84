"""Routing-stability monitor: once per step, turn every router's accumulated statistics into
load metrics and warn (or stop) when routing collapses.

Each router fills a ``RoutingStatsAccumulator`` during forward. ``RoutingMonitor.step`` reduces all
layers held by this rank across the tensor+data(+context) parallel group with one SUM and one MAX
all-reduce, resets the accumulators, and reports per layer:

- ``tokens_per_expert``: assignments per expert (a token routed to k experts counts k times);
- ``imbalance``: max / mean of ``tokens_per_expert`` over all E experts (1.0 = balanced);
- ``load_entropy``: entropy of the normalised ``tokens_per_expert`` / log(E) (1.0 = balanced);
- ``router_entropy``: mean per-token entropy of the routing scores (nats);
- ``logit_rms`` and ``logit_max_abs`` of the raw router logits;
- ``dead_experts_window``: experts that received no token over the last ``window`` steps (over the
  steps seen so far while fewer than ``window`` have passed);
- the collapse detectors' state: ``max_share``, ``dominant_expert``, ``starving`` (``[expert,
  consecutive starving steps]`` pairs).

A layer that routed no token in a step reports ``imbalance``, ``load_entropy``, ``router_entropy``
and ``logit_rms`` as 0.0 (there is no load to measure), and its collapse detectors keep their state:
an empty step is no evidence either way. ``summary_line`` leaves such layers out.

Collapse detection, per layer and expert, on the share of the assignments of one *check*. A check
judges the steps since the previous check once they routed at least ``min_routed_tokens`` tokens
(one step each when steps are large enough; several steps pooled when they are small, so a share
is never judged on a handful of tokens), and no check happens during the first ``warmup_steps``
steps (routing that is still settling, e.g. from a random initialisation, is not a collapse):
- starving: share < ``starved_fraction`` / E for ``starved_patience`` checks in a row; fires once
  when the run reaches the patience, re-arms after a check above the threshold;
- dominating: share > ``dominant_fraction``; fires on the first such check, re-arms after a check
  at or below it. With top-k routing a share above 1/k is impossible, so ``dominant_fraction`` >=
  1/k never fires.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
from megatron.core import parallel_state

from megatron_slmoe.moe.config import MonitorConfig
from megatron_slmoe.config.types import is_int
from megatron_slmoe.moe.dispatch.traffic import TrafficAccumulator
from megatron_slmoe.moe.routing_stats import RoutingStatsAccumulator

class RoutingCollapseError(RuntimeError):
    """Raised by ``RoutingMonitor.step`` when ``action="stop"`` and routing collapsed."""


@dataclass
class _LayerTrack:
    """One router and the monitor's memory of it across steps."""

    layer_number: int
    stats: RoutingStatsAccumulator
    window: int
    recent_WE: torch.Tensor = field(init=False)  # ring buffer of the last `window` steps' loads
    starving_steps_E: list[int] = field(init=False)  # consecutive starving checks
    starving_since_E: list[int] = field(init=False)  # the step each starving run began
    dominating_E: list[bool] = field(init=False)
    pooled_E: torch.Tensor = field(init=False)  # assignments since the last check
    pooled_tokens: float = 0.0
    steps: int = 0

    def __post_init__(self) -> None:
        num_experts = self.stats.num_experts
        self.recent_WE = torch.zeros(self.window, num_experts, dtype=torch.float64)
        self.starving_steps_E = [0] * num_experts
        self.starving_since_E = [0] * num_experts
        self.dominating_E = [False] * num_experts
        self.pooled_E = torch.zeros(num_experts, dtype=torch.float64)


def _find_routers(model_chunks: Iterable[torch.nn.Module],
                  ) -> list[tuple[int, RoutingStatsAccumulator]]:
    found: dict[int, tuple[int, RoutingStatsAccumulator]] = {}  # id(accumulator) -> router
    layers: dict[int, str] = {}  # layer_number -> module name
    for chunk in model_chunks:
        for name, module in chunk.named_modules():
            stats = getattr(module, "routing_stats", None)
            if not isinstance(stats, RoutingStatsAccumulator):
                continue
            # A module exposing its router's accumulator (or a chunk listed twice, or a DDP
            # wrapper) shows the same object again: count it once.
            if id(stats) in found:
                continue
            layer_number = getattr(module, "layer_number", None)
            if not is_int(layer_number):
                raise ValueError(f"RoutingMonitor: router module '{name}' has routing_stats but "
                                 f"layer_number={layer_number!r}, not an int")
            if layer_number in layers:
                raise ValueError(f"RoutingMonitor: two routers report layer_number={layer_number} "
                                 f"('{layers[layer_number]}' and '{name}')")
            found[id(stats)] = (layer_number, stats)
            layers[layer_number] = name
    return sorted(found.values(), key=lambda item: item[0])


def _find_traffic(model_chunks: Iterable[torch.nn.Module]) -> dict[int, TrafficAccumulator]:
    """Dispatcher byte counters by layer: modules exposing ``traffic_stats`` and ``layer_number``
    (the MoE layer does, for dispatchers that count)."""
    found: dict[int, TrafficAccumulator] = {}
    for chunk in model_chunks:
        for module in chunk.modules():
            traffic = getattr(module, "traffic_stats", None)
            layer_number = getattr(module, "layer_number", None)
            if isinstance(traffic, TrafficAccumulator) and is_int(layer_number):
                found[layer_number] = traffic
    return found


def _default_group() -> Optional[torch.distributed.ProcessGroup]:
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        # Summing over nothing would report one rank's share as the whole: refuse instead.
        raise ValueError("RoutingMonitor: torch.distributed is initialised but Megatron "
                         "parallel_state is not; pass group= explicitly")
    return None


class RoutingMonitor:
    """Reports the routers held by this rank's model chunks, reduced over ``group`` (default: the
    tensor+data+context parallel group, i.e. every rank holding the same layers)."""

    def __init__(self, model_chunks: torch.nn.Module | Iterable[torch.nn.Module],
                 config: MonitorConfig,
                 group: Optional[torch.distributed.ProcessGroup] = None) -> None:
        if isinstance(model_chunks, torch.nn.Module):
            model_chunks = [model_chunks]
        model_chunks = list(model_chunks)
        self.config = config
        self.group = group if group is not None else _default_group()
        self._layers: list[_LayerTrack] = []
        for layer_number, stats in _find_routers(model_chunks):
            num_experts = stats.num_experts
            if num_experts < 2:
                raise ValueError(f"RoutingMonitor: layer {layer_number} has {num_experts} expert; "
                                 "routing needs at least 2")
            if config.dominant_fraction <= 1.0 / num_experts:
                config.fail("dominant_fraction",
                            f"{config.dominant_fraction} must be > 1/E = {1.0 / num_experts:.4g} "
                            f"(layer {layer_number} has {num_experts} experts)")
            self._layers.append(_LayerTrack(layer_number, stats, config.window))
        traffic = _find_traffic(model_chunks)
        self._traffic = [traffic.get(track.layer_number) for track in self._layers]

    @property
    def layer_numbers(self) -> list[int]:
        return [track.layer_number for track in self._layers]

    def step(self, iteration: int) -> dict[str, Any]:
        states, traffic = self._reduce_and_reset()
        layers: dict[int, dict[str, Any]] = {}
        warnings: list[str] = []
        for track, state, bytes_2 in zip(self._layers, states, traffic):
            layers[track.layer_number] = self._layer_metrics(track, state, iteration, warnings)
            if bytes_2 is not None:  # dispatcher traffic over the group, this step
                layers[track.layer_number]["bytes_intra_node"] = int(bytes_2[0])
                layers[track.layer_number]["bytes_inter_node"] = int(bytes_2[1])
        result = {"iteration": iteration, "layers": layers, "warnings": warnings}

        if warnings and self._is_group_leader():
            # Every rank of the group holds the same reduced figures: log them once per group.
            logger = logging.getLogger(__name__)
            for message in warnings:
                logger.warning(message)
        if self.config.jsonl_path is not None and self._is_world_rank0():
            _append_jsonl(self.config.jsonl_path, result)
        if warnings and self.config.action == "stop":
            raise RoutingCollapseError("; ".join(warnings))
        return result

    def _reduce_and_reset(self) -> tuple[list[torch.Tensor], list[Optional[torch.Tensor]]]:
        """All layers' states summed (max field: maximised) over the group, as float64 on CPU,
        and the dispatchers' byte counters summed in the same collective."""
        if not self._layers:
            return [], []
        local = [track.stats.state for track in self._layers]
        # A router that never ran still holds a CPU state; reduce on the device the others use.
        device = next((s.device for s in local if s.device.type != "cpu"), local[0].device)
        sizes = [s.numel() for s in local]
        sum_widths = [s[RoutingStatsAccumulator.SUM_FIELDS].numel() for s in local]
        # cat / stack copy, so resetting the accumulators below leaves these intact.
        counters = [t.state.to(device) if t is not None else torch.zeros(2, dtype=torch.float64,
                                                                          device=device)
                    for t in self._traffic]
        sums_flat = torch.cat([s[RoutingStatsAccumulator.SUM_FIELDS].to(device) for s in local]
                              + counters)
        maxes_L = torch.stack([s[RoutingStatsAccumulator.MAX_FIELD].to(device) for s in local])
        for track, traffic in zip(self._layers, self._traffic):
            track.stats.reset()
            if traffic is not None:
                traffic.reset()
        if self.group is not None:
            torch.distributed.all_reduce(sums_flat, op=torch.distributed.ReduceOp.SUM,
                                         group=self.group)
            torch.distributed.all_reduce(maxes_L, op=torch.distributed.ReduceOp.MAX,
                                         group=self.group)
        sums_flat, maxes_L = sums_flat.cpu(), maxes_L.cpu()  # the one host sync per step

        traffic_flat = sums_flat[sum(sum_widths):]
        sums_flat = sums_flat[:sum(sum_widths)]
        traffic = [None if t is None else b for t, b in zip(self._traffic, traffic_flat.split(2))]
        reduced = []
        for size, sums, max_value in zip(sizes, sums_flat.split(sum_widths), maxes_L):
            state = torch.zeros(size, dtype=torch.float64)
            state[RoutingStatsAccumulator.SUM_FIELDS] = sums
            state[RoutingStatsAccumulator.MAX_FIELD] = max_value
            reduced.append(state)
        return reduced, traffic

    def _layer_metrics(self, track: _LayerTrack, state: torch.Tensor, iteration: int,
                       warnings: list[str]) -> dict[str, Any]:
        num_experts = track.stats.num_experts
        fields = RoutingStatsAccumulator.unpack(state, num_experts)
        tokens_E = fields["tokens_per_expert"].round()
        num_tokens = fields["num_tokens"]
        assignments = tokens_E.sum().item()

        track.recent_WE[track.steps % track.window] = tokens_E
        track.steps += 1
        dead = int((track.recent_WE.sum(dim=0) == 0).sum().item())

        metrics: dict[str, Any] = {
            "tokens_per_expert": [int(t) for t in tokens_E.tolist()],
            "num_tokens": int(round(num_tokens)),
            "imbalance": 0.0,
            "load_entropy": 0.0,
            "router_entropy": 0.0,
            "logit_rms": 0.0,
            "logit_max_abs": fields["logit_max_abs"],
            "dead_experts_window": dead,
            "max_share": 0.0,
            "dominant_expert": None,
        }
        if assignments > 0:
            share_E = tokens_E / assignments
            # 0·log 0 = 0: experts without tokens add nothing to the entropy.
            plogp_E = torch.where(share_E > 0, share_E * share_E.clamp_min(1e-300).log(),
                                  torch.zeros_like(share_E))
            max_share, top_expert = share_E.max(dim=0)
            metrics["imbalance"] = tokens_E.max().item() / (assignments / num_experts)
            metrics["load_entropy"] = -plogp_E.sum().item() / math.log(num_experts)
            metrics["max_share"] = max_share.item()
            metrics["dominant_expert"] = int(top_expert)
        if track.steps > self.config.warmup_steps:
            track.pooled_E += tokens_E
            track.pooled_tokens += num_tokens
            pooled = track.pooled_E.sum().item()
            if pooled > 0 and track.pooled_tokens >= self.config.min_routed_tokens:
                self._detect_collapse(track, (track.pooled_E / pooled).tolist(), iteration,
                                      track.steps, warnings)
                track.pooled_E.zero_()
                track.pooled_tokens = 0.0
        if num_tokens > 0:
            metrics["router_entropy"] = fields["entropy_sum"] / num_tokens
            metrics["logit_rms"] = math.sqrt(fields["logit_sq_sum"] / (num_tokens * num_experts))
        metrics["starving"] = [[e, n] for e, n in enumerate(track.starving_steps_E) if n > 0]
        return metrics

    def _detect_collapse(self, track: _LayerTrack, share_E: list[float], iteration: int,
                         step: int, warnings: list[str]) -> None:
        cfg = self.config
        num_experts = len(share_E)
        fair = 1.0 / num_experts
        starve_below = cfg.starved_fraction * fair
        for expert, share in enumerate(share_E):
            if share < starve_below:
                track.starving_steps_E[expert] += 1
                if track.starving_steps_E[expert] == 1:
                    track.starving_since_E[expert] = step
                # == not >=: one warning per episode, at the check the run reaches the patience.
                if track.starving_steps_E[expert] == cfg.starved_patience:
                    steps = step - track.starving_since_E[expert] + 1
                    warnings.append(
                        f"routing collapse at iteration {iteration}: layer {track.layer_number} "
                        f"expert {expert} starving, share {share:.4g} < {cfg.starved_fraction:g} "
                        f"x fair share {fair:.4g} for {cfg.starved_patience} checks in a row "
                        f"(over {steps} steps)")
            else:
                track.starving_steps_E[expert] = 0
            if share > cfg.dominant_fraction:
                if not track.dominating_E[expert]:
                    warnings.append(
                        f"routing collapse at iteration {iteration}: layer {track.layer_number} "
                        f"expert {expert} dominating, share {share:.4g} > dominant_fraction "
                        f"{cfg.dominant_fraction:g} (fair share {fair:.4g})")
                track.dominating_E[expert] = True
            else:
                track.dominating_E[expert] = False

    def _is_group_leader(self) -> bool:
        return self.group is None or torch.distributed.get_rank(group=self.group) == 0

    @staticmethod
    def _is_world_rank0() -> bool:
        return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _append_jsonl(path: str | os.PathLike, record: dict[str, Any]) -> None:
    directory = os.path.dirname(os.fspath(path))
    if directory:
        os.makedirs(directory, exist_ok=True)
    # Non-finite logits (a diverging run) go out as NaN / Infinity, which Python's json reads.
    line = json.dumps(record) + "\n"
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(line)  # one write per record: a crash cannot leave half a line behind us
        handle.flush()


def summary_line(result: dict[str, Any]) -> str:
    """One line for the training log: worst layers and totals over the layers this rank holds."""
    layers = result["layers"]
    if not layers:
        return "routing: no MoE layers on this rank"
    dead = sum(m["dead_experts_window"] for m in layers.values())
    active = {n: m for n, m in layers.items() if m["num_tokens"] > 0}
    if not active:
        return f"routing: no tokens routed | dead experts {dead}"
    worst_imb = max(active, key=lambda n: active[n]["imbalance"])
    worst_ent = min(active, key=lambda n: active[n]["load_entropy"])
    router_entropy = sum(m["router_entropy"] for m in active.values()) / len(active)
    logit_max = max(m["logit_max_abs"] for m in active.values())
    return (f"routing: imbalance max {active[worst_imb]['imbalance']:.3f} (layer {worst_imb}) | "
            f"load entropy min {active[worst_ent]['load_entropy']:.3f} (layer {worst_ent}) | "
            f"router entropy mean {router_entropy:.3f} | logit max {logit_max:.3g} | "
            f"dead experts {dead} | warnings {len(result['warnings'])}")
