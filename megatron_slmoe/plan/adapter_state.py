"""What LoRA on the routed experts costs, by expert layout and rank (issue 42): the trainable
parameters and, per expert-parallel rank, the bytes of their weights, gradients and Adam state.

At trillion scale the expert adapter is a model of its own (Kimi K3: 82,432 routed experts), so
this prices the two layouts the field uses, per rank ``r`` (each projection W [out, in] of an
expert adapted by s * B A, A [r, in], B [out, r]; l the experts' width, f their FFN width):

* ``per-expert``: every expert its own A and B on fc1 (gate|up) and fc2 (down). As this project
  holds it, fc1 is one LoRA on the fused [2f, l] weight (one A for gate and up):
  r (l + 2f) + r (f + l) per expert. As PEFT / vLLM store it per expert module (``w1``, ``w3``,
  ``w2``, each its own A): 3 r (l + f) per expert (``separate_gate_up``; K3's 19,968 r);
* ``shared-outer`` (SGLang's ``experts_shared_outer_loras``, miles' K3 LoRA,
  ``megatron_slmoe.lora.experts``): shared by all experts of a layer, the gate's A [r, l] and the
  up's A [r, l] on the input side (SGLang/miles ``w1_lora_A``, ``w3_lora_A``; one A [r, l] not
  gated) and one B [l, r] on the down output side (``w2_lora_B``); per expert only the inner
  factors, the gate's and up's B [f, r] each and the down's A [r, f]: 3 f r per expert plus
  3 l r per layer (2 l r not gated). The shared factors are replicated over expert parallelism.

Bytes per trainable parameter: its own dtype, an fp32 gradient (Megatron DDP's buffers), Adam's
two fp32 moments and an fp32 main copy of a 16-bit parameter (as ``plan.memory`` prices LoRA).
Torch-free: it works on the model's shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_slmoe.plan.model_shape import ModelShape

EXPERT_LAYOUTS = ("per-expert", "shared-outer")
_FP32 = 4


@dataclass(frozen=True)
class ExpertDims:
    """The routed experts' sizes that their adapters depend on."""

    moe_layers: int
    experts: int
    """Routed experts per MoE layer."""
    width: int
    """l: the width the experts work in (the latent, or the hidden size)."""
    ffn: int
    """f: an expert's FFN width."""
    gated: bool = True

    @classmethod
    def of(cls, shape: ModelShape) -> "ExpertDims":
        return cls(shape.num_moe_layers, shape.experts, shape.expert_width, shape.expert_ffn,
                   shape.gated)


@dataclass(frozen=True)
class ExpertAdapterCount:
    """Trainable parameters of LoRA on every routed expert (fc1 and fc2) of a model."""

    layout: str
    rank: int
    per_expert: int
    """Of one expert's own factors."""
    shared_per_layer: int
    """Of the factors all experts of a layer share (shared-outer)."""
    dims: ExpertDims

    @property
    def total(self) -> int:
        d = self.dims
        return d.moe_layers * (d.experts * self.per_expert + self.shared_per_layer)

    def per_ep_rank(self, ep: int) -> int:
        """On one expert-parallel rank: its 1/ep of the experts, and every shared factor."""
        d = self.dims
        return d.moe_layers * (d.experts // ep * self.per_expert + self.shared_per_layer)


def expert_adapter_count(dims: ExpertDims, rank: int, layout: str,
                         separate_gate_up: bool = False, fc1: bool = True,
                         fc2: bool = True) -> ExpertAdapterCount:
    """The expert adapter of ``layout`` at ``rank`` (see the module doc for what is counted);
    ``separate_gate_up``: per-expert with gate and up each their own A (PEFT's per-expert
    modules); ``fc1`` / ``fc2``: whether gate|up / down are adapted (--lora-target-modules)."""
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert layout {layout!r} is not one of {', '.join(EXPERT_LAYOUTS)}")
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    r, l, f = rank, dims.width, dims.ffn
    fc1_out = 2 * f if dims.gated else f
    fc1_inputs = 2 if dims.gated else 1  # the gate's and the up's A (shared-outer, PEFT's)
    if layout == "shared-outer":
        return ExpertAdapterCount(layout, rank, fc1 * fc1_out * r + fc2 * r * f,
                                  fc1 * fc1_inputs * r * l + fc2 * l * r, dims)
    fc1_a = fc1_inputs * r * l if separate_gate_up else r * l
    per_expert = fc1 * (fc1_a + fc1_out * r) + fc2 * r * (f + l)
    return ExpertAdapterCount(layout, rank, per_expert, 0, dims)


def state_bytes_per_parameter(element_size: int) -> int:
    """Weight (its dtype) + fp32 gradient + Adam's two fp32 moments + an fp32 main copy of a
    16-bit weight."""
    return element_size + _FP32 + 2 * _FP32 + (_FP32 if element_size < _FP32 else 0)


def adapter_state_bytes(count: ExpertAdapterCount, ep: int = 1, element_size: int = 2) -> int:
    """Bytes of the expert adapter's weights, gradients and optimizer state on one
    expert-parallel rank (no distributed-optimizer sharding)."""
    return count.per_ep_rank(ep) * state_bytes_per_parameter(element_size)


def rank_table(dims: ExpertDims, ranks=(2, 4, 8, 16, 32), ep: int = 1,
               element_size: int = 2) -> list[dict]:
    """One row per (layout, rank): trainable parameters and state bytes per EP rank."""
    rows = []
    for layout in EXPERT_LAYOUTS:
        for rank in ranks:
            count = expert_adapter_count(dims, rank, layout)
            rows.append({"layout": layout, "rank": rank, "trainable_params": count.total,
                         "params_per_ep_rank": count.per_ep_rank(ep),
                         "state_bytes_per_ep_rank": adapter_state_bytes(count, ep, element_size)})
    return rows
