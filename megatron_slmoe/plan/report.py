"""The planner's table and JSON document."""

from __future__ import annotations

from collections import Counter

from megatron_slmoe.plan.devices import GiB
from megatron_slmoe.plan.planner import LayoutVerdict, Plan

_COLUMNS = (("weights", "weights"), ("lora+grad+opt", None), ("activ", "activations"),
            ("moe rows", "moe_rows"), ("transient", "transient"), ("overhead", None))


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def _row(v: LayoutVerdict) -> str:
    s = v.settings
    layout = (f"{s.tp:>3}{s.pp:>4}{s.ep:>5}{s.dp:>5}  {'on ' if s.distributed_optimizer else 'off'}"
              f"  {s.recompute_label:<20}{s.micro_batch_size:>4}")
    if v.memory is None:
        return f"{layout}  {v.reason}"
    p = v.memory.peak_stage
    parts = [_gib(p.weights), _gib(p.lora_params + p.grad_buffers + p.optimizer),
             _gib(p.activations), _gib(p.moe_rows), _gib(p.transient),
             _gib(p.framework_overhead + p.fragmentation)]
    memory = "".join(f"{x:>{w}}" for x, w in zip(parts, _WIDTHS)) + f"{_gib(p.peak):>9}"
    time = f"{v.step_time_s:>9.2f}{v.time.tokens_per_s:>11,.0f}"
    return f"{layout}{memory}{time}" + ("" if v.fits else f"  {v.reason}")


_WIDTHS = (10, 15, 10, 10, 10, 10)
_HEADER = (f"{'tp':>3}{'pp':>4}{'ep':>5}{'dp':>5}  dopt  {'recompute':<20}{'mbs':>4}"
           + "".join(f"{name:>{w}}" for (name, _), w in zip(_COLUMNS, _WIDTHS)) + f"{'peak':>9}"
           + f"{'step s':>9}{'tokens/s':>11}")


def format_table(result: Plan, top: int = 10) -> str:
    shape, device = result.shape, result.device
    opts = result.options
    lines = [
        f"model {shape.name}: base weights {result.weights_bytes_total / 1e12:.2f} TB in "
        f"{opts.dtype} ({result.weights_bytes_total / GiB:,.0f} GiB)",
        f"cluster: {result.num_devices} x {device.name} ({device.memory_bytes / GiB:.1f} GiB, "
        f"{device.devices_per_node} per node); seq {opts.seq_length}, global batch "
        f"{opts.global_batch_size}, LoRA r={opts.lora_rank} on {', '.join(opts.lora_targets)}",
        "memory per rank in GiB (peak stage); overhead = framework + fragmentation",
    ]
    feasible = result.feasible
    if feasible:
        lines += [f"{len(feasible)} of {len(result.verdicts)} layouts fit; the fastest "
                  f"{min(top, len(feasible))}:", _HEADER]
        lines += [_row(v) for v in feasible[:top]]
    else:
        if result.verdicts:
            lines.append(f"NO LAYOUT FITS: none of the {len(result.verdicts)} layouts of "
                         f"{result.num_devices} devices fits in "
                         f"{device.memory_bytes / GiB:.1f} GiB.")
        else:
            lines.append(f"NO LAYOUT: {result.num_devices} devices cannot share "
                         f"--global-batch-size {result.options.global_batch_size}: every layout "
                         f"leaves at least {result.fewest_replicas} data-parallel replicas, each "
                         f"needing micro-batches of its own (use fewer devices or a larger "
                         f"global batch).")
        if result.smallest_fitting:
            v = result.smallest_layout
            lines.append(f"The smallest cluster of this device that fits: "
                         f"{result.smallest_fitting} devices, e.g. {v.settings.describe()} "
                         f"({v.peak_bytes / GiB:.1f} GiB per rank).")
        else:
            lines.append("No cluster of this device up to 2^20 devices fits.")
    rejected = [v for v in result.verdicts if not v.fits]
    if rejected:
        lines.append(f"{len(rejected)} rejected; nearest to fitting:")
        lines.append(_HEADER + "  why")
        lines += [_row(v) for v in rejected[:top]]
        kinds = Counter(_kind(v) for v in rejected)
        lines.append("rejected by reason: " + ", ".join(f"{k}: {n}" for k, n in kinds.most_common()))
    return "\n".join(lines)


def _kind(v: LayoutVerdict) -> str:
    if v.memory is not None:
        return "memory"
    return v.reason.split(" ")[0] if v.reason else "?"


def plan_document(result: Plan) -> dict:
    return {
        "model": result.shape.name,
        "device": {k: getattr(result.device, k) for k in result.device.__dataclass_fields__},
        "num_devices": result.num_devices,
        "options": {k: getattr(result.options, k) for k in result.options.__dataclass_fields__},
        "weights_bytes_total": result.weights_bytes_total,
        "feasible": len(result.feasible),
        "smallest_fitting_num_devices": result.smallest_fitting,
        "smallest_fitting_layout": (result.smallest_layout.to_dict()
                                    if result.smallest_layout else None),
        "layouts": [v.to_dict() for v in result.verdicts],
    }


