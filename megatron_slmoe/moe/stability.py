"""Routing stability while fine-tuning a frozen router: how far routing drifts from the base
model's, and two losses that hold it where it should be.

With LoRA the router weight and its expert bias are frozen, yet routing still moves: the adapters
change the hidden states the router sees, and experts can starve. Three things live here, all on
the routers' ``routing_hooks`` (``megatron_slmoe.moe.router``):

**Routed load balancing** (``balance_coeff``). Megatron's aux losses still act when the router is
frozen (their gradient reaches the hidden states and through them the adapters before the
router), but they balance the top-k of the scores *without* the expert bias, while tokens go to
the top-k *with* it. A model pretrained with an aux-loss-free expert bias is balanced by the bias,
so its bias-free top-k is skewed on purpose, and balancing it unbalances the real routing. This
loss is Megatron's switch loss (``switch_load_balancing_loss_func``) fed the routing actually
used: ``E * sum_e f_e * P_e``, ``f_e`` the fraction of the tokens' expert slots that went to
expert e (expert bias and capacity included, counted over the tensor/context-parallel group like
Megatron's), ``P_e`` the mean normalised score of expert e (the gradient path). Attached and
logged like Megatron's aux losses (``routed_load_balancing_loss``).

**Routing preservation** (``kl_coeff``): the KL divergence of each token's routing from the
base model's routing of the same token, averaged over the tokens of the global micro-batch. The
KL is taken under the router's own probability model (``routing_kl``): a categorical
distribution over the experts for a softmax router; for a sigmoid router, whose experts are
gated independently, the sum over experts of the KL of the gates' Bernoulli distributions (the
scores normalised to sum to one are nearly flat, and their KL hardly sees a change of the
top-k). The base routing comes from a forward pass of the same micro-batches with the adapters
disabled, run before each step (``reference_pass``: one more forward, without gradients); each
router keeps those distributions in arrival order and the training forward takes them in the same
order (under activation recomputation only the forward with gradients does). Logged as
``routing_kl_loss``.

**Drift** (``measure_drift``): on a fixed probe batch, each layer's routing against the base
model's on the same batch (measured once, with the adapters disabled):
``kl`` (mean per-token ``routing_kl``), ``topk_overlap`` (mean fraction of a token's experts
that the base chose too; 1.0 = unchanged) and ``load_change`` (total variation between the base's
and the current share of expert slots per expert; 0 = the same load, 1 = disjoint).
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterable, Iterator, Optional

import torch
from megatron.core.transformer.moe.moe_utils import (
    get_tokens_per_expert_and_token_count,
    switch_load_balancing_loss_func,
)

from megatron_slmoe.moe.router import SLMoERouter

DRIFT_FIELDS = ("drift_kl", "drift_topk_overlap", "drift_load_change")
"""The routing monitor's per-layer record names of the drift metrics."""


def routing_scores(router: SLMoERouter, logits_TE: torch.Tensor) -> torch.Tensor:
    """The router's probabilities (fp32 [T, E]): softmax over experts, or each expert's sigmoid
    gate."""
    if router.score_function == "softmax":
        return torch.softmax(logits_TE.float(), dim=-1)
    return torch.sigmoid(logits_TE.float())


def balance_scores(router: SLMoERouter, logits_TE: torch.Tensor) -> torch.Tensor:
    """The per-token distribution Megatron's aux losses balance: the softmax, or the sigmoid
    scores normalised per token."""
    scores_TE = routing_scores(router, logits_TE)
    if router.score_function == "softmax":
        return scores_TE
    return scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)


def routing_kl(score_function: str, base_TE: torch.Tensor, scores_TE: torch.Tensor) -> torch.Tensor:
    """KL(base || now) per token [T] of ``routing_scores``: categorical for softmax, the sum of
    the experts' Bernoulli KLs for sigmoid (0 log 0 = 0)."""
    def plogq_ratio(p, q):
        return p * (p.clamp_min(1e-30).log() - q.clamp_min(1e-30).log())

    if score_function == "softmax":
        return plogq_ratio(base_TE, scores_TE).sum(dim=-1)
    return (plogq_ratio(base_TE, scores_TE) + plogq_ratio(1 - base_TE, 1 - scores_TE)).sum(dim=-1)


@dataclass
class _Track:
    router: SLMoERouter
    base_queue: deque = field(default_factory=deque)  # base scores of this step's micro-batches
    probe: list = field(default_factory=list)  # (scores_TE, routed_TE) of the current probe pass
    probe_base: Optional[list] = None


