"""The Stable Latent MoE router: Megatron-Core's TopKRouter plus routing statistics and a
freezable aux-loss-free expert bias.

Everything about the routing itself (fp32 full-width logits, softmax or sigmoid scores, top-k with
normalisation and scaling, group-limited routing, switch / sequence / global aux losses, z-loss,
expert bias) is Megatron-Core's, so the numerics are the ones Megatron users know and its aux-loss
tracking logs them. What this class adds:

* every training forward records tokens per expert, routing entropy and logit scale into
  ``routing_stats`` for the routing monitor;
* ``expert_bias_frozen``: Megatron keeps updating the expert bias (in finalize_model_grads) even
  when the router weight is frozen for fine-tuning; a frozen bias stops counting tokens, so the
  update ``sign(mean - tokens) * rate`` is zero;
* capacity dropping by ``megatron_slmoe.moe.capacity`` (its "position" policy keeps the earliest
  tokens; Megatron's keeps arbitrary ones), applied after Megatron's routing and before the
  expert-bias token count, where Megatron applies its own;
* ``routing_hooks``: callables that see every routing decision (logits, probs, routing map) and
  may attach a loss to the probs the way Megatron attaches its aux losses; the routing-stability
  terms and probes of fine-tuning (``megatron_slmoe.moe.stability``) use them.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from megatron.core.transformer.moe.router import TopKRouter

from megatron_slmoe.moe.capacity import apply_capacity
from megatron_slmoe.moe.routing_stats import RoutingStatsAccumulator
from megatron_slmoe.compat.megatron import apply_expert_bias, defer_expert_bias


@defer_expert_bias  # to routing(), after capacity dropping
class SLMoERouter(TopKRouter):
    def __init__(self, config, pg_collection=None, freeze_weight: bool = False,
                 freeze_expert_bias: Optional[bool] = None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        # Megatron's routing runs without capacity; we drop tokens ourselves (see module doc).
        self.capacity_factor = config.moe_expert_capacity_factor
        self.config = copy.copy(config)
        self.config.moe_expert_capacity_factor = None
        self.routing_stats = RoutingStatsAccumulator(config.num_moe_experts)
        self.weight.requires_grad_(not freeze_weight)
        # The bias follows the router unless told otherwise.
        self.expert_bias_frozen = freeze_weight if freeze_expert_bias is None else freeze_expert_bias
        self.routing_hooks: list = []  # hook(router, logits_TE, probs, routing_map, valid_T) -> probs

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        probs, routing_map = super().routing(logits, padding_mask=padding_mask)
        if self.capacity_factor is not None:
            probs, routing_map = apply_capacity(
                probs, routing_map, self.topk, self.capacity_factor,
                self.config.moe_token_drop_policy, self.config.moe_pad_expert_input_to_capacity)
        if not self.expert_bias_frozen:
            flat_padding = None if padding_mask is None else padding_mask.reshape(-1)
            apply_expert_bias(self, routing_map, padding_mask=flat_padding)
        if self.routing_hooks:
            logits_TE = logits.reshape(-1, self.config.num_moe_experts)
            valid_T = None if padding_mask is None else ~padding_mask.reshape(-1).bool()
            for hook in self.routing_hooks:
                probs = hook(self, logits_TE, probs, routing_map, valid_T)
        # Count once per training forward: under activation recomputation the first forward runs
        # without grad and only the recomputation counts (Megatron's rule for the expert bias).
        if self.training and torch.is_grad_enabled():
            logits_TE = logits.reshape(-1, self.config.num_moe_experts)
            if self.score_function == "softmax":
                scores_TE = torch.softmax(logits_TE.float(), dim=-1)
            else:
                scores_TE = torch.sigmoid(logits_TE.float())
            valid = None if padding_mask is None else ~padding_mask.reshape(-1).bool()
            if valid is not None:
                logits_TE, scores_TE, routing_map_TE = logits_TE[valid], scores_TE[valid], routing_map[valid]
            else:
                routing_map_TE = routing_map
            self.routing_stats.record(logits_TE, scores_TE, routing_map_TE)
        return probs, routing_map
