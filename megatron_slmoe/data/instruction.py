"""Instruction JSONL -> chat template -> packed fixed-length causal-LM samples.

Record formats (one JSON object per line; blank lines are ignored; other keys are ignored)::

    {"prompt": "Write in digits: two one", "response": "2 1"}
    {"messages": [{"role": "system", "content": "..."},        # optional, first only
                  {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}

A prompt/response record is the messages ``[user: prompt, assistant: response]``. Messages must
alternate user/assistant after an optional leading system message, start with a user message, and
end with an assistant message; every assistant content must be non-empty (not just whitespace).
Anything else (bad JSON, not an object, both or neither of ``prompt``/``messages``, missing keys,
wrong types, unknown roles, empty response) is a malformed record: it is skipped, counted in
:class:`InstructionStats` by reason, and logged as a warning ``FILE:LINE: skipped malformed record:
REASON`` (the first ``max_warnings`` per file; a summary line says how many were not shown).

Chat template (token level; ``<|x|>`` are single special-token ids, content is
``tokenizer.encode(content)`` of each message alone, so no BPE merge crosses a boundary)::

    [<|system|> system-content]  <|user|> user-content  <|assistant|> assistant-content <|eos|>
                                 <|user|> ...           <|assistant|> ...              <|eos|>

``<|eos|>`` closes every assistant turn, so it is also what generation stops on, and every example
ends with ``<|eos|>``. No BOS is added. Targets: the assistant content tokens and the ``<|eos|>`` that
closes each assistant turn; everything else (system, user, role tokens) is context only.

Packing. Examples are shuffled by ``seed`` (unless ``shuffle=False``) and packed greedily in that
order into rows of ``seq_length + 1`` tokens; an example never straddles two rows (when the next one
does not fit, the row is padded with ``<|pad|>`` and a new row begins). Examples longer than
``seq_length + 1`` tokens are skipped and counted (``too_long``), not truncated: a truncated example
would lose its response. Each row gives one sample:

    tokens       row[:-1]                 int64 [seq_length]
    labels       row[1:]                  int64 [seq_length]  (the next token)
    loss_mask    1.0 where labels is a target token, else 0.0 (prompt, role tokens, padding)
    segment_ids  0, 0, .., 1, 1, ..       int64 [seq_length]: which example of the row a token
                                          belongs to (the padding tail is one more segment)
    position_ids 0 .. len-1 per segment   int64 [seq_length]: positions restart with each example

Packed examples are kept apart, as they would be at generation time, where each prompt stands
alone: positions restart with every example, and the model attends only within an example
(``packed_attention_mask``: causal and block-diagonal over the segments; Megatron-Core's local
``DotProductAttention`` takes it as its attention mask). With rotary position embeddings the
block-diagonal mask alone makes an example's output independent of where in the row it sits
(rotary attention depends on relative positions only); learned absolute position embeddings read
the restarted position ids. (Megatron's ``GPTDataset`` calls this ``reset_position_ids`` and
``reset_attention_mask``; its pretraining samples keep one causal mask over the row.)

Epochs: with ``num_samples`` larger than the number of packed rows, sample ``i`` is row
``perm_e[i % rows]`` of epoch ``e = i // rows``, each epoch with its own permutation drawn from
``(seed, e)``. Deterministic for a given file, tokenizer, seq_length and seed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from megatron_slmoe.data import chat_template
from megatron_slmoe.data.errors import DataError, require_file
from megatron_slmoe.data.tokenizer import Tokenizer
from megatron_slmoe.utils.jsonl import numbered_records

logger = logging.getLogger(__name__)

Message = Dict[str, str]
ROLES = ("system", "user", "assistant")


@dataclass
class InstructionStats:
    """Counts of one load: records read, kept, skipped (and why), and what packing made."""

    records: int = 0                  # non-blank lines read
    examples: int = 0                 # well-formed records
    malformed: int = 0                # skipped: malformed (see by_reason)
    by_reason: Dict[str, int] = field(default_factory=dict)
    too_long: int = 0                 # skipped: longer than seq_length + 1 tokens
    packed_examples: int = 0          # examples placed in rows
    rows: int = 0                     # packed rows (samples per epoch)
    target_tokens: int = 0            # loss_mask ones over one epoch
    pad_tokens: int = 0               # padding over one epoch (labels side)

    def as_dict(self) -> dict:
        return dict(self.__dict__, by_reason=dict(self.by_reason))

    def summary(self) -> str:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.by_reason.items()))
        return (f"{self.records} records, {self.examples} examples, {self.malformed} malformed"
                f"{f' ({reasons})' if reasons else ''}, {self.too_long} too long, "
                f"{self.packed_examples} packed into {self.rows} rows")


def malformed_problem(stats: InstructionStats, max_fraction: float) -> Optional[str]:
    """Why one file's records are not data to train on (empty, or more than ``max_fraction``
    of them malformed: ``--max-malformed-fraction``), or None. The one place of this rule: the
    checks before start-up and the dataset of every run (files from object storage too)."""
    if stats.records == 0:
        return "holds no records (an empty file)"
    if stats.examples == 0 or stats.malformed > max_fraction * stats.records:
        return (f"{stats.malformed} of {stats.records} records are malformed, more than "
                f"--max-malformed-fraction {max_fraction:g}")
    return None


class MalformedRecord(ValueError):
    def __init__(self, key: str, detail: str):
        super().__init__(detail)
        self.key = key          # the counter key in InstructionStats.by_reason


def _check_text(value, what: str, allow_empty: bool) -> str:
    if not isinstance(value, str):
        raise MalformedRecord("wrong type", f"{what} must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise MalformedRecord("empty response", f"{what} is empty")
    return value


def parse_record(record) -> List[Message]:
    """The messages of one decoded JSON record; ``ValueError`` with the reason if malformed.

    Reasons (the keys of ``InstructionStats.by_reason``): ``bad json``, ``not an object``,
    ``both formats``, ``missing key``, ``wrong type``, ``empty response``, ``unknown role``,
    ``bad turn order``, ``invalid utf-8``.
    """
    if not isinstance(record, dict):
        raise MalformedRecord("not an object", f"record must be a JSON object, got {type(record).__name__}")
    has_prompt = "prompt" in record or "response" in record
    if has_prompt and "messages" in record:
        raise MalformedRecord("both formats", "record has both prompt/response and messages")
    if has_prompt:
        for key in ("prompt", "response"):
            if key not in record:
                raise MalformedRecord("missing key", f"missing key '{key}'")
        return [{"role": "user", "content": _check_text(record["prompt"], "prompt", True)},
                {"role": "assistant", "content": _check_text(record["response"], "response", False)}]
    if "messages" not in record:
        raise MalformedRecord("missing key", "missing key 'prompt'/'response' or 'messages'")
    raw = record["messages"]
    if not isinstance(raw, list):
        raise MalformedRecord("wrong type", f"messages must be a list, got {type(raw).__name__}")
    if not raw:
        raise MalformedRecord("empty response", "messages is empty")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise MalformedRecord("wrong type", f"messages[{i}] must be an object, got {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise MalformedRecord("missing key", f"messages[{i}] missing key '{key}'")
        role = m["role"]
        if role not in ROLES:
            raise MalformedRecord("unknown role", f"messages[{i}] has unknown role {role!r}")
        content = _check_text(m["content"], f"messages[{i}].content", role != "assistant")
        messages.append({"role": role, "content": content})
    first = 1 if messages[0]["role"] == "system" else 0
    for i in range(first, len(messages)):
        expected = "user" if (i - first) % 2 == 0 else "assistant"
        if messages[i]["role"] != expected:
            raise MalformedRecord("bad turn order", f"messages[{i}] is {messages[i]['role']}, expected "
                             f"{expected} (optional system first, then user/assistant alternating)")
    if messages[-1]["role"] != "assistant":
        raise MalformedRecord("bad turn order", "last message must be from the assistant")
    return messages


def read_instruction_jsonl(path: str, stats: Optional[InstructionStats] = None,
                           max_warnings: int = 20) -> List[List[Message]]:
    """The well-formed records of one JSONL file as message lists, in file order.

    Malformed records are skipped, counted in ``stats`` and logged (see the module doc). A missing
    file raises a one-line :class:`~megatron_slmoe.data.errors.DataFileNotFoundError`.
    """
    path = require_file(path, "instruction data file")
    stats = stats if stats is not None else InstructionStats()
    examples: List[List[Message]] = []
    warned = skipped_here = 0
    for lineno, record in numbered_records(path, errors="surrogateescape"):
        stats.records += 1
        try:
            if isinstance(record, ValueError):
                raise MalformedRecord("bad json", f"bad json ({record})")
            messages = parse_record(record)
            for m in messages:   # undecodable bytes survive as lone surrogates
                try:
                    m["content"].encode("utf-8")
                except UnicodeEncodeError:
                    raise MalformedRecord("invalid utf-8", "text is not valid UTF-8") from None
        except MalformedRecord as exc:
            key, reason = exc.key, str(exc)
            stats.malformed += 1
            stats.by_reason[key] = stats.by_reason.get(key, 0) + 1
            skipped_here += 1
            if warned < max_warnings:
                warned += 1
                logger.warning("%s:%d: skipped malformed record: %s", path, lineno, reason)
            continue
        stats.examples += 1
        examples.append(messages)
    if skipped_here > warned:
        logger.warning("%s: %d more malformed records skipped (not shown)", path, skipped_here - warned)
    return examples


def render_chat(tokenizer: Tokenizer, messages: Sequence[Message]) -> Tuple[List[int], List[int]]:
    """(token ids, target flags) of one conversation in the chat template (see module doc).

    ``targets[j] == 1`` when ``ids[j]`` is an assistant content token or the ``<|eos|>`` closing
    an assistant turn: the tokens the loss is taken on (as labels, one position earlier). A
    tokenizer with its own chat template (a Hugging Face checkpoint's) renders with that instead
    (``data/chat_template.py``).
    """
    if tokenizer.chat_template is not None:
        return chat_template.render_chat(tokenizer, messages)
    ids: List[int] = []
    targets: List[int] = []
    for m in messages:
        content = tokenizer.encode(m["content"])
        ids.append(tokenizer.role_id(m["role"]))
        targets.append(0)
        ids += content
        if m["role"] == "assistant":
            ids.append(tokenizer.eos_id)
            targets += [1] * (len(content) + 1)
        else:
            targets += [0] * len(content)
    return ids, targets


def build_generation_prompt(tokenizer: Tokenizer, messages: Sequence[Message]) -> List[int]:
    """Token ids that ask the model for the next assistant turn: the template of ``messages``
    (which must not end with an assistant message) followed by ``<|assistant|>``. Generate until
    ``tokenizer.eos_id``."""
    if messages and messages[-1]["role"] == "assistant":
        raise DataError("build_generation_prompt: the last message is already the assistant's")
    if tokenizer.chat_template is not None:
        return chat_template.generation_prompt(tokenizer, messages)
    ids, _ = render_chat(tokenizer, messages)
    return ids + [tokenizer.role_id("assistant")]


def split_for_generation(messages: Sequence[Message]) -> Tuple[List[Message], str]:
    """(context messages, reference answer) of a conversation: all but the last assistant message,
    and that message's content. For exact-match evaluation with :func:`build_generation_prompt`."""
    if not messages or messages[-1]["role"] != "assistant":
        raise DataError("split_for_generation: the conversation must end with an assistant message")
    return list(messages[:-1]), messages[-1]["content"]


def pack_examples(examples: Sequence[Tuple[List[int], List[int]]], seq_length: int, pad_id: int,
                  stats: Optional[InstructionStats] = None
                  ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy packing of (ids, targets) examples, in order, into rows of ``seq_length + 1``.

    Returns (rows int64 [R, seq_length+1] padded with ``pad_id``, target flags uint8 same shape,
    segment ids int64 same shape: the example's place in its row, the padding tail one more).
    Examples longer than ``seq_length + 1`` are skipped and counted in ``stats.too_long``.
    """
    if seq_length < 1:
        raise DataError(f"seq_length must be >= 1, got {seq_length}")
    stats = stats if stats is not None else InstructionStats()
    width = seq_length + 1
    rows: List[List[List[int]]] = []  # per row, its examples' ids
    flags: List[List[int]] = []
    cur_examples: List[List[int]] = []
    cur_flags: List[int] = []
    cur_len = 0
    for ids, targets in examples:
        if len(ids) > width:
            stats.too_long += 1
            continue
        if cur_len + len(ids) > width:
            rows.append(cur_examples)
            flags.append(cur_flags)
            cur_examples, cur_flags, cur_len = [], [], 0
        cur_examples.append(list(ids))
        cur_flags.extend(targets)
        cur_len += len(ids)
        stats.packed_examples += 1
    if cur_examples:
        rows.append(cur_examples)
        flags.append(cur_flags)
    out = np.full((len(rows), width), pad_id, dtype=np.int64)
    out_flags = np.zeros((len(rows), width), dtype=np.uint8)
    out_segments = np.zeros((len(rows), width), dtype=np.int64)
    for r, (row_examples, fl) in enumerate(zip(rows, flags)):
        start = 0
        for segment, ids in enumerate(row_examples):
            out[r, start:start + len(ids)] = ids
            out_segments[r, start:start + len(ids)] = segment
            start += len(ids)
        out_segments[r, start:] = len(row_examples)
        out_flags[r, :len(fl)] = fl
        stats.pad_tokens += width - start
    stats.rows = len(rows)
    stats.target_tokens = int(out_flags[:, 1:].sum())
    return out, out_flags, out_segments


def positions_in_segments(segment_ids: torch.Tensor) -> torch.Tensor:
    """Position ids that restart at 0 where the segment id changes (along the last dim)."""
    length = segment_ids.shape[-1]
    index = torch.arange(length, device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[..., 1:] = segment_ids[..., 1:] != segment_ids[..., :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - start_index


def packed_attention_mask(segment_ids_BS: torch.Tensor) -> torch.Tensor:
    """The attention mask of packed rows in Megatron's convention (bool [B, 1, S, S], True =
    masked): a token sees the tokens before it (and itself) of its own segment only."""
    length = segment_ids_BS.shape[-1]
    causal_SS = torch.ones(length, length, dtype=torch.bool,
                           device=segment_ids_BS.device).tril()
    same_BSS = segment_ids_BS.unsqueeze(-1) == segment_ids_BS.unsqueeze(-2)
    return ~(same_BSS & causal_SS).unsqueeze(1)


class InstructionDataset(torch.utils.data.Dataset):
    """Packed instruction samples from one or more JSONL files (see the module doc).

    Args:
        paths: a JSONL file or a list of them (read in the given order, then shuffled together).
        tokenizer: a :class:`~megatron_slmoe.data.tokenizer.Tokenizer` with the role tokens.
        seq_length: tokens per sample.
        seed: shuffling seed (example order before packing, and the row order of each epoch).
        num_samples: dataset length; ``None`` = one epoch (the number of packed rows). Larger values
            repeat the rows over epochs, each epoch in its own order.
        shuffle: ``False`` keeps file order and row order (e.g. for evaluation).
        max_warnings: malformed-record warnings logged per file.

    ``dataset[i]`` is a dict of ``tokens``, ``labels``, ``position_ids``, ``segment_ids`` (int64
    [seq_length]) and ``loss_mask`` (float32 [seq_length]). ``stats`` holds the counts; a summary
    is logged at INFO. A dataset with no usable example raises :class:`DataError`.
    """

    def __init__(self, paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]],
                 tokenizer: Tokenizer, seq_length: int, seed: int = 1234,
                 num_samples: Optional[int] = None, shuffle: bool = True, max_warnings: int = 20,
                 max_malformed_fraction: Optional[float] = None):
        super().__init__()
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.paths = [os.fspath(p) for p in paths]
        if not self.paths:
            raise DataError("InstructionDataset: no data files given")
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.tokenizer = tokenizer
        self.stats = InstructionStats()

        conversations: List[List[Message]] = []
        for p in self.paths:
            file_stats = InstructionStats()
            conversations += read_instruction_jsonl(p, file_stats, max_warnings=max_warnings)
            problem = (malformed_problem(file_stats, max_malformed_fraction)
                       if max_malformed_fraction is not None else None)
            if problem:
                raise DataError(f"{p}: {problem}")
            self.stats.records += file_stats.records
            self.stats.examples += file_stats.examples
            self.stats.malformed += file_stats.malformed
            for reason, count in file_stats.by_reason.items():
                self.stats.by_reason[reason] = self.stats.by_reason.get(reason, 0) + count
        self.conversations = conversations
        examples = [render_chat(tokenizer, m) for m in conversations]
        order = np.arange(len(examples))
        if self.shuffle:
            order = np.random.default_rng([self.seed, 0x5EED]).permutation(len(examples))
        self.rows, self.row_targets, self.row_segments = pack_examples(
            [examples[i] for i in order], self.seq_length, tokenizer.pad_id, self.stats)
        if self.stats.too_long:
            logger.warning("%s: %d examples longer than seq_length+1=%d tokens skipped",
                           ", ".join(self.paths), self.stats.too_long, self.seq_length + 1)
        if self.stats.rows == 0:
            raise DataError(f"no usable instruction examples in {', '.join(self.paths)} "
                            f"({self.stats.summary()})")
        self.num_samples = self.stats.rows if num_samples is None else int(num_samples)
        if self.num_samples < 0:
            raise DataError(f"num_samples must be >= 0, got {num_samples}")
        self._perms: Dict[int, np.ndarray] = {}
        logger.info("instruction data %s: %s", ", ".join(self.paths), self.stats.summary())

    @property
    def rows_per_epoch(self) -> int:
        return int(self.rows.shape[0])

    def row_index(self, idx: int) -> int:
        """The packed row that sample ``idx`` reads."""
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range [0, {self.num_samples})")
        epoch, within = divmod(int(idx), self.rows_per_epoch)
        if not self.shuffle:
            return within
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.rows_per_epoch)
            self._perms = {epoch: perm}      # epochs are read in order; keep one
        return int(perm[within])

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        r = self.row_index(idx)
        row = torch.from_numpy(self.rows[r])
        segment_ids = torch.from_numpy(self.row_segments[r, :-1].copy())
        return {
            "tokens": row[:-1].clone(),
            "labels": row[1:].clone(),
            "loss_mask": torch.from_numpy(self.row_targets[r, 1:].astype(np.float32)),
            "position_ids": positions_in_segments(segment_ids),
            "segment_ids": segment_ids,
        }