class RoutingStability:
    """The routing-stability losses and the drift probe on every Stable Latent MoE router of
    ``model_chunks`` (hooked in on construction).

    ``base_model``: a context-manager factory under which the chunks compute the base model
    (the adapters disabled); needed for ``kl_coeff > 0`` and for drift.
    """

    def __init__(self, model_chunks: Iterable[torch.nn.Module], balance_coeff: float = 0.0,
                 kl_coeff: float = 0.0,
                 base_model: Optional[Callable[[], ContextManager]] = None) -> None:
        if kl_coeff > 0 and base_model is None:
            raise ValueError("routing preservation (kl_coeff > 0) needs the base model")
        self.balance_coeff = float(balance_coeff)
        self.kl_coeff = float(kl_coeff)
        self.base_model = base_model
        self._mode = "train"
        self._chunks = list(model_chunks)
        routers = {id(m): m for chunk in self._chunks for m in chunk.modules()
                   if isinstance(m, SLMoERouter)}
        self._device = next((p.device for c in self._chunks for p in c.parameters()),
                            torch.device("cpu"))
        self._tracks = sorted((_Track(r) for r in routers.values()),
                              key=lambda t: t.router.layer_number)
        for track in self._tracks:
            track.router.routing_hooks.append(self._hook_for(track))

    # -- the steps ------------------------------------------------------------------------------

    def reference_pass(self, forward_only: Callable[[], object]) -> None:
        """Before a training step with routing preservation: ``forward_only()`` runs the step's
        micro-batches forward (eval mode, no gradients) and the routers keep the base model's
        routing."""
        if self.kl_coeff <= 0:
            return
        for track in self._tracks:
            track.base_queue.clear()
        with self._in_mode("record_base"), self.base_model(), self._eval():
            forward_only()

    def measure_drift(self, forward_only: Callable[[], object],
                      group: Optional[torch.distributed.ProcessGroup]) -> dict[int, dict]:
        """Drift of every layer's routing from the base model's on the probe batch that
        ``forward_only()`` runs, reduced over ``group`` (the ranks that hold the same layers).
        The first call also measures the base. Collective over ``group``."""
        if self.base_model is None:
            raise ValueError("routing drift needs the base model")
        if any(t.probe_base is None for t in self._tracks):
            with self.base_model():
                self._probe(forward_only)
            for track in self._tracks:
                track.probe_base, track.probe = track.probe, []
        self._probe(forward_only)
        sums = [self._drift_sums(t) for t in self._tracks]
        for track in self._tracks:
            track.probe = []
        if not sums:
            return {}
        flat = torch.cat(sums)
        if group is not None:
            flat = flat.to(self._device)
            torch.distributed.all_reduce(flat, group=group)
        result = {}
        for track, layer_sums in zip(self._tracks, flat.cpu().split([len(s) for s in sums])):
            result[track.router.layer_number] = _drift_metrics(layer_sums, track.router.topk)
        return result

    # -- internals ------------------------------------------------------------------------------

    @contextmanager
    def _in_mode(self, mode: str) -> Iterator[None]:
        previous, self._mode = self._mode, mode
        try:
            yield
        finally:
            self._mode = previous

    @contextmanager
    def _eval(self) -> Iterator[None]:
        """Eval mode (no dropout: the base routing is a fixed target) and no gradients."""
        training = [chunk.training for chunk in self._chunks]
        for chunk in self._chunks:
            chunk.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            for chunk, was_training in zip(self._chunks, training):
                chunk.train(was_training)

    def _probe(self, forward_only: Callable[[], object]) -> None:
        """Run the probe batch; the routers record it."""
        with self._in_mode("probe"), self._eval():
            forward_only()

    def _drift_sums(self, track: _Track) -> torch.Tensor:
        """[kl sum, overlap sum, tokens, base slots per expert (E), current slots per expert (E)]"""
        num_experts = track.router.config.num_moe_experts
        sums = torch.zeros(3 + 2 * num_experts, dtype=torch.float64)
        if len(track.probe) != len(track.probe_base):
            raise RuntimeError(f"layer {track.router.layer_number}: the probe saw "
                               f"{len(track.probe)} micro-batches, its base {len(track.probe_base)}")
        for (scores, routed), (base_scores, base_routed) in zip(track.probe, track.probe_base):
            sums[0] += routing_kl(track.router.score_function, base_scores, scores).double().sum()
            sums[1] += (routed & base_routed).sum().double() / track.router.topk
            sums[2] += scores.shape[0]
            sums[3:3 + num_experts] += base_routed.sum(dim=0).double()
            sums[3 + num_experts:] += routed.sum(dim=0).double()
        return sums

    def _hook_for(self, track: _Track):
        def hook(router, logits_TE, probs, routing_map_TE, valid_T):
            mode = self._mode
            if mode == "probe":
                scores_TE = routing_scores(router, logits_TE).detach()
                routed_TE = routing_map_TE.detach()
                if valid_T is not None:
                    scores_TE, routed_TE = scores_TE[valid_T], routed_TE[valid_T]
                track.probe.append((scores_TE.cpu(), routed_TE.bool().cpu()))
                return probs
            if mode == "record_base":
                track.base_queue.append(routing_scores(router, logits_TE).detach())
                return probs
            if not (router.training and torch.is_grad_enabled()):
                return probs
            if self.balance_coeff > 0:
                probs = _attach_routed_balance(router, logits_TE, probs, routing_map_TE, valid_T,
                                               self.balance_coeff)
            if self.kl_coeff > 0:
                if not track.base_queue:
                    raise RuntimeError(f"layer {router.layer_number}: routing preservation has no "
                                       "base routing for this micro-batch (reference_pass first)")
                probs = _attach_routing_kl(router, logits_TE, probs, track.base_queue.popleft(),
                                           valid_T, self.kl_coeff)
            return probs

        return hook


