"""Plain text -> Megatron ``.bin/.idx`` -> fixed-length causal-LM samples.

:func:`preprocess` (the engine of ``tools/preprocess_data.py``) tokenizes documents and writes them
with Megatron-Core's ``IndexedDatasetBuilder``: one sequence per document, the document's tokens
followed by ``<|eos|>``, token dtype ``DType.optimal_dtype(vocab_size)`` (uint16 below 65500).
Documents are

- ``.jsonl``: the string field ``json_key`` (default ``text``) of each line's object; bad JSON,
  a missing or non-string field and empty text are counted and skipped with a warning
  ``FILE:LINE: ...``;
- any other file, read as UTF-8 text: paragraphs separated by blank lines (newlines inside a
  paragraph are kept), or one document per line with ``document_per_line=True``; a line that is
  not valid UTF-8 is counted and skipped with a warning ``FILE:LINE: ...``.

Output files are written under temporary names and renamed when complete.

:func:`build_pretrain_datasets` serves samples from them through Megatron-Core's own
``BlendedMegatronDatasetBuilder`` and ``GPTDataset`` (document shuffling, sample index, epochs,
train/valid/test split by document, index cache). Its sample-index builder is the C++ ``helpers``
extension, which the megatron-core wheel ships compiled (``megatron/core/datasets/helpers_cpp``);
nothing is compiled or downloaded at run time. Samples are dicts of ``tokens``, ``labels``,
``position_ids`` (int64 [seq_length]) and ``loss_mask`` (float32 [seq_length]): the usual GPT
convention, position ids running across documents and one causal mask over the sequence
(``reset_position_ids=False``, ``reset_attention_mask=False``, ``eod_mask_loss=False``), the same
convention as ``data/instruction.py``.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from megatron_slmoe.data.errors import DataError, DataFileNotFoundError, require_file
from megatron_slmoe.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class PreprocessStats:
    documents: int = 0            # documents written
    tokens: int = 0               # tokens written, EOS included
    skipped: int = 0              # bad records skipped (see by_reason)
    by_reason: Dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str) -> None:
        self.skipped += 1
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1


def _documents(path: str, json_key: str, document_per_line: bool, stats: PreprocessStats,
               max_warnings: int) -> Iterator[str]:
    warned = [0]

    def bad(lineno: int, reason: str, key: str) -> None:
        stats.skip(key)
        if warned[0] < max_warnings:
            warned[0] += 1
            logger.warning("%s:%d: skipped: %s", path, lineno, reason)

    with open(path, "rb") as f:
        if path.endswith(".jsonl"):
            for lineno, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except ValueError as exc:
                    bad(lineno, f"bad json ({exc})", "bad json")
                    continue
                if not isinstance(record, dict) or json_key not in record:
                    bad(lineno, f"no '{json_key}' field", "missing key")
                    continue
                text = record[json_key]
                if not isinstance(text, str):
                    bad(lineno, f"'{json_key}' is {type(text).__name__}, not a string", "wrong type")
                    continue
                if not text.strip():
                    bad(lineno, f"'{json_key}' is empty", "empty")
                    continue
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    bad(lineno, "text is not valid UTF-8", "invalid utf-8")
                    continue
                yield text
        else:
            paragraph: List[str] = []
            for lineno, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError:
                    bad(lineno, "line is not valid UTF-8", "invalid utf-8")
                    continue
                if document_per_line:
                    if line.strip():
                        yield line
                elif line.strip():
                    paragraph.append(line)
                elif paragraph:
                    yield "\n".join(paragraph)
                    paragraph = []
            if paragraph:
                yield "\n".join(paragraph)
    if stats.skipped > warned[0]:
        logger.warning("%s: %d more bad records skipped (not shown)", path, stats.skipped - warned[0])


def preprocess(input_path: str, tokenizer: Tokenizer, output_prefix: str, json_key: str = "text",
               document_per_line: bool = False, append_eos: bool = True, max_warnings: int = 20,
               chunk_docs: int = 1024) -> PreprocessStats:
    """Tokenize ``input_path`` into ``output_prefix.bin`` / ``output_prefix.idx`` (see module doc)."""
    from megatron.core.datasets.indexed_dataset import (DType, IndexedDatasetBuilder, get_bin_path,
                                                        get_idx_path)

    input_path = require_file(input_path, "input file")
    output_prefix = os.fspath(output_prefix)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    bin_path, idx_path = get_bin_path(output_prefix), get_idx_path(output_prefix)
    tmp = f".tmp.{os.getpid()}"
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    stats = PreprocessStats()
    builder = IndexedDatasetBuilder(bin_path + tmp, dtype=dtype)
    try:
        def flush(texts: List[str]) -> None:
            for ids in tokenizer.encode_batch(texts):
                if append_eos:
                    ids = ids + [tokenizer.eos_id]
                builder.add_document(np.asarray(ids, dtype=dtype), [len(ids)])
                stats.documents += 1
                stats.tokens += len(ids)

        chunk: List[str] = []
        for text in _documents(input_path, json_key, document_per_line, stats, max_warnings):
            chunk.append(text)
            if len(chunk) >= chunk_docs:
                flush(chunk)
                chunk = []
        if chunk:
            flush(chunk)
        builder.finalize(idx_path + tmp)
        if stats.documents == 0:
            raise DataError(f"no documents in {input_path} ({stats.skipped} bad records skipped)")
        os.replace(bin_path + tmp, bin_path)
        os.replace(idx_path + tmp, idx_path)
    finally:
        if not builder.data_file.closed:
            builder.data_file.close()
        for p in (bin_path + tmp, idx_path + tmp):
            if os.path.exists(p):
                os.remove(p)
    logger.info("%s -> %s.{bin,idx}: %d documents, %d tokens, %d bad records skipped",
                input_path, output_prefix, stats.documents, stats.tokens, stats.skipped)
    return stats


def load_indexed_dataset(prefix: str):
    """Megatron's ``IndexedDataset`` at ``prefix`` (``prefix.bin`` + ``prefix.idx``); a one-line
    error when either file is missing."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path

    prefix = os.fspath(prefix)
    for p in (get_idx_path(prefix), get_bin_path(prefix)):
        if not os.path.isfile(p):
            raise DataFileNotFoundError(f"indexed dataset file not found: {p} "
                                        "(make it with tools/preprocess_data.py)")
    # Megatron's reader asserts on a foreign file and its half-built objects then print
    # "Exception ignored" tracebacks when collected: look at the header first.
    from megatron_slmoe.compat.megatron import INDEX_HEADER

    with open(get_idx_path(prefix), "rb") as f:
        if f.read(len(INDEX_HEADER)) != INDEX_HEADER:
            raise DataError(f"not a valid indexed dataset: {prefix} ({get_idx_path(prefix)} "
                            f"does not start with Megatron's index header)")
    try:
        return IndexedDataset(prefix)
    except (AssertionError, ValueError, struct.error) as exc:
        raise DataError(f"not a valid indexed dataset: {prefix} ({exc})") from None


