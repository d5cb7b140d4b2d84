"""All-to-all bytes of an MoE layer, by the dispatcher's own accounting.

Expected split sizes go through the dispatcher's functions (``flat_traffic_rows``,
``hierarchical_traffic_rows``): a row costs its width (the latent width) times its element size,
and what a rank keeps for itself is free. Routing is taken as balanced over experts (the memory
model adds the imbalance of the busiest rank; for time the mean matters). The expert-parallel group
is ``ep`` consecutive ranks (Megatron's order puts EP next to the innermost TP), so it spans
``ceil(ep / devices_per_node)`` nodes.
"""

from __future__ import annotations

from math import comb

from megatron_slmoe.plan._sources import flat_traffic_rows, hierarchical_traffic_rows
from megatron_slmoe.plan.devices import DeviceSpec
from megatron_slmoe.plan.model_shape import ModelShape
from megatron_slmoe.plan.settings import RunSettings


def _nodes_touched(shape: ModelShape, nodes: int) -> float:
    """Expected distinct nodes among a token's k experts (experts split evenly over nodes)."""
    groups, group_topk = shape.router_groups, shape.router_group_topk
    if groups and group_topk and groups % nodes == 0:
        # Group-limited routing: the k experts lie in group_topk of the groups, each node
        # holding groups / nodes whole groups.
        per_node = groups // nodes
        missed = comb(groups - per_node, group_topk) / comb(groups, group_topk)
    else:
        per_node = shape.experts // nodes
        missed = comb(shape.experts - per_node, shape.topk) / comb(shape.experts, shape.topk)
    return nodes * (1.0 - missed)


def alltoall_bytes_per_layer(shape: ModelShape, s: RunSettings, tokens: int) -> tuple[float, float]:
    """(intra-node, inter-node) bytes one rank sends in one MoE layer's forward, dispatch and
    combine together, for ``tokens`` tokens routed on this rank."""
    if not shape.experts or s.ep == 1:
        return 0.0, 0.0
    row_bytes = shape.expert_width * s.element_size
    per_node = min(s.ep, s.devices_per_node)
    nodes = -(-s.ep // per_node)
    rows = tokens * shape.topk
    if not s.hierarchical_alltoall or nodes == 1:
        node_of = [rank // per_node for rank in range(s.ep)]
        intra, inter = flat_traffic_rows([rows / s.ep] * s.ep, node_of, 0)
    else:
        touched = _nodes_touched(shape, nodes)
        # Hop A: each token once to every node that hosts one of its experts.
        arriving = tokens * touched  # rows this rank receives in hop A (symmetric)
        # Hop B: a row goes once to each rank of the node holding one of its experts there.
        experts_there = shape.topk / touched
        ranks = per_node * (1.0 - (1.0 - 1.0 / per_node) ** experts_there)
        intra, inter = hierarchical_traffic_rows([tokens * touched / nodes] * nodes, 0,
                                                 [arriving * ranks / per_node] * per_node, 0)
    return 2 * intra * row_bytes, 2 * inter * row_bytes


def link_seconds(intra_bytes: float, inter_bytes: float, s: RunSettings,
                 device: DeviceSpec) -> float:
    """Time to move the bytes over the node's links and the network, one after the other."""
    return intra_bytes / (device.intra_node_gbps * 1e9) + inter_bytes / (device.inter_node_gbps * 1e9)
