"""Answering a set of prompts across data-parallel replicas: each replica takes its contiguous
share, generates (``TextGenerator``), decodes, and every rank gathers all answers in prompt order;
held-out answers are then scored by exact match (``data.scoring.exact_match``).

The one answering path of the package: a run's held-out accuracy (both tasks, at evaluations) and
``slmoe-generate`` go through it. A text prompt is built with the chat template the model was
tuned on (``request_for``); a multimodal prompt (its token ids and its images) is made by the
image-text data and passed as the request's ``prompt``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from megatron.core import parallel_state

from megatron_slmoe.data.instruction import Message, build_generation_prompt, split_for_generation
from megatron_slmoe.data.scoring import exact_match
from megatron_slmoe.data.tokenizer import Tokenizer
from megatron_slmoe.inference.generator import GREEDY, TextGenerator
from megatron_slmoe.inference.sampling import SamplingConfig

GENERATION_BATCH = 64
"""Held-out prompts per forward pass when a run scores its answers."""

ANSWER_SLACK_TOKENS = 4
"""Generation stops this many tokens after the reference's length (plus its end-of-turn): an
answer that is still going by then cannot be an exact match, and the cap keeps evaluation short."""


@dataclass(frozen=True)
class Request:
    """One prompt to answer: its token ids, the reference answer (None when there is none), how
    many tokens may be generated, and for a prompt with images what the generator takes (an
    object with ``tokens`` and its images; ``prompt_ids`` are then its tokens, image
    placeholders included)."""

    prompt_ids: list[int]
    reference: Optional[str]
    max_new_tokens: int
    prompt: Any = None

    @property
    def generator_prompt(self) -> Any:
        return self.prompt_ids if self.prompt is None else self.prompt

    def shown(self, tokenizer: Tokenizer) -> str:
        """The prompt as text (placeholders with negative ids, as LLaVA's, left out)."""
        return tokenizer.decode([t for t in self.prompt_ids if t >= 0])


@dataclass(frozen=True)
class Answers:
    """Greedy answers to held-out prompts scored by exact match: the accuracy, and every
    (prompt, answer, reference) of the data-parallel ranks together, in held-out order."""

    accuracy: float
    rows: list


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


def share_of(count: int, dp_rank: int, dp_size: int) -> range:
    """This data-parallel rank's contiguous share of ``count`` prompts (the last share may be
    shorter, or empty)."""
    per_rank = -(-count // dp_size)
    first = min(dp_rank * per_rank, count)
    return range(first, min(first + per_rank, count))


def answer_all(generator: TextGenerator, tokenizer: Tokenizer, requests: Sequence[Request],
               dp_rank: int, dp_size: int, sampling: SamplingConfig = GREEDY) -> list[str]:
    """Every request's decoded answer, in request order, on every rank: this data-parallel
    rank answers its share (each prompt sampled by its global index), the shares are gathered
    over the data-parallel group. Collective (see ``TextGenerator.generate``)."""
    mine = share_of(len(requests), dp_rank, dp_size)
    share = [requests[i] for i in mine]
    tokens = generator.generate([r.generator_prompt for r in share],
                                [r.max_new_tokens for r in share], sampling, prompt_indices=mine)
    group = parallel_state.get_data_parallel_group()
    everyone = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(everyone, [tokenizer.decode(t) for t in tokens],
                                        group=group)
    return [text for answers in everyone for text in answers]


def held_out_answers(model, tokenizer: Tokenizer, requests: Sequence[Request], dp_rank: int,
                     dp_size: int, max_batch_size: int = GENERATION_BATCH) -> Answers:
    """Greedy answers of ``model`` to ``requests`` (each with a reference), scored by exact
    match; collective over all ranks, the same on every rank."""
    generator = TextGenerator(model, tokenizer.eos_id, tokenizer.vocab_size,
                              max_batch_size=max_batch_size)
    answers = answer_all(generator, tokenizer, requests, dp_rank, dp_size)
    rows = [(r.shown(tokenizer), a, r.reference) for r, a in zip(requests, answers)]
    correct = sum(exact_match(a, r.reference) for a, r in zip(answers, requests))
    return Answers(correct / max(len(rows), 1), rows)