def build_pretrain_datasets(
    data_prefix: Union[str, Sequence[str]],
    tokenizer: Tokenizer,
    seq_length: int,
    train_samples: int,
    valid_samples: int = 0,
    test_samples: int = 0,
    seed: int = 1234,
    split: str = "98,2,0",
    cache_dir: Optional[str] = None,
    is_built_on_rank: Optional[Callable[[], bool]] = None,
    create_attention_mask: bool = False,
) -> Tuple[Optional[object], Optional[object], Optional[object]]:
    """(train, valid, test) Megatron ``GPTDataset``\\ s (or ``BlendedDataset`` for several prefixes)
    over preprocessed data; a split is ``None`` when its share in ``split`` is 0.

    Args:
        data_prefix: one prefix or several (blended in proportion to their size).
        train_samples / valid_samples / test_samples: samples to draw per split (documents are
            repeated over epochs, reshuffled, as needed).
        split: Megatron's train,valid,test document split, e.g. ``"98,2,0"``.
        cache_dir: where Megatron writes its index cache (``.npy`` files); default
            ``<dir of the first prefix>/index-cache``. Must be writable and, with several ranks,
            the same for all.
        is_built_on_rank: Megatron's callable; default every rank builds (rank 0 first).
        create_attention_mask: also return Megatron's ``attention_mask`` (bool [1, S, S]).

    Must be called on all ranks when ``torch.distributed`` is initialized (Megatron's builder uses
    barriers). Collective-free otherwise.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    prefixes = [os.fspath(data_prefix)] if isinstance(data_prefix, (str, os.PathLike)) else [
        os.fspath(p) for p in data_prefix]
    if not prefixes:
        raise DataError("build_pretrain_datasets: no data prefix given")
    for prefix in prefixes:
        load_indexed_dataset(prefix)          # checks existence and the header, one-line errors
    if cache_dir is None:
        cache_dir = os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "index-cache")
    config = GPTDatasetConfig(
        random_seed=int(seed),
        sequence_length=int(seq_length),
        blend=(prefixes, None),
        split=split,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=create_attention_mask,
    )
    builder = BlendedMegatronDatasetBuilder(
        GPTDataset, [int(train_samples), int(valid_samples), int(test_samples)],
        is_built_on_rank or (lambda: True), config)
    train, valid, test = builder.build()
    return train, valid, test
