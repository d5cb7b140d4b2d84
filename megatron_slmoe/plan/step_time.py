"""Estimated time of one training step, to rank layouts (not to promise throughput).

Per micro-batch and pipeline stage: matrix FLOPs at the device's rate times its efficiency
(forward of the active parameters and attention; backward of frozen weights needs only input
gradients, so about one forward again, plus the LoRA weight gradients; recomputation adds its
forward), tensor-parallel all-gathers / reduce-scatters of the sequence-parallel activations,
and the MoE all-to-all (dispatch and combine, forward and backward) priced by
``megatron_slmoe.plan.traffic``. The 1F1B pipeline runs ``micro-batches + pp - 1`` slots of the
slowest stage (the bubble); the LoRA gradients are reduced over data parallelism once per step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megatron_slmoe.plan.devices import DeviceSpec
from megatron_slmoe.plan.flops import core_attention_flops
from megatron_slmoe.plan.memory import lora_layer_params
from megatron_slmoe.plan.model_shape import (
    ModelShape,
    expert_parameters,
    layer_parameters,
)
from megatron_slmoe.plan.settings import RunSettings
from megatron_slmoe.plan.traffic import alltoall_bytes_per_layer, link_seconds


@dataclass(frozen=True)
class StepTime:
    step_time_s: float
    tokens_per_s: float
    compute_s: float
    """Matrix work of the slowest stage over the step."""
    alltoall_s: float
    tensor_parallel_s: float
    bubble_s: float
    data_parallel_s: float
    alltoall_bytes_per_step: dict
    """Per rank, forward dispatch + combine as the dispatcher counts them: intra / inter node."""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@functools.lru_cache(maxsize=4096)
def _layer_flops(shape: ModelShape, s: RunSettings, moe: bool, kda: bool = False) -> float:
    """Forward FLOPs of one layer on one rank for one micro-batch."""
    tokens = s.seq_length * s.micro_batch_size
    counts = layer_parameters(shape, moe, kda)
    dense = counts["attention"] + counts.get("dense_mlp", 0) + counts.get("shared_experts", 0)
    flops = 2 * dense / s.tp * tokens
    flops += core_attention_flops(shape, kda, s.seq_length) / s.tp * tokens
    if moe:
        sharded = tokens / s.tp
        flops += 2 * (counts["router"] + counts["latent"]) * sharded
        routed_rows = sharded * shape.topk * (s.moe_imbalance if s.ep > 1 else 1.0)
        flops += 2 * expert_parameters(shape) * routed_rows
    return flops


def estimate_step_time(shape: ModelShape, s: RunSettings, device: DeviceSpec) -> StepTime:
    rate = device.bf16_tflops * 1e12 * device.efficiency * (0.25 if s.element_size == 4 else 1.0)
    tokens = s.seq_length * s.micro_batch_size
    b = s.element_size
    per_stage = shape.num_layers // s.pp
    stage_seconds = []
    a2a_stage = tp_stage = 0.0
    for stage in range(s.pp):
        layers = range(stage * per_stage, (stage + 1) * per_stage)
        forward = sum(_layer_flops(shape, s, *shape.layer_kinds[i]) for i in layers)
        lora = sum(sum(lora_layer_params(shape, s, *shape.layer_kinds[i])) for i in layers)
        if stage == s.pp - 1:
            forward += 2 * shape.vocab * shape.hidden / s.tp * tokens
        recompute = 0.0
        if s.recompute == "full":
            recompute = forward
        elif s.recompute == "selective":
            share = {"moe": 0.6, "mlp": 0.1, "core_attn": 0.1}  # rough shares of a layer's work
            recompute = forward * min(1.0, sum(share[m] for m in s.recompute_modules))
        # Backward: input gradients (one forward) plus LoRA weight gradients (small).
        flops = 2 * forward + recompute + 6 * lora * tokens / s.tp
        compute = flops / rate
        moe_layers = sum(shape.moe_layers[i] for i in layers)
        exchanges = 2 + (1 if s.recompute == "full" or s.recomputes("moe") else 0)  # fwd, bwd, again
        intra, inter = alltoall_bytes_per_layer(shape, s, tokens // s.tp)
        a2a = moe_layers * exchanges * link_seconds(intra, inter, s, device)
        # Sequence parallelism: all-gather + reduce-scatter around attention and the MLP,
        # forward and backward, each moving (tp - 1) / tp of the activations.
        tp_bytes = 0.0
        if s.tp > 1:
            tp_bytes = 8 * per_stage * tokens * shape.hidden * b * (s.tp - 1) / s.tp
        tp_link = device.intra_node_gbps if s.tp <= s.devices_per_node else device.inter_node_gbps
        tp_time = tp_bytes / (tp_link * 1e9)
        stage_seconds.append(compute + a2a + tp_time)
        a2a_stage, tp_stage = max(a2a_stage, a2a), max(tp_stage, tp_time)
    slot = max(stage_seconds)
    m = s.num_microbatches
    pipeline = slot * (m + s.pp - 1)
    bubble = slot * (s.pp - 1)
    # LoRA gradients: ring all-reduce (or reduce-scatter + all-gather) of fp32 buffers.
    trainable = sum(sum(lora_layer_params(shape, s, *kinds)) for kinds in shape.layer_kinds) / s.pp
    dp_link = device.inter_node_gbps if s.world_size > s.devices_per_node else device.intra_node_gbps
    dp_time = (2 * trainable * 4 * (s.dp - 1) / s.dp) / (dp_link * 1e9) if s.dp > 1 else 0.0
    step = pipeline + dp_time
    intra, inter = alltoall_bytes_per_layer(shape, s, tokens // s.tp)
    moe_per_stage = max(sum(shape.moe_layers[i * per_stage:(i + 1) * per_stage])
                        for i in range(s.pp))
    return StepTime(
        step_time_s=step,
        tokens_per_s=s.global_batch_size * s.seq_length / step,
        compute_s=max(stage_seconds) * m - a2a_stage * m - tp_stage * m,
        alltoall_s=a2a_stage * m,
        tensor_parallel_s=tp_stage * m,
        bubble_s=bubble,
        data_parallel_s=dp_time,
        alltoall_bytes_per_step={"intra_node": intra * m * moe_per_stage,
                                 "inter_node": inter * m * moe_per_stage},
    )
