"""Token dispatchers of the Stable Latent MoE layer (the contract: ``base.TokenDispatcher``).

``DISPATCHERS`` is the one registry of dispatcher names: the model YAML's ``slmoe.dispatcher``,
the ``--moe-token-dispatcher-type`` flag and the layer all read it. The factories import their
dispatcher when called, so that reading the names, or the byte rules in ``traffic`` (the layout
planner), loads no collective code.

Modules: ``base`` (the contract), ``allgather``, ``alltoall`` (the all-to-all dispatcher) with
``exchange`` (its collectives), ``hops`` (hop planning, flat and hierarchical), ``groups`` (the
hierarchical mode's process groups) and ``overlap`` (the chunked pipeline and its backward);
``traffic`` (bytes within and between nodes).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable

from megatron_slmoe.moe.config import SLMoEConfig
from megatron_slmoe.moe.dispatch.base import TokenDispatcher


def _allgather(slmoe: SLMoEConfig, num_experts: int, local_expert_indices: list[int],
               ep_group) -> TokenDispatcher:
    from megatron_slmoe.moe.dispatch.allgather import AllGatherDispatcher

    return AllGatherDispatcher(num_experts, local_expert_indices, ep_group, slmoe.node_size)


def _alltoall(slmoe: SLMoEConfig, num_experts: int, local_expert_indices: list[int],
              ep_group) -> TokenDispatcher:
    from megatron_slmoe.moe.dispatch.alltoall import AllToAllDispatcher

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

__all__ = ["DISPATCHERS"]
