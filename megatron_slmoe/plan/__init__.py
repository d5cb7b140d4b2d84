"""Memory and step-time model, and layout planner, for LoRA fine-tuning of Stable Latent MoE models.

Works on model configs alone (no torch model is built). The pieces:

* ``load_shape`` / ``ModelShape`` and ``census`` (``model_shape``): the numbers of a config and
  its parameter census;
* ``RunSettings`` (``settings``): one layout and the settings that change memory and time;
* ``estimate_memory`` (``memory``): per-rank peak by component and pipeline stage;
* ``estimate_step_time`` (``step_time``) with all-to-all bytes by the dispatcher's accounting
  (``traffic``);
* ``plan`` / ``evaluate`` (``planner``): every layout of a cluster, ranked;
* ``check_layout`` / ``format_oom_report`` (``check``): the training job's start-up check and
  its out-of-memory report;
* ``DEVICES`` (``devices``): H100, H200, Ascend 910B presets.

Command line: ``python -m megatron_slmoe.plan --help``.
"""

from megatron_slmoe.plan.check import (
           LayoutCheck,
           check_layout,
           format_oom_report,
           next_checklist_step,
)
from megatron_slmoe.plan.devices import DEVICES, DeviceSpec, generic_device
from megatron_slmoe.plan.memory import MemoryEstimate, StageMemory, estimate_memory
from megatron_slmoe.plan.model_shape import ModelShape, census, load_shape
from megatron_slmoe.plan.planner import LayoutVerdict, Plan, PlanOptions, evaluate, plan
from megatron_slmoe.plan.settings import RunSettings
from megatron_slmoe.plan.step_time import StepTime, estimate_step_time

__all__ = ["DEVICES", "DeviceSpec", "LayoutCheck", "LayoutVerdict", "MemoryEstimate",
           "ModelShape", "Plan", "PlanOptions", "RunSettings", "StageMemory", "StepTime",
           "census", "check_layout", "estimate_memory", "estimate_step_time", "evaluate",
           "format_oom_report", "generic_device", "load_shape", "next_checklist_step", "plan"]
