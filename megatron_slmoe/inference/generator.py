"""Batched autoregressive generation with Megatron-Core's GPTModel, in any parallel layout.

Megatron-Core does the model work: its ``StaticInferenceContext`` is the KV cache that GPTModel's
attention fills during the prefill and reads at each decode step, and its pipeline helpers
(``recv_from_prev_pipeline_rank_`` / ``send_to_next_pipeline_rank``) move activations between
stages. What this module adds is the loop around one forward step:

* prompts of different lengths share a batch the way Megatron's static controller does it: the
  batch is right-padded, the prefill runs up to the shortest prompt, and each decode step feeds
  the next prompt token to the rows still inside their prompt and the sampled token to the others;
* the last pipeline stage samples (``megatron_slmoe.inference.sampling``) and broadcasts the new
  tokens to the other stages;
* expert parallelism makes every forward step a collective over the EP group, whose ranks may hold
  other prompts (they are other data-parallel replicas): all ranks agree on the number of batches
  and the KV-cache length, and keep stepping until every rank's rows are finished;
* sequence parallelism (on whenever TP > 1 in training) cannot split a one-token decode step:
  it is switched off for the duration with Megatron's ``set_model_to_sequence_parallel``, and the
  model is put in eval mode; both are restored afterwards, so the training model itself can
  generate in the middle of a run.

``use_kv_cache=False`` recomputes the whole sequence at every step, without an inference context:
the reference the KV-cached path is tested against.

Collective: every rank calls ``generate``; ranks of one model replica (the same data-parallel
rank) must pass the same prompts.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Sequence, Union

import torch
from megatron.core import parallel_state
from megatron.core.inference.communication_utils import (
    recv_from_prev_pipeline_rank_,
    send_to_next_pipeline_rank,
)
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.transformer.utils import set_model_to_sequence_parallel
from megatron.core.utils import get_attr_wrapped_model, unwrap_model

from megatron_slmoe.inference.sampling import SamplingConfig, prompt_generator, sample_next_tokens

GREEDY = SamplingConfig()


class TextGenerator:
    """Generates token continuations with one model chunk of this rank (a GPTModel, possibly
    wrapped in Megatron's DDP / Float16Module).

    ``eos_id``: generation of a prompt stops after this token (it is not returned).
    ``vocab_size``: tokens at or above it (the model's vocabulary padding) are never chosen.
    ``max_batch_size``: prompts per forward pass on this rank.
    """

    def __init__(self, model: torch.nn.Module, eos_id: int, vocab_size: Optional[int] = None,
                 max_batch_size: int = 64, use_kv_cache: bool = True) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.module = unwrap_model(model)
        self.config = self.module.config
        self.eos_id = int(eos_id)
        self.vocab_size = vocab_size
        self.max_batch_size = int(max_batch_size)
        self.use_kv_cache = bool(use_kv_cache)
        self.device = next(self.module.parameters()).device
        self.first_stage = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
        self.last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)

    # -- public ----------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]],
                 max_new_tokens: Union[int, Sequence[int]],
                 sampling: SamplingConfig = GREEDY,
                 prompt_indices: Optional[Sequence[int]] = None) -> list[list[int]]:
        """The generated tokens of each prompt (without the prompt and without ``eos_id``).

        ``max_new_tokens``: one limit for all prompts, or one per prompt. ``prompt_indices``: the
        prompts' global indices, which seed their sampling generators (default 0..n-1)."""
        count = len(prompts)
        limits = ([int(max_new_tokens)] * count if isinstance(max_new_tokens, int)
                  else [int(m) for m in max_new_tokens])
        indices = list(range(count)) if prompt_indices is None else list(prompt_indices)
        if len(limits) != count or len(indices) != count:
            raise ValueError("max_new_tokens and prompt_indices need one entry per prompt")
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        # Prompts of similar length share a batch: fewer padded decode steps.
        order = sorted(range(count), key=lambda i: len(prompts[i]))
        batches = [order[i:i + self.max_batch_size] for i in range(0, count, self.max_batch_size)]
        outputs: list[list[int]] = [[] for _ in range(count)]
        with self._inference_mode():
            for number in range(_global_max(len(batches), self.device)):
                rows = batches[number] if number < len(batches) else []
                if rows:
                    result = self._generate_batch([list(prompts[i]) for i in rows],
                                                  [limits[i] for i in rows], sampling,
                                                  [indices[i] for i in rows])
                else:  # nothing left here, but the EP peers still need this rank's steps
                    result = self._generate_batch([[self.eos_id]], [0], sampling, [0])
                for i, tokens in zip(rows, result):
                    outputs[i] = tokens
        return outputs

    # -- internals -------------------------------------------------------------------------------

    @contextmanager
    def _inference_mode(self) -> Iterator[None]:
        was_training = self.module.training
        sequence_parallel = bool(self.config.sequence_parallel)
        self.module.eval()
        if sequence_parallel:
            set_model_to_sequence_parallel(self.module, False)
        try:
            with torch.no_grad():
                yield
        finally:
            if sequence_parallel:
                set_model_to_sequence_parallel(self.module, True)
            self.module.train(was_training)

    def _generate_batch(self, prompts: list[list[int]], limits: list[int],
                        sampling: SamplingConfig, indices: list[int]) -> list[list[int]]:
        batch = len(prompts)
        prompt_len_B = torch.tensor([len(p) for p in prompts], device=self.device)
        stop_at_B = prompt_len_B + torch.tensor(limits, device=self.device)
        # Every rank takes as many steps as the EP peer that needs the most (one forward each),
        # and sizes its batch and KV cache for that.
        start_at = int(prompt_len_B.min())
        total = start_at + _global_max(int(stop_at_B.max()) - start_at, self.device)
        tokens_BS = torch.full((batch, total), self.eos_id, dtype=torch.long, device=self.device)
        for row, prompt in enumerate(prompts):
            tokens_BS[row, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        done_B = stop_at_B <= prompt_len_B  # a limit of 0 new tokens
        generators = [] if sampling.greedy else [prompt_generator(sampling.seed, i) for i in indices]
        context = StaticInferenceContext(batch, total) if self.use_kv_cache else None

        done_upto, position = 0, start_at
        while position < total:
            start = done_upto if context is not None else 0
            positions_BS = torch.arange(start, position, device=self.device).expand(batch, -1)
            logits_BV = self._forward(tokens_BS[:, start:position], positions_BS, context)
            if context is not None:
                context.increment_sequence_len_offset(position - start)
                context.enable_decode_mode()
            writing_B = (position >= prompt_len_B) & ~done_B
            next_B = self._next_tokens(logits_BV, sampling, generators, writing_B)
            tokens_BS[writing_B, position] = next_B[writing_B]
            done_B |= writing_B & ((next_B == self.eos_id) | (position + 1 >= stop_at_B))
            done_upto, position = position, position + 1
            if not _global_any(~done_B, self.device):
                break

        outputs = []
        for row, prompt in enumerate(prompts):
            generated = tokens_BS[row, len(prompt):int(stop_at_B[row])].tolist()
            if self.eos_id in generated:
                generated = generated[:generated.index(self.eos_id)]
            outputs.append(generated)
        return outputs

    def _forward(self, tokens_BS: torch.Tensor, positions_BS: torch.Tensor,
                 context: Optional[StaticInferenceContext]) -> Optional[torch.Tensor]:
        """One forward step of this pipeline stage; the last stage returns the logits of the last
        position [B, V] (fp32), the others None."""
        batch, length = tokens_BS.shape
        received = None
        if not self.first_stage:
            received = torch.empty((length, batch, self.config.hidden_size),
                                   dtype=_pipeline_dtype(self.config), device=self.device)
            recv_from_prev_pipeline_rank_(received)
        get_attr_wrapped_model(self.model, "set_input_tensor")(received)
        output = self.module(tokens_BS, positions_BS, None, inference_context=context,
                             runtime_gather_output=True)
        if not self.last_stage:
            send_to_next_pipeline_rank(output.to(_pipeline_dtype(self.config)).contiguous())
            return None
        logits_BV = output[:, -1, :].float()
        return logits_BV[:, :self.vocab_size] if self.vocab_size else logits_BV

    def _next_tokens(self, logits_BV: Optional[torch.Tensor], sampling: SamplingConfig,
                     generators: list[torch.Generator], writing_B: torch.Tensor) -> torch.Tensor:
        """The last stage samples (drawing only for the rows that generate now); every stage
        receives its choice."""
        if self.last_stage:
            next_B = sample_next_tokens(logits_BV, sampling, generators, writing_B)
        else:
            next_B = torch.empty(len(writing_B), dtype=torch.long, device=self.device)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            torch.distributed.broadcast(next_B, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                        group=parallel_state.get_pipeline_model_parallel_group())
        return next_B


def _pipeline_dtype(config) -> torch.dtype:
    return config.pipeline_dtype or config.params_dtype


def _global_max(value: int, device: torch.device) -> int:
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return value
    tensor = torch.tensor([value], dtype=torch.long, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return int(tensor.item())


def _global_any(flags_B: torch.Tensor, device: torch.device) -> bool:
    return _global_max(int(flags_B.any()), device) > 0
