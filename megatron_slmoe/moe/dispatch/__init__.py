"""Token dispatchers of the Stable Latent MoE layer (the contract: ``base.TokenDispatcher``).

``DISPATCHERS`` is the one registry of dispatcher names: the model YAML's ``slmoe.dispatcher``,
the ``--moe-token-dispatcher-type`` flag and the layer all read it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable

from megatron_slmoe.moe.config import SLMoEConfig
from megatron_slmoe.moe.dispatch.allgather import AllGatherDispatcher
from megatron_slmoe.moe.dispatch.alltoall import AllToAllDispatcher
from megatron_slmoe.moe.dispatch.base import Dispatched, TokenDispatcher


def _allgather(slmoe: SLMoEConfig, num_experts: int, local_expert_indices: list[int],
               ep_group) -> TokenDispatcher:
    return AllGatherDispatcher(num_experts, local_expert_indices, ep_group, slmoe.node_size)


def _alltoall(slmoe: SLMoEConfig, num_experts: int, local_expert_indices: list[int],
              ep_group) -> TokenDispatcher:
    timeout = (timedelta(minutes=slmoe.distributed_timeout_minutes)
               if slmoe.distributed_timeout_minutes else None)
    return AllToAllDispatcher(num_experts, local_expert_indices, ep_group,
                              hierarchical=slmoe.hierarchical_alltoall,
                              node_size=slmoe.node_size, timeout=timeout)


DISPATCHERS: dict[str, Callable[..., TokenDispatcher]] = {
    "allgather": _allgather,
    "alltoall": _alltoall,
}
"""Name -> factory(slmoe_config, num_experts, local_expert_indices, ep_group)."""

__all__ = ["AllGatherDispatcher", "AllToAllDispatcher", "DISPATCHERS", "Dispatched",
           "TokenDispatcher"]
