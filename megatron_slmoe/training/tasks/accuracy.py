"""Held-out task accuracy: the task's greedy answers to held-out prompts, scored by exact match,
before training and at evaluations (every evaluation, or only the final one where the task says
generation is slow). A few answers go to the log; every answer of the first and the final scoring
to ``answers_before_training.jsonl`` / ``answers_after_training.jsonl`` in the output directory."""

from __future__ import annotations

import json
import os
from typing import Optional

from megatron_slmoe.training.callbacks.base import BEFORE, DURING, FINAL, Callback
from megatron_slmoe.training.context import RunContext
from megatron_slmoe.training.tasks.base import Task
from megatron_slmoe.utils.atomic import write_text_atomic

SHOWN_ANSWERS = 3
"""Answers printed in the log at each scoring."""


class HeldOutAnswers(Callback):
    name = "accuracy"

    def __init__(self, task: Task) -> None:
        self.task = task
        self.before: Optional[float] = None
        self.after: Optional[float] = None

    def load_state_dict(self, state: dict) -> None:
        self.before = state.get("accuracy_before")

    def state_dict(self) -> dict:
        return {"accuracy_before": self.before}

    def evaluate(self, ctx: RunContext, record: dict, when: str) -> None:
        if when == DURING and not self.task.score_every_evaluation:
            return
        answers = self.task.answers(ctx)
        if answers is None:
            return
        record["eval_accuracy"] = answers.accuracy
        if when == BEFORE:
            self.before = answers.accuracy
        elif when == FINAL:
            self.after = answers.accuracy
        if when != DURING:
            ctx.info(f"[finetune] held-out answer accuracy {when}: {answers.accuracy:.3f} "
                     f"({len(answers.rows)} answers)")
        for prompt, answer, reference in answers.rows[:SHOWN_ANSWERS]:
            ctx.info(f"[finetune]   {prompt!r} -> {answer!r} (reference {reference!r})")
        if when != DURING and ctx.rank == 0:  # every answer, for a closer look
            write_text_atomic(
                os.path.join(ctx.output_dir, f"answers_{when.replace(' ', '_')}.jsonl"),
                "".join(json.dumps({"prompt": p, "answer": a, "reference": r}) + "\n"
                        for p, a, r in answers.rows))

    def finish(self, ctx: RunContext, summary: dict) -> None:
        summary.update(accuracy_before=self.before, accuracy_after=self.after)
