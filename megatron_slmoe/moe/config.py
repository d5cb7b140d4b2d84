"""What a Stable Latent MoE layer needs beyond Megatron-Core's TransformerConfig.

Routing, expert and latent sizes are TransformerConfig fields (``num_moe_experts``,
``moe_router_topk``, ``moe_latent_size``, ...); only the settings Megatron has no field for live
here, in one small dataclass that the layer spec carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


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

    def __post_init__(self) -> None:
        if not isinstance(self.overlap_chunks, int) or self.overlap_chunks < 1:
            raise ValueError(f"slmoe.overlap_chunks must be an integer >= 1, "
                             f"got {self.overlap_chunks!r}")
        if self.node_size is not None and self.node_size < 1:
            raise ValueError(f"slmoe.node_size must be >= 1, got {self.node_size!r}")
        if self.distributed_timeout_minutes is not None and self.distributed_timeout_minutes <= 0:
            raise ValueError("slmoe.distributed_timeout_minutes must be positive, "
                             f"got {self.distributed_timeout_minutes!r}")
