"""All-to-all bytes of an MoE layer, by the dispatcher's own accounting.

Expected split sizes go through the dispatcher's functions (``expected_rows_per_destination``:
a token goes once to each rank or node that holds one of its experts; ``flat_traffic_rows``,
``hierarchical_traffic_rows``): a row costs its width (the latent width) times its element size,
and what a rank keeps for itself is free. Routing is taken as balanced over experts (the memory
model adds the imbalance of the busiest rank; for time the mean matters). The expert-parallel group
is ``ep`` consecutive ranks (Megatron's order puts EP next to the innermost TP), so it spans
``ceil(ep / devices_per_node)`` nodes.
"""

from __future__ import annotations

from megatron_slmoe.plan._sources import (
    expected_rows_per_destination,
    flat_traffic_rows,
    hierarchical_traffic_rows,
)
from megatron_slmoe.plan.devices import DeviceSpec
from megatron_slmoe.plan.model_shape import ModelShape
from megatron_slmoe.plan.settings import RunSettings


def alltoall_bytes_per_layer(shape: ModelShape, s: RunSettings, tokens: int) -> tuple[float, float]:
    """(intra-node, inter-node) bytes one rank sends in one MoE layer's forward, dispatch and
    combine together, for ``tokens`` tokens routed on this rank."""
    if not shape.experts or s.ep == 1:
        return 0.0, 0.0
    row_bytes = shape.expert_width * s.element_size
    per_node = min(s.ep, s.devices_per_node)
    nodes = -(-s.ep // per_node)
    groups = (shape.router_groups or 0, shape.router_group_topk or 0)
    # A token goes once to every rank (flat) or node (hop A) that holds one of its experts.
    to_rank = tokens * expected_rows_per_destination(shape.experts, shape.topk, s.ep, *groups)
    if not s.hierarchical_alltoall or nodes == 1:
        node_of = [rank // per_node for rank in range(s.ep)]
        intra, inter = flat_traffic_rows([to_rank] * s.ep, node_of, 0)
    else:
        to_node = tokens * expected_rows_per_destination(shape.experts, shape.topk, nodes, *groups)
        # Hop B: the rows that reached this rank from every node's same-slot rank go on once to
        # each rank of this node holding one of their experts: per destination rank as many as
        # `nodes` senders of a flat exchange would send it.
        intra, inter = hierarchical_traffic_rows([to_node] * nodes, 0, [nodes * to_rank] * per_node, 0)
    return 2 * intra * row_bytes, 2 * inter * row_bytes


def link_seconds(intra_bytes: float, inter_bytes: float, s: RunSettings,
                 device: DeviceSpec) -> float:
    """Time to move the bytes over the node's links and the network, one after the other."""
    return intra_bytes / (device.intra_node_gbps * 1e9) + inter_bytes / (device.inter_node_gbps * 1e9)
