"""All-gather dispatcher: every expert-parallel rank gathers all tokens of its group.

Implements ``megatron_slmoe.moe.dispatch.base.TokenDispatcher``.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from megatron_slmoe.parallel.topology import NodeLayout, node_size_from_env
from megatron_slmoe.moe.dispatch.base import Dispatched, TokenDispatcher
from megatron_slmoe.moe.dispatch.traffic import TrafficAccumulator


class AllGatherDispatcher(TokenDispatcher):
    """Every expert-parallel rank gathers all tokens of its EP group, computes the rows routed to
    its local experts, and the partial outputs are reduce-scattered back to the token owners.
    Simple and robust; it moves every token to every EP rank, so it suits small EP sizes (the
    all-to-all dispatcher moves only routed rows)."""

    def __init__(self, num_experts: int, local_expert_indices: list[int], ep_group,
                 node_size: int | None = None) -> None:
        self.num_experts = num_experts
        self.first_local = local_expert_indices[0]
        self.num_local = len(local_expert_indices)
        self.ep_group = ep_group
        self.ep_size = ep_group.size() if ep_group is not None else 1
        self.traffic = TrafficAccumulator()
        # Peers on this node and on other nodes, for the byte accounting.
        ep_ranks = (torch.distributed.get_process_group_ranks(ep_group)
                    if ep_group is not None and torch.distributed.is_initialized() else [0])
        layout = NodeLayout.from_ranks(ep_ranks, node_size_from_env(node_size))
        self._peers_intra, self._peers_inter = layout.peers(
            ep_group.rank() if ep_group is not None else 0)

    def dispatch(self, x_TL: torch.Tensor, probs_TE: torch.Tensor,
                 routing_map_TE: torch.Tensor) -> Dispatched:
        if self.ep_size > 1:
            x_TL = gather_from_sequence_parallel_region(x_TL, group=self.ep_group)
            probs_TE = gather_from_sequence_parallel_region(probs_TE, group=self.ep_group)
            routing_map_TE = gather_from_sequence_parallel_region(
                routing_map_TE.to(torch.uint8), group=self.ep_group).bool()
        local = slice(self.first_local, self.first_local + self.num_local)
        # Expert-major order: nonzero() of the transposed map is sorted by (expert, token).
        expert_R, token_R = routing_map_TE[:, local].t().nonzero(as_tuple=True)
        tokens_per_expert_E = torch.bincount(expert_R, minlength=self.num_local).cpu()
        probs_R = probs_TE[:, local][token_R, expert_R]
        # The gather sent our own rows to every peer; combine sends each peer its partial sums.
        row_bytes = x_TL.shape[-1] * x_TL.element_size()
        local_rows = x_TL.shape[0] // self.ep_size
        self.traffic.add(intra=2 * local_rows * self._peers_intra * row_bytes,
                         inter=2 * local_rows * self._peers_inter * row_bytes)
        return Dispatched(x_TL.index_select(0, token_R), tokens_per_expert_E, probs_R,
                          plan=(token_R, x_TL.shape[0]))

    def combine(self, out_RL: torch.Tensor, plan) -> torch.Tensor:
        token_R, num_tokens = plan
        y_TL = torch.zeros(num_tokens, out_RL.shape[-1], dtype=out_RL.dtype, device=out_RL.device)
        y_TL = y_TL.index_add(0, token_R, out_RL)
        if self.ep_size > 1:
            y_TL = reduce_scatter_to_sequence_parallel_region(y_TL, group=self.ep_group)
        return y_TL
