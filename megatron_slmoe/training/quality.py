"""What a fine-tuning run watches and guards besides its loss, behind a few Trainer hooks:
routing stability under LoRA (``megatron_slmoe.moe.stability``: the routed load-balancing loss,
routing preservation toward the base model, drift on a probe batch) and task accuracy by
generation (``megatron_slmoe.training.evaluation``)."""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

from megatron.core import parallel_state

from megatron_slmoe.training.config import RunConfig
from megatron_slmoe.moe.stability import RoutingStability


class RunQuality:
    """``forward_only(microbatches)`` runs micro-batches forward through the training model's
    pipeline schedule (collective); ``probe`` are the micro-batches of the drift probe (this
    rank's share of the first held-out global batch)."""

    def __init__(self, run: RunConfig, model, tokenizer, valid, dp_rank: int, dp_size: int,
                 forward_only: Callable[[list], object], probe: list) -> None:
        from megatron_slmoe.lora.inject import adapters_disabled

        # Both routing-stability terms are for a frozen router (LoRA): a trained router and its
        # expert bias keep routing balanced themselves.
        lora = run.model.finetune_mode == "lora"
        self.stability = RoutingStability(
            [model], balance_coeff=run.moe.routed_balance_coeff if lora else 0.0,
            kl_coeff=run.moe.routing_kl_coeff if lora else 0.0,
            base_model=partial(adapters_disabled, [model]) if lora else None)
        # Drift is measured from the frozen base, which only a LoRA run has.
        self.drift_interval = run.monitor.drift_interval if lora else 0
        self.model, self.forward_only, self.probe = model, forward_only, probe
        self.evaluator = None
        conversations = getattr(valid, "conversations", None)  # instruction data only
        if conversations and run.schedule.eval_accuracy_samples > 0:
            from megatron_slmoe.training.evaluation import TaskEvaluator

            self.evaluator = TaskEvaluator(conversations, tokenizer,
                                           run.schedule.eval_accuracy_samples, dp_rank, dp_size)

    def before_step(self, microbatches: list) -> None:
        self.stability.reference_pass(lambda: self.forward_only(microbatches))

    def drift(self, iteration: int, last: bool) -> dict[int, dict]:
        """Every ``drift_interval`` steps (and at the last): each layer's drift from the base
        routing on the probe batch, by layer number ({} otherwise). Collective."""
        if not self.drift_interval or not (iteration % self.drift_interval == 0 or last):
            return {}
        group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        return self.stability.measure_drift(lambda: self.forward_only(self.probe), group)

    def accuracy(self) -> Optional[float]:
        """Exact-match accuracy on the held-out conversations (None without them). Collective."""
        return None if self.evaluator is None else self.evaluator.accuracy(self.model)
