"""Task accuracy by generation: the model answers held-out instruction prompts greedily and an
answer counts when it equals the reference exactly (``data.scoring.exact_match``).

The held-out loss says how likely the reference answers are; exact match says whether the model,
left to itself, gives them, which is what a user of the fine-tuned model sees. The prompts are
built with the chat template the model was tuned on (``build_generation_prompt``), each
conversation's last assistant message is the reference (``split_for_generation``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_slmoe.data.instruction import Message, build_generation_prompt, split_for_generation
from megatron_slmoe.data.scoring import exact_match
from megatron_slmoe.data.tokenizer import Tokenizer

GENERATION_BATCH = 64
"""Held-out prompts per forward pass when a run scores its answers."""

ANSWER_SLACK_TOKENS = 4
"""Generation stops this many tokens after the reference's length (plus its end-of-turn): an
answer that is still going by then cannot be an exact match, and the cap keeps evaluation short."""


@dataclass(frozen=True)
class Request:
    """One prompt to answer: its token ids, the reference answer (None when there is none) and
    how many tokens may be generated."""

    prompt_ids: list[int]
    reference: Optional[str]
    max_new_tokens: int


def request_for(tokenizer: Tokenizer, messages: Sequence[Message],
                max_new_tokens: Optional[int] = None) -> Request:
    """The generation request of a conversation. Ending with an assistant message, that message
    is the reference (and, without ``max_new_tokens``, sets the cap); ending with a user message,
    the model answers it and ``max_new_tokens`` is required."""
    reference = None
    if messages and messages[-1]["role"] == "assistant":
        messages, reference = split_for_generation(messages)
    if max_new_tokens is None:
        if reference is None:
            raise ValueError("max_new_tokens is needed for a conversation without a reference")
        max_new_tokens = len(tokenizer.encode(reference)) + 1 + ANSWER_SLACK_TOKENS
    return Request(build_generation_prompt(tokenizer, messages), reference, max_new_tokens)


def answer(generator, tokenizer: Tokenizer, requests: Sequence[Request], sampling=None,
           first_index: int = 0) -> list[str]:
    """The decoded answers of ``requests`` (collective, see ``TextGenerator.generate``)."""
    from megatron_slmoe.inference.generator import GREEDY

    tokens = generator.generate([r.prompt_ids for r in requests],
                                [r.max_new_tokens for r in requests], sampling or GREEDY,
                                prompt_indices=range(first_index, first_index + len(requests)))
    return [tokenizer.decode(t) for t in tokens]


def share_of(count: int, dp_rank: int, dp_size: int) -> range:
    """This data-parallel rank's contiguous share of ``count`` held-out prompts (the last share
    may be shorter, or empty)."""
    per_rank = -(-count // dp_size)
    first = min(dp_rank * per_rank, count)
    return range(first, min(first + per_rank, count))


def gather_answers(rows: list, correct: int, device: torch.device) -> tuple[float, list]:
    """(accuracy, every rank's rows in rank order) over the data-parallel group; collective."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    everyone = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(everyone, (correct, rows), group=group)
    total = sum(len(r) for _, r in everyone)
    return (sum(c for c, _ in everyone) / max(total, 1),
            [row for _, rows_of_rank in everyone for row in rows_of_rank])


class TaskEvaluator:
    """Exact-match accuracy of the model's greedy answers on the first ``samples`` conversations
    of a held-out set, each data-parallel replica answering its share."""

    def __init__(self, conversations: Sequence[Sequence[Message]], tokenizer: Tokenizer,
                 samples: int, max_batch_size: int = GENERATION_BATCH) -> None:
        self.requests = [request_for(tokenizer, m) for m in conversations[:samples]]
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size

    def evaluate(self, model, dp_rank: int, dp_size: int) -> tuple[float, list]:
        """(accuracy, every (prompt, answer, reference)); collective over all ranks, the same
        on every rank."""
        from megatron_slmoe.inference.generator import TextGenerator

        mine = share_of(len(self.requests), dp_rank, dp_size)
        requests = [self.requests[i] for i in mine]
        generator = TextGenerator(model, self.tokenizer.eos_id, self.tokenizer.vocab_size,
                                  max_batch_size=self.max_batch_size)
        answers = answer(generator, self.tokenizer, requests, first_index=mine.start)
        rows = [(self.tokenizer.decode(r.prompt_ids), a, r.reference)
                for r, a in zip(requests, answers)]
        correct = sum(exact_match(a, r.reference) for a, r in zip(answers, requests))
        return gather_answers(rows, correct, generator.device)
