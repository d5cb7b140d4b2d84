"""What a user would otherwise run (benchmark helper, not part of the package): Megatron-Core's own
MoELayer with its all-to-all dispatcher, and LoRA added to every expert the usual way.

* ``LoRAExpertLinear`` wraps one of Megatron's per-expert linears (ColumnParallelLinear /
  RowParallelLinear): the frozen base GEMM, then a separate shrink ``x A^T`` and expand ``B``, as
  PEFT-style LoRA does.
* ``LoRASequentialMLP``: Megatron's SequentialMLP (one MLP per local expert, one after another) with
  both projections of every expert wrapped.
* ``MaskLoopLoRAExperts``: the same experts run the way a typical tutorial writes an MoE: for every
  expert, a boolean mask over all rows, gather, expert, scatter.
* ``StagedMoELayer``: Megatron's MoELayer with the stage ranges of ``megatron_slmoe.moe.stages``
  around its own stages (route, dispatch pre/post-processing, experts, combine), and the latent
  projections. Megatron builds those only with TransformerEngine (``TELinear``, duplicated over
  TP); without TE the layer is built without a latent size and gets plain linears of the same role
  (``fc1_latent_proj``, ``fc2_latent_proj``) afterwards. Its own forward then runs unchanged.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_slmoe.moe.stages import COMBINE, DISPATCH, EXPERTS, LATENT, ROUTER, SHARED, stage


class LoRAExpertLinear(torch.nn.Module):
    """A frozen Megatron expert linear plus ``s * B(A(x))``, three GEMMs."""

    def __init__(self, base: torch.nn.Module, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        out_features, in_features = base.weight.shape
        self.lora_A = torch.nn.Parameter(torch.zeros(rank, in_features, dtype=base.weight.dtype))
        self.lora_B = torch.nn.Parameter(torch.zeros(out_features, rank, dtype=base.weight.dtype))
        self.scaling = alpha / rank
        for param in base.parameters():
            param.requires_grad_(False)
        for param in (self.lora_A, self.lora_B):
            param.allreduce = False  # expert parameters: Megatron's DDP reduces them over expert-DP

    def forward(self, x):
        y, bias = self.base(x)
        return y + self.scaling * F.linear(F.linear(x, self.lora_A), self.lora_B), bias


def _wrap_experts_with_lora(experts: SequentialMLP, rank: int, alpha: float) -> None:
    for expert in experts.local_experts:
        expert.linear_fc1 = LoRAExpertLinear(expert.linear_fc1, rank, alpha)
        expert.linear_fc2 = LoRAExpertLinear(expert.linear_fc2, rank, alpha)


class LoRASequentialMLP(SequentialMLP):
    """Megatron's SequentialMLP, every expert's fc1 and fc2 with its own LoRA."""

    def add_lora(self, rank: int, alpha: float) -> "LoRASequentialMLP":
        _wrap_experts_with_lora(self, rank, alpha)
        return self


class MaskLoopLoRAExperts(LoRASequentialMLP):
    """The same LoRA experts, computed with a per-expert boolean mask over all rows."""

    def forward(self, rows, tokens_per_expert, probs):
        expert_of_row = torch.repeat_interleave(
            torch.arange(self.num_local_experts, device=rows.device), tokens_per_expert.to(rows.device))
        out = None
        for e, expert in enumerate(self.local_experts):
            mask = expert_of_row == e
            if not mask.any():
                continue
            y, _ = expert(rows[mask], probs[mask])
            if out is None:
                out = rows.new_zeros(rows.shape[0], y.shape[-1])
            out[mask] = y
        if out is None:
            out = rows.new_zeros(rows.shape[0], rows.shape[-1])
        return out, None


class _DuplicatedLinear(torch.nn.Module):
    """The role of Megatron's TELinear(parallel_mode="duplicated") for the latent projections."""

    def __init__(self, in_features: int, out_features: int, dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))

    def forward(self, x):
        with stage(LATENT):
            return F.linear(x, self.weight), None


EXPERT_KINDS = {"sequential": LoRASequentialMLP, "mask_loop": MaskLoopLoRAExperts}


class StagedMoELayer(MoELayer):
    """Megatron's MoELayer with stage ranges, latent projections without TE, and LoRA experts of
    the kind given by ``expert_kind`` (``EXPERT_KINDS``)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None,
                 expert_kind: str = "sequential", lora_rank: int = 8, lora_alpha: float = 16.0):
        without_latent = copy.copy(config)
        without_latent.moe_latent_size = None
        super().__init__(without_latent, submodules, layer_number, pg_collection)
        self.config = config
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        # The experts again, now at the latent width (Megatron's MLP reads moe_latent_size).
        self.experts = EXPERT_KINDS[expert_kind](
            self.num_local_experts, config,
            MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            pg_collection=pg_collection).add_lora(lora_rank, lora_alpha)
        if config.moe_latent_size:
            self.fc1_latent_proj = _DuplicatedLinear(config.hidden_size, config.moe_latent_size,
                                                     config.params_dtype)
            self.fc2_latent_proj = _DuplicatedLinear(config.moe_latent_size, config.hidden_size,
                                                     config.params_dtype)

    def route(self, hidden_states, padding_mask=None):
        with stage(ROUTER):
            return super().route(hidden_states, padding_mask)

    def preprocess(self, hidden_states, probs, routing_map):
        with stage(DISPATCH):
            return super().preprocess(hidden_states, probs, routing_map)

    def dispatch(self, hidden_states, probs):
        with stage(DISPATCH):
            return super().dispatch(hidden_states, probs)

    def routed_experts_compute(self, hidden_states, probs):
        # MoELayer's own three steps, each in its stage.
        with stage(DISPATCH):
            rows, tokens_per_expert, permuted_probs = self.token_dispatcher.dispatch_postprocess(
                hidden_states, probs)
        with stage(EXPERTS):
            output, mlp_bias = self.experts(rows, tokens_per_expert, permuted_probs)
        with stage(COMBINE):
            return self.token_dispatcher.combine_preprocess(output), mlp_bias

    def combine(self, output):
        with stage(COMBINE):
            return super().combine(output)

    def postprocess(self, output, shared_expert_output):
        with stage(COMBINE):
            return super().postprocess(output, shared_expert_output)

    def shared_experts_compute(self, hidden_states):
        with stage(SHARED):
            return super().shared_experts_compute(hidden_states)
