"""What a Stable Latent MoE layer needs beyond Megatron-Core's TransformerConfig.

Routing, expert and latent sizes are TransformerConfig fields (``num_moe_experts``,
``moe_router_topk``, ``moe_latent_size``, ...); only the settings Megatron has no field for live
here, in one small dataclass that the layer spec carries.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.config.schema import Section, given_overrides, setting

DISPATCHER_NAMES = ("alltoall", "allgather")
"""The token dispatchers a run can choose (megatron_slmoe.moe.dispatch.DISPATCHERS builds them)."""

EXPERT_TENSOR_PARALLEL_SIZE = 1
"""The Stable Latent MoE layer keeps each expert whole: expert tensor parallelism is 1 (the
model checks and the layer refuse anything else; parallel state is initialised with it)."""


def check_expert_tensor_parallel(size: int) -> None:
    """The one place of the rule that experts stay whole."""
    if size != EXPERT_TENSOR_PARALLEL_SIZE:
        raise ConfigError(f"--expert-tensor-parallel-size {size} is not supported: the Stable "
                          f"Latent MoE layer keeps each expert whole (use "
                          f"{EXPERT_TENSOR_PARALLEL_SIZE})")


_SCALE_BYTES = {"uint8": 1, "bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class PackedExperts:
    """Routed-expert weights kept in the checkpoint's quantised format (``--expert-weights
    packed``): the format as ``ops.quantized_weights`` spells it, the inputs per scale, and the
    scales' dtype (torch's name: ``uint8`` E8M0 bytes for MXFP4, ``bfloat16`` for Kimi-K2.5's
    INT4, ``float32`` for block FP8), and the rows per scale (block FP8's block height)."""

    format: str
    group: int
    scale_dtype: str
    held: bool = True
    """False: the checkpoint stores them so but the run holds them dequantised (``--expert-weights
    dequantize``); kept so the planner can price the packed alternative."""
    block_rows: int = 1

    @property
    def bytes_per_weight(self) -> float:
        """Resident bytes per weight: the value (4 or 8 bits) and its share of a scale."""
        value = 1.0 if self.format == "block-fp8" else 0.5
        return value + _SCALE_BYTES[self.scale_dtype] / (self.group * self.block_rows)


@dataclass(frozen=True)
class SLMoEConfig:
    freeze_router: bool = False
    """Freeze the router weight (the usual choice when fine-tuning with LoRA)."""
    freeze_expert_bias: Optional[bool] = None
    """Stop the aux-loss-free expert-bias updates. None: frozen exactly when the router is."""
    dispatcher: str = "alltoall"
    """Token dispatcher: 'alltoall' (rows go only where their experts are) or 'allgather'."""
    hierarchical_alltoall: bool = False
    """Two-hop all-to-all for multi-node expert parallelism (inter-node, then intra-node)."""
    node_size: Optional[int] = None
    """Ranks per node for the hierarchical all-to-all; default: the launcher's LOCAL_WORLD_SIZE."""
    overlap_chunks: int = 1
    """With the all-to-all (flat or hierarchical): split the tokens into this many chunks and
    overlap each chunk's exchanges with another chunk's expert computation, in the forward and the
    backward. 1 = no overlap."""
    distributed_timeout_minutes: Optional[int] = None
    """Timeout of the process groups the dispatcher creates; default: torch's."""
    latent_norm: bool = False
    """RMSNorm (eps ``layernorm_epsilon``, a learned weight) of the combined routed-expert output
    in the latent width, before the up-projection (Kimi K3's ``routed_expert_norm``). Needs
    ``moe_latent_size``."""
    expert_weights: Optional[PackedExperts] = None
    """The routed experts' frozen weights held packed as the checkpoint stores them (buffers,
    decoded tile by tile in the expert op); None: dense parameters."""

    def __post_init__(self) -> None:
        if not isinstance(self.overlap_chunks, int) or self.overlap_chunks < 1:
            raise ValueError(f"slmoe.overlap_chunks must be an integer >= 1, "
                             f"got {self.overlap_chunks!r}")
        if self.node_size is not None and self.node_size < 1:
            raise ValueError(f"slmoe.node_size must be >= 1, got {self.node_size!r}")
        if self.distributed_timeout_minutes is not None and self.distributed_timeout_minutes <= 0:
            raise ValueError("slmoe.distributed_timeout_minutes must be positive, "
                             f"got {self.distributed_timeout_minutes!r}")


@dataclass(frozen=True)
class MoERunConfig(Section):
    """Run-time choices of the MoE layer. A setting that names the ``SLMoEConfig`` field it
    ``overrides`` replaces the model config's ``slmoe`` value when given (``over``)."""

    section_name = "moe"

    token_dispatcher_type: Optional[str] = setting(
        None, flag="--moe-token-dispatcher-type", overrides="dispatcher",
        help="alltoall or allgather (default: the model config's)")
    hierarchical_alltoall: bool = setting(
        False, flag="--moe-hierarchical-alltoall", overrides="hierarchical_alltoall",
        help="two-hop all-to-all for multi-node expert parallelism (inter-node, then intra-node)")
    node_size: Optional[int] = setting(
        None, flag="--moe-node-size", overrides="node_size",
        help="ranks per node for the hierarchical all-to-all (default: LOCAL_WORLD_SIZE)")
    overlap_chunks: Optional[int] = setting(
        None, flag="--moe-overlap-chunks", overrides="overlap_chunks",
        help="overlap the all-to-all (flat or hierarchical) with expert compute over this many "
             "token chunks, forward and backward (default: the model config's, 1 = no overlap)")
    routed_balance_coeff: float = setting(
        0.1, flag="--moe-routed-balance-coeff",
        help="with --finetune-mode lora: load-balancing loss on the routing actually used "
             "(frozen expert bias included), acting through the adapters before each router "
             "(0: off; see megatron_slmoe.moe.stability)")
    routing_kl_coeff: float = setting(
        0.0, flag="--moe-routing-kl-coeff",
        help="routing preservation with --finetune-mode lora: KL(base routing || routing) per "
             "token, the base routing from one more forward pass per step (0: off)")

    def validate(self) -> None:
        if (self.token_dispatcher_type is not None
                and self.token_dispatcher_type not in DISPATCHER_NAMES):
            self.fail("token_dispatcher_type", f"must be one of {', '.join(DISPATCHER_NAMES)}, "
                                               f"got {self.token_dispatcher_type!r}")
        self.check_positive("node_size", "overlap_chunks")
        self.check_non_negative("routed_balance_coeff", "routing_kl_coeff")

    def over(self, slmoe: SLMoEConfig) -> SLMoEConfig:
        """The model config's MoE settings with this run's given settings in place of the fields
        they declare they override."""
        return dataclasses.replace(slmoe, **given_overrides(self))


@dataclass(frozen=True)
class MonitorConfig(Section):
    """The routing monitor's collapse detectors (see megatron_slmoe.moe.monitor)."""

    section_name = "monitor"

    window: int = setting(50, flag="--moe-monitor-window",
                          help="steps over which an expert without tokens counts as dead")
    starved_fraction: float = setting(
        0.1, flag="--moe-starved-fraction",
        help="an expert starves below this fraction of the fair share 1/E")
    starved_patience: int = setting(
        20, flag="--moe-starved-patience",
        help="checks in a row of starving before a warning (one check per step once steps "
             "route --moe-monitor-min-tokens tokens)")
    dominant_fraction: float = setting(
        0.5, flag="--moe-dominant-fraction",
        help="an expert dominates above this share of a step's assignments (1.0: off)")
    warmup_steps: int = setting(
        10, flag="--moe-monitor-warmup",
        help="steps before the collapse detectors judge (routing that is still settling, e.g. "
             "from a random initialisation, is not a collapse)")
    min_routed_tokens: int = setting(
        1024, flag="--moe-monitor-min-tokens",
        help="a check judges the steps since the previous one once they routed at least this "
             "many tokens (small steps are pooled, so no share is judged on a handful of tokens)")
    action: Literal["warn", "stop"] = setting(
        "warn", flag="--collapse-action", help="on routing collapse: warn, or stop the run")
    jsonl_path: Optional[str] = setting(
        None, flag="--moe-routing-jsonl",
        help="also append every step's routing record (all layers, all fields) to this file")
    drift_interval: int = setting(
        10, flag="--moe-drift-interval",
        help="with --finetune-mode lora: every N steps, each layer's routing drift from the base "
             "model's on a fixed held-out probe batch (KL, top-k overlap, load change; 0: off)")

    def validate(self) -> None:
        self.check_positive("window", "starved_patience")
        self.check_non_negative("warmup_steps", "min_routed_tokens", "drift_interval")
        self.check(0.0 <= self.starved_fraction < 1.0, "starved_fraction",
                   f"must be in [0, 1), got {self.starved_fraction}")
        # > 1/E is checked when the monitor attaches to a model and E is known.
        self.check(0.0 < self.dominant_fraction <= 1.0, "dominant_fraction",
                   f"must be in (0, 1], got {self.dominant_fraction}")
        self.check(self.jsonl_path is None or bool(self.jsonl_path), "jsonl_path",
                   "must be a non-empty path")
