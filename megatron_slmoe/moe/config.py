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
    distributed_timeout_minutes: Optional[int] = None
    """Timeout of the process groups the dispatcher creates; default: torch's."""
