"""The task protocol: what a kind of training data brings to the engine.

A task makes the model (the language model, or the multimodal one), its datasets and tokenizer,
the micro-batches and the forward step Megatron-Core's schedule runs, and the held-out answers
that measure task accuracy. Its settings are given when it is made; the engine gives it the
rest through the run's context. ``tasks.text`` and ``tasks.image_text`` implement it.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from megatron_slmoe.inference.answers import Answers
from megatron_slmoe.model.build import build_gpt_model
from megatron_slmoe.training.callbacks.base import Callback
from megatron_slmoe.training.context import RunContext


def masked_mean_loss(loss_mask: torch.Tensor, output: torch.Tensor):
    """Mean per-token loss over the tokens ``loss_mask`` keeps (prompt and padding tokens carry
    none), and the value the schedule logs."""
    mask = loss_mask.reshape(-1).float()
    loss = (output.reshape(-1).float() * mask).sum() / mask.sum().clamp_min(1.0)
    # clone: the schedule divides the returned loss in place by the number of micro-batches
    return loss, {"loss": loss.detach().clone()}


class Task:
    """A kind of training data (override what differs from a language-model task)."""

    name = "task"

    score_every_evaluation = True
    """Whether held-out answers are generated at every evaluation, or only before training and
    at the final evaluation (where generation is slow)."""

    def build_model(self, model_config, transformer_config, pre_process: bool,
                    post_process: bool):
        """This rank's pipeline stage of the model (before LoRA)."""
        return build_gpt_model(model_config, transformer_config, pre_process=pre_process,
                               post_process=post_process)

    def after_base_weights(self, model) -> None:
        """Weights of the task's own parts that the base checkpoint does not hold."""

    def datasets(self, storage, tokenizer, output_dir: str):
        """(train, valid) read with the run's ``tokenizer`` (opened and checked against the model
        before start-up, ``training.inputs``); collective (a default dataset may be made on rank
        0)."""
        raise NotImplementedError

    def collate(self, samples: list) -> dict:
        raise NotImplementedError

    def forward_step(self, device: torch.device, data_iterator, model):
        """Megatron's ``forward_step_func`` (bound to the device with ``partial``)."""
        raise NotImplementedError

    def step_function(self, device: torch.device):
        return partial(self.forward_step, device)

    def answers(self, ctx: RunContext) -> Optional[Answers]:
        """Greedy answers to the held-out prompts, scored (None when the task or its settings
        have none); collective."""
        return None

    def callbacks(self) -> list[Callback]:
        """The task's own concerns during the run."""
        return []


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}
