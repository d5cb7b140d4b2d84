"""The run settings the planner prices: one parallel layout plus what changes memory and time.

``RunSettings`` mirrors the fine-tuning job's flags (named in each field's docstring) so that the
training entry point can describe its own run (``training.inputs.run_settings``) and the planner can
enumerate others. Its defaults are the planner's, stated here once (``PlanOptions`` and
``slmoe-plan`` take them). ``validate()`` checks the values; ``layout_error(shape)`` checks that
the layout divides the model the way Megatron-Core requires. Both name the flag in one line.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional, Union

from megatron_slmoe.lora.config import DEFAULT_LORA_TARGETS, LoRAConfig
from megatron_slmoe.parallel.layout import batch_split_problem
from megatron_slmoe.plan._sources import LORA_TARGETS
from megatron_slmoe.plan.adapter_state import EXPERT_LAYOUTS
from megatron_slmoe.plan.model_shape import ModelShape
from megatron_slmoe.plan.vision import ReplicatedTower, VisionShape

RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe")
"""Selective recomputation the model honours: Megatron's core attention and dense MLP, and the
whole Stable Latent MoE layer (``megatron_slmoe.moe.layer``)."""
DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class RunSettings:
    tp: int = 1
    """--tensor-model-parallel-size (sequence parallelism is on whenever tp > 1)."""
    pp: int = 1
    """--pipeline-model-parallel-size (1F1B schedule)."""
    ep: int = 1
    """--expert-model-parallel-size (expert tensor parallelism is 1)."""
    dp: int = 1
    """Data-parallel size: world size / (tp * pp)."""
    distributed_optimizer: bool = False
    """--use-distributed-optimizer: main parameters and Adam state sharded over data parallelism."""
    sharding: str = "none"
    """ZeRO-style sharding over data parallelism beyond the optimizer, as Megatron-Core's FSDP
    names it: ``optim_grads`` (ZeRO-2: gradient buffers too), ``optim_grads_params`` (ZeRO-3:
    the weights too, frozen base included, each layer's gathered for its forward and backward).
    ``optim`` is the distributed optimizer (ZeRO-1). Planned only: Megatron-Core's FSDP needs
    CUDA, so no CPU run measures it."""
    recompute: str = "none"
    """--recompute-granularity: none, selective or full (uniform, one layer per checkpoint)."""
    recompute_modules: tuple[str, ...] = ("core_attn",)
    """--recompute-modules with selective recomputation (Megatron's default: core_attn)."""
    micro_batch_size: int = 1
    """--micro-batch-size."""
    seq_length: int = 4096
    """--seq-length (the planner's default: a flagship run's, not the fine-tune's demo 128)."""
    global_batch_size: int = 512
    """--global-batch-size (a multiple of micro-batch size x dp; the planner's default, not the
    fine-tune's demo 16)."""
    dtype: str = "bf16"
    """bf16 (--bf16), fp16 or fp32 (--fp32): the dtype of weights and activations."""
    lora_rank: int = LoRAConfig.rank
    """--lora-rank."""
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    """--lora-target-modules."""
    expert_lora_rank: int = 0
    """--expert-lora-rank (0: --lora-rank, or --lora-rank // top-k with ``moe_rank_scaling``)."""
    moe_rank_scaling: bool = False
    """--moe-rank-scaling."""
    expert_lora_layout: str = "per-expert"
    """--expert-lora-layout: per-expert or shared-outer (``plan.adapter_state`` counts both)."""
    moe_imbalance: float = 1.25
    """Tokens received by the busiest expert-parallel rank over the mean (the routing monitor's
    per-rank load); capped by the model's capacity factor when it has one."""
    hierarchical_alltoall: bool = False
    """--moe-hierarchical-alltoall: inter-node hop once per destination node, then intra-node."""
    devices_per_node: int = 8
    """Ranks per node (LOCAL_WORLD_SIZE): which exchanges cross nodes."""
    vision: Optional[Union[VisionShape, ReplicatedTower]] = None
    """The vision tower and projector on the first stage: LLaVAModel's (--task image-text), or a
    Hugging Face checkpoint's own (any task); None: none."""
    expert_weights: Optional[str] = None
    """--expert-weights packed or dequantize, for a checkpoint whose experts are packed
    (``ModelShape.packed_expert_bytes``); None: as the model holds them."""

    def expert_rank(self, shape: ModelShape) -> int:
        """The routed experts' LoRA rank (the run's rule: ``LoRAConfig.expert_rank_for``); a
        rank scaling that gives no whole rank is one ValueError line."""
        return _expert_rank(self.lora_rank, self.expert_lora_rank, self.moe_rank_scaling,
                            shape.topk)

    def experts_packed(self, shape: ModelShape) -> bool:
        """Whether the routed experts are priced at their packed bytes."""
        if shape.packed_expert_bytes is None:
            return False
        return shape.experts_packed if self.expert_weights is None else (
            self.expert_weights == "packed")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the expert parameters: the stage's tp * dp ranks over ep."""
        return self.tp * self.dp // self.ep

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def element_size(self) -> int:
        return DTYPES[self.dtype]

    @property
    def zero_stage(self) -> int:
        """0 none, 1 optimizer state, 2 + gradients, 3 + weights (sharded over data parallelism)."""
        return {"optim_grads": 2, "optim_grads_params": 3}.get(
            self.sharding, 1 if self.distributed_optimizer or self.sharding == "optim" else 0)

    def recomputes(self, module: str) -> bool:
        return self.recompute == "selective" and module in self.recompute_modules

    @property
    def recompute_label(self) -> str:
        if self.recompute == "selective":
            return "sel:" + "+".join(self.recompute_modules)
        return self.recompute

    def replace(self, **changes) -> "RunSettings":
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        """One ValueError line naming the first bad flag."""
        for name, flag in (("tp", "--tensor-model-parallel-size"),
                           ("pp", "--pipeline-model-parallel-size"),
                           ("ep", "--expert-model-parallel-size"), ("dp", "data-parallel size"),
                           ("micro_batch_size", "--micro-batch-size"),
                           ("seq_length", "--seq-length"),
                           ("global_batch_size", "--global-batch-size"),
                           ("lora_rank", "--lora-rank"), ("devices_per_node", "--devices-per-node")):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
        if not isinstance(self.expert_lora_rank, int) or self.expert_lora_rank < 0:
            raise ValueError(f"--expert-lora-rank must be an integer >= 0, got "
                             f"{self.expert_lora_rank!r}")
        if self.expert_lora_layout not in EXPERT_LAYOUTS:
            raise ValueError(f"--expert-lora-layout must be one of {', '.join(EXPERT_LAYOUTS)}, "
                             f"got {self.expert_lora_layout!r}")
        if self.expert_weights not in (None, "packed", "dequantize"):
            raise ValueError(f"--expert-weights must be packed or dequantize, got "
                             f"{self.expert_weights!r}")
        if self.recompute not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"--recompute-granularity must be one of "
                             f"{', '.join(RECOMPUTE_GRANULARITIES)}, got {self.recompute!r}")
        unknown = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
        if unknown:
            raise ValueError(f"--recompute-modules: {unknown[0]!r} is not modelled; the planner "
                             f"knows {', '.join(RECOMPUTE_MODULES)}")
        if self.recompute == "selective" and not self.recompute_modules:
            raise ValueError("--recompute-modules must name a module with selective recomputation")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
        if unknown or not self.lora_targets:
            raise ValueError(f"--lora-target-modules: {unknown[0] if unknown else '(none)'!r} is "
                             f"not a target; the targets are {', '.join(LORA_TARGETS)}")
        if not self.moe_imbalance >= 1.0:
            raise ValueError(f"--moe-imbalance must be >= 1 (max over mean), "
                             f"got {self.moe_imbalance!r}")
        problem = batch_split_problem(self.global_batch_size, self.dp, self.micro_batch_size)
        if problem:
            raise ValueError(problem)

    def layout_error(self, shape: ModelShape) -> Optional[str]:
        """Why Megatron-Core cannot split ``shape`` this way (one line naming the flag), or None."""
        if shape.num_layers % self.pp:
            return (f"--pipeline-model-parallel-size {self.pp} does not divide the "
                    f"{shape.num_layers} layers")
        for what, count in (("attention heads", shape.heads),
                            ("query groups", shape.query_groups),
                            ("FFN width", shape.ffn_hidden), ("vocabulary", shape.vocab),
                            ("shared-expert FFN width", shape.shared_ffn or self.tp),
                            ("KDA heads", shape.kda.heads if shape.kda else self.tp)):
            if count % self.tp:
                return f"--tensor-model-parallel-size {self.tp} does not divide the {count} {what}"
        if isinstance(self.vision, VisionShape):  # a replicated tower is not split
            for what, count in (("vision attention heads", self.vision.heads),
                                ("vision FFN width", self.vision.ffn_hidden),
                                ("projector FFN width", self.vision.projector_ffn)):
                if count % self.tp:
                    return (f"--tensor-model-parallel-size {self.tp} does not divide the "
                            f"{count} {what}")
        if shape.experts:
            try:
                self.expert_rank(shape)
            except ValueError as err:
                return str(err)
        if shape.experts and shape.experts % self.ep:
            return (f"--expert-model-parallel-size {self.ep} does not divide the "
                    f"{shape.experts} experts")
        if (self.tp * self.dp) % self.ep:
            return (f"--expert-model-parallel-size {self.ep} must divide the {self.tp * self.dp} "
                    f"ranks of a pipeline stage (tp x dp)")
        if self.seq_length % self.tp:
            return (f"--seq-length {self.seq_length} is not a multiple of "
                    f"--tensor-model-parallel-size {self.tp} (sequence parallelism)")
        if self.seq_length > shape.max_sequence_length:
            return (f"--seq-length {self.seq_length} exceeds the model's "
                    f"max_sequence_length {shape.max_sequence_length}")
        return None

    def describe(self) -> str:
        """``tp8 pp8 ep64 dp8 distopt sel:moe mbs1``."""
        sharded = {2: "zero2", 3: "zero3"}.get(self.zero_stage)
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"ep{self.ep}", f"dp{self.dp}",
                 sharded or ("distopt" if self.distributed_optimizer else "opt"),
                 self.recompute_label, f"mbs{self.micro_batch_size}"]
        return " ".join(parts)


@functools.lru_cache(maxsize=256)
def _expert_rank(rank: int, expert_rank: int, moe_rank_scaling: bool, top_k: int) -> int:
    return LoRAConfig(rank=rank, expert_rank=expert_rank,
                      moe_rank_scaling=moe_rank_scaling).expert_rank_for(top_k)
