"""The parallel layout section: how the model is split over ranks, what is recomputed, and the
layout's divisibility rules. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.config.schema import Section, setting


MAX_DEVICE_MEMORY_GB = 1e6
"""Memory of one accelerator, at most (a petabyte: beyond it a figure is a typo)."""


@dataclass(frozen=True)
class ParallelConfig(Section):
    """How the model is split over ranks, and what is recomputed to save memory."""

    section_name = "parallel"

    tensor_model_parallel_size: int = setting(1, flag="--tensor-model-parallel-size",
                                              help="TP: ranks that split each layer's matrices")
    pipeline_model_parallel_size: int = setting(1, flag="--pipeline-model-parallel-size",
                                                help="PP: pipeline stages")
    expert_model_parallel_size: int = setting(1, flag="--expert-model-parallel-size",
                                              help="EP: ranks that split the routed experts")
    use_distributed_optimizer: bool = setting(
        False, flag="--use-distributed-optimizer",
        help="shard optimizer state over data-parallel ranks (Megatron's distributed optimizer)")
    distributed_timeout_minutes: int = setting(
        30, flag="--distributed-timeout-minutes",
        help="timeout of the process group and every parallel group")
    recompute_granularity: Optional[Literal["selective", "full"]] = setting(
        None, flag="--recompute-granularity", help="activation recomputation (default: none)")
    recompute_modules: Optional[list[str]] = setting(
        None, flag="--recompute-modules",
        help="with selective recomputation: which modules, e.g. moe core_attn")
    memory_check: Literal["refuse", "warn", "off"] = setting(
        "refuse", flag="--memory-check",
        help="before starting, price this layout with the memory planner (megatron_slmoe.plan) "
             "and refuse (or warn about) one predicted not to fit")
    device_memory_gb: Optional[float] = setting(
        None, flag="--device-memory-gb",
        help="memory of one accelerator for the memory check (default: the device's own; "
             "without an accelerator the check needs this)")

    def validate(self) -> None:
        self.check_positive("tensor_model_parallel_size", "pipeline_model_parallel_size",
                            "expert_model_parallel_size", "distributed_timeout_minutes",
                            "device_memory_gb")
        self.check(self.device_memory_gb is None or self.device_memory_gb <= MAX_DEVICE_MEMORY_GB,
                   "device_memory_gb", f"must be at most {MAX_DEVICE_MEMORY_GB:g} GiB, got "
                                       f"{self.device_memory_gb}")
        if self.recompute_modules and self.recompute_granularity != "selective":
            raise ConfigError("--recompute-modules needs --recompute-granularity selective")
