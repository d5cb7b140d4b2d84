"""Task accuracy by generation: the model answers held-out instruction prompts greedily and an
answer counts when it equals the reference exactly (surrounding whitespace aside).

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
from megatron_slmoe.data.tokenizer import Tokenizer

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


def exact_match(answer: str, reference: str) -> bool:
    return answer.strip() == reference.strip()


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


class TaskEvaluator:
    """Exact-match accuracy of the model's greedy answers on the first ``samples`` conversations
    of a held-out set, each data-parallel replica answering its share.

    ``accuracy(model)`` is collective over all ranks and returns the same number on every rank.
    """

    def __init__(self, conversations: Sequence[Sequence[Message]], tokenizer: Tokenizer,
                 samples: int, dp_rank: int, dp_size: int, max_batch_size: int = 64) -> None:
        requests = [request_for(tokenizer, m) for m in conversations[:samples]]
        share = -(-len(requests) // dp_size)  # contiguous shares, the last may be shorter
        self.first = min(dp_rank * share, len(requests))
        self.requests = requests[self.first:self.first + share]
        self.total = len(requests)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size

    def accuracy(self, model) -> float:
        from megatron.core import parallel_state

        from megatron_slmoe.inference.generator import TextGenerator

        generator = TextGenerator(model, self.tokenizer.eos_id, self.tokenizer.vocab_size,
                                  max_batch_size=self.max_batch_size)
        answers = answer(generator, self.tokenizer, self.requests, first_index=self.first)
        correct = sum(exact_match(a, r.reference) for a, r in zip(answers, self.requests))
        device = next(generator.module.parameters()).device
        counts = torch.tensor([correct], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(counts, group=parallel_state.get_data_parallel_group())
        return counts.item() / max(self.total, 1)
