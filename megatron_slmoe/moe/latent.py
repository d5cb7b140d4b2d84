"""Latent projections: hidden width d -> latent width l before dispatch, l -> d after combine,
and the optional RMSNorm of the combined latent output before the up-projection.

The weights are replicated on every tensor-parallel rank (Megatron's "duplicated" linear). With
sequence parallelism each TP rank projects its own slice of the sequence, so the weights are
marked ``sequence_parallel`` and Megatron's finalize_model_grads all-reduces their gradients over
the TP group, exactly as for the layer norms. TransformerEngine is not needed; where it is
installed Megatron's own TE linear could be swapped in through the layer spec.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class LatentProjection(MegatronModule):
    def __init__(self, config: TransformerConfig, in_features: int, out_features: int,
                 init_method) -> None:
        super().__init__(config=config)
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, dtype=config.params_dtype, device=device))
        self.bias = None
        if config.add_bias_linear:
            self.bias = torch.nn.Parameter(
                torch.zeros(out_features, dtype=config.params_dtype, device=device))
        if config.perform_initialization:
            # The default (data-parallel) RNG stream is the same on every TP rank, so the
            # replicas start identical.
            init_method(self.weight)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def build_latent_projections(config: TransformerConfig) -> tuple[LatentProjection, LatentProjection]:
    down = LatentProjection(config, config.hidden_size, config.moe_latent_size, config.init_method)
    up = LatentProjection(config, config.moe_latent_size, config.hidden_size,
                          config.output_layer_init_method)
    return down, up


class LatentNorm(MegatronModule):
    """RMSNorm of the combined routed output in the latent width: normalise in fp32, cast back,
    then multiply by the weight (Kimi K3's ``routed_expert_norm``). Replicated like the
    projections, its weight marked ``sequence_parallel`` for the same reason."""

    def __init__(self, config: TransformerConfig, width: int) -> None:
        super().__init__(config=config)
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(width, dtype=config.params_dtype,
                                                    device=device))
        self.eps = config.layernorm_epsilon
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)