def _attach_routed_balance(router, logits_TE, probs, routing_map_TE, valid_T, coeff: float):
    scores_TE = balance_scores(router, logits_TE)
    routed_TE = routing_map_TE if valid_T is None else routing_map_TE & valid_T.unsqueeze(-1)
    tokens_per_expert_E, local_tokens, total_tokens = get_tokens_per_expert_and_token_count(
        routing_map=routed_TE, reduce_group=router.tp_cp_group, topk=router.topk,
        with_padding_mask=valid_T is not None)
    loss = switch_load_balancing_loss_func(
        probs=scores_TE, tokens_per_expert=tokens_per_expert_E, total_num_tokens=total_tokens,
        topk=router.topk, num_experts=router.config.num_moe_experts, moe_aux_loss_coeff=coeff,
        padding_mask=valid_T)
    return router.attach_and_log_load_balancing_loss(
        probs, coeff, loss, "routed_load_balancing_loss", router.tp_cp_group,
        valid_token_count=local_tokens)


def _attach_routing_kl(router, logits_TE, probs, base_TE, valid_T, coeff: float):
    if base_TE.shape != logits_TE.shape:
        raise RuntimeError(f"layer {router.layer_number}: base routing of shape "
                           f"{tuple(base_TE.shape)} for logits of shape {tuple(logits_TE.shape)}: "
                           "the reference pass saw other micro-batches")
    kl_T = routing_kl(router.score_function, base_TE, routing_scores(router, logits_TE))
    if valid_T is not None:
        kl_T = kl_T * valid_T
    local_tokens = kl_T.new_tensor(float(kl_T.shape[0] if valid_T is None else valid_T.sum()))
    total_tokens = local_tokens.clone()
    if router.tp_cp_group.size() > 1:  # each rank holds its share of the micro-batch's tokens
        torch.distributed.all_reduce(total_tokens, group=router.tp_cp_group)
    loss = coeff * kl_T.sum() / total_tokens.clamp_min(1.0)
    return router.attach_and_log_load_balancing_loss(
        probs, coeff, loss, "routing_kl_loss", router.tp_cp_group, valid_token_count=local_tokens)


def _drift_metrics(sums: torch.Tensor, topk: int) -> dict[str, float]:
    num_experts = (len(sums) - 3) // 2
    tokens = sums[2].item()
    if tokens == 0:
        return {name: float("nan") for name in DRIFT_FIELDS}
    base_E, now_E = sums[3:3 + num_experts], sums[3 + num_experts:]
    base_share_E = base_E / base_E.sum().clamp_min(1.0)
    now_share_E = now_E / now_E.sum().clamp_min(1.0)
    return {
        "drift_kl": sums[0].item() / tokens,
        "drift_topk_overlap": sums[1].item() / tokens,
        "drift_load_change": 0.5 * (base_share_E - now_share_E).abs().sum().item(),
    }
