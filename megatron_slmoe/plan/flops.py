"""Model FLOPs of one training token, for MFU (model FLOPs utilisation), as Megatron-LM counts them.

Two FLOPs per multiply-add. Forward: every matrix a token passes (attention projections, causal
attention's QK^T and PV over half the square, router, latent projections, its top-k routed
experts, the shared expert, dense MLPs, the output layer). Backward: a trained weight costs two
forwards more (input and weight gradients: 3x in all, Megatron's factor), a frozen one one more
(input gradient only: 2x), core attention 2x its forward (3x in all), LoRA adapters 3x their
forward. Recomputation is not counted (that would be hardware FLOPs, not model FLOPs). MFU is the
model FLOPs a step achieves per second over the peak matrix rate of the devices that ran it.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_slmoe.plan.memory import KDA_CHUNK, lora_layer_params
from megatron_slmoe.plan.model_shape import (
    ModelShape,
    expert_parameters,
    layer_parameters,
    output_parameters,
)
from megatron_slmoe.plan.settings import RunSettings


@dataclass(frozen=True)
class TokenFlops:
    """Forward FLOPs of one token by kind; ``training`` is the whole step's count."""

    matrices: float      # weight matrices the token passes (frozen in LoRA)
    core_attention: float
    lora: float          # adapters (their forward)
    full_finetune: bool

    @property
    def training(self) -> float:
        if self.full_finetune:
            return 3 * (self.matrices + self.core_attention)
        return 2 * self.matrices + 3 * self.core_attention + 3 * self.lora


def core_attention_flops(shape: ModelShape, kda: bool, seq_length: int) -> float:
    """Forward FLOPs of one token's attention core (no parallelism). Softmax attention: QK^T and
    PV over half the sequence (causal). KDA in chunks of C = 64: within its chunk a token's
    scores and outputs (2 C K per head), across chunks the state's decay, read and delta update
    (3 K V per head), each a multiply and an add."""
    if kda:
        k = shape.kda
        return 2 * k.heads * k.head_dim * (2 * KDA_CHUNK + 3 * k.head_dim)
    return 2 * 2 * shape.attention_width * seq_length / 2


def token_flops(shape: ModelShape, seq_length: int, lora_rank: int = 0,
                lora_targets: tuple = (), full_finetune: bool = False) -> TokenFlops:
    """The FLOPs of one token of a sequence of ``seq_length`` (no parallelism: whole model)."""
    settings = RunSettings(tp=1, pp=1, ep=1, dp=1, lora_rank=max(lora_rank, 1),
                           lora_targets=tuple(lora_targets), seq_length=seq_length)
    matrices = core = lora = 0.0
    for moe, kda in shape.layer_kinds:
        counts = layer_parameters(shape, moe, kda)
        matrices += 2 * (counts["attention"] + counts.get("dense_mlp", 0)
                         + counts.get("shared_experts", 0) + counts.get("router", 0)
                         + counts.get("latent", 0))
        if moe:
            matrices += 2 * shape.topk * expert_parameters(shape)
        core += core_attention_flops(shape, kda, seq_length)
        if lora_rank and not full_finetune:
            dense, experts = lora_layer_params(shape, settings, moe, kda)
            lora += 2 * (dense + (experts * shape.topk / shape.experts if moe else 0))
    matrices += 2 * (output_parameters(shape) or shape.vocab * shape.hidden)
    return TokenFlops(matrices, core, lora, full_finetune)
