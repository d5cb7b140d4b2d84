"""Start-up checks of a run's data and tokenizer, made before any process group forms: each
problem is one ConfigError line naming the flag and the file (or the URL).

What is checked: the sequence length and the attention mask against the model; the tokenizer
(loaded once, through the node cache if it is stored) against the model's vocabulary and against
the tokenizer a base or an adapter was trained with; the data files (not empty, not mostly
malformed; a stored instruction file is read from the node cache, where the run reads it); an
image-text dataset's folders, each split's metadata and first usable sample.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Optional

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.data.config import DataConfig
from megatron_slmoe.data.errors import DataError
from megatron_slmoe.data.image_text import ImageTextDataset, node_view
from megatron_slmoe.data.instruction import (
    InstructionStats,
    malformed_problem,
    read_instruction_jsonl,
)
from megatron_slmoe.data.pretrain import load_indexed_dataset
from megatron_slmoe.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_source
from megatron_slmoe.model.config import VisionConfig
from megatron_slmoe.model.hf_vision import HFImportError, check_hf_vision_checkpoint
from megatron_slmoe.storage import Storage, StorageError, is_object_url


def check_model_fits_data(data: DataConfig, model_config) -> None:
    """The model config (``model.model_file.ModelConfig``) against what the data asks of it."""
    if data.format == "instruction" and model_config.transformer.get("masked_softmax_fusion"):
        # Megatron's fused causal softmax (GPU, 16-bit) takes no mask: packed examples would see
        # each other again.
        raise ConfigError(f"{model_config.source}: masked_softmax_fusion: true would drop the "
                          f"attention mask that keeps packed instruction examples apart; set it "
                          f"to false")
    if data.seq_length > model_config.max_sequence_length:
        raise ConfigError(f"--seq-length {data.seq_length} exceeds the model's "
                          f"max_sequence_length {model_config.max_sequence_length} "
                          f"({model_config.source})")


def open_tokenizer(data: DataConfig, storage: Storage, vocab_size: int,
                   hf_checkpoint: Optional[str] = None,
                   base_checkpoint: Optional[str] = None) -> Tokenizer:
    """The run's tokenizer (``tokenizer.tokenizer_source``: the flag's, else the base's, else the
    shipped one; through the node cache if it is an object), no larger than the model's
    ``vocab_size``."""
    try:
        source = tokenizer_source(data.tokenizer, hf_checkpoint, base_checkpoint)
        tokenizer = load_tokenizer(storage.local_file(source))
    except (DataError, StorageError) as err:
        flag = "--tokenizer" if data.tokenizer or not hf_checkpoint else \
            "--hf-checkpoint (its tokenizer; or pass --tokenizer)"
        raise ConfigError(f"{flag}: {err}") from None
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"--tokenizer {data.tokenizer or tokenizer.path} has "
                          f"{tokenizer.vocab_size} tokens, more than the model's vocab_size "
                          f"{vocab_size}")
    return tokenizer


def check_same_tokenizer(tokenizer: Tokenizer, recorded_path: str, what: str) -> None:
    """``tokenizer`` is the one recorded at ``recorded_path`` (``what``: whose it is)."""
    try:
        recorded = load_tokenizer(recorded_path)
    except DataError as err:
        raise ConfigError(f"{what}: {err}") from None
    if recorded.fingerprint != tokenizer.fingerprint:
        raise ConfigError(f"--tokenizer {tokenizer.path} is not {what}: pass --tokenizer "
                          f"{recorded_path}")


def check_local_image_text(data: DataConfig, vision: VisionConfig) -> None:
    """Local image-text datasets are energon folders; a ``--vision-checkpoint`` is readable and
    fits the tower."""
    for flag, path in (("--train-data", data.train_data), ("--valid-data", data.valid_data)):
        # An object-storage dataset is checked the same way once on the node (check_image_text).
        if path and not is_object_url(path) and not os.path.isdir(os.path.join(path, ".nv-meta")):
            raise ConfigError(f"{flag} {path}: not an energon dataset folder (prepare one with "
                              f"tools/prepare_image_text.py)")
    if vision.checkpoint:
        try:
            check_hf_vision_checkpoint(vision.checkpoint, vision)
        except HFImportError as err:
            raise ConfigError(f"--vision-checkpoint {vision.checkpoint}: {err}") from None


def check_image_text(data: DataConfig, caption_prompt: str, storage: Storage,
                     tokenizer: Tokenizer, images) -> None:
    """Each split opens, its shards are whole, and it has a usable sample (the first good record
    in split order; a dataset of bad records is refused, not trained on as skips). ``images``:
    how the run's model takes images (``data.image_inputs``)."""
    if not data.train_data:
        return  # the shapes task, made by the run itself
    views = {}  # one view of a prefix that is both the training and the held-out data
    try:
        for flag, path, split in (("--train-data", data.train_data, "train"),
                                  ("--valid-data", data.valid_data or data.train_data, "val")):
            if path not in views:  # on object storage: the metadata now
                try:
                    views[path] = node_view(storage, path)
                except StorageError as err:
                    raise ConfigError(f"{flag}: {err}") from None
                except DataError as err:
                    raise ConfigError(f"{flag} {err}") from None
            local, stored = views[path]
            try:  # the first usable sample's shard: a download the run needs anyway
                ImageTextDataset(local, tokenizer, data.seq_length, split=split, images=images,
                                 caption_prompt=caption_prompt, max_warnings=0, stored=stored)
            except (DataError, StorageError) as err:
                raise ConfigError(f"{flag}: {err}") from None
    finally:
        for _, stored in views.values():
            if stored is not None:
                stored.close()


def check_text_data(data: DataConfig, storage: Storage) -> None:
    """A local indexed dataset holds documents; every instruction file (the node's copy of a
    stored one, which the run reads) passes ``check_instruction_file``."""
    if data.format == "pretrain":
        if data.train_data and not is_object_url(data.train_data):
            check_indexed(data.train_data)
        return
    for flag, path in (("--train-data", data.train_data), ("--valid-data", data.valid_data)):
        if not path:
            continue
        try:  # stored files (an object, or those under a prefix): the node's copies, which the
            names = storage.expand(path, ".jsonl")  # run reads (checked before it starts)
            local = storage.local_files(names)
        except StorageError as err:
            raise ConfigError(f"{flag}: {err}") from None
        for name, copy in zip(names, local):
            check_instruction_file(flag, str(name), data.max_malformed_fraction, copy)


def check_indexed(prefix: str) -> None:
    try:
        dataset = load_indexed_dataset(prefix)
    except DataError as err:
        raise ConfigError(f"--train-data {prefix}: {err}") from None
    if len(dataset) == 0:
        raise ConfigError(f"--train-data {prefix}: the indexed dataset holds no documents")


def check_instruction_file(flag: str, path: str, max_malformed: float,
                           local: Optional[str] = None) -> None:
    """Not empty, some well-formed records, and at most the allowed share of malformed ones
    (``local``: where the file ``path`` names is read, the node's copy of a stored one)."""
    local = local or path
    stats = InstructionStats()
    with _first_warning("megatron_slmoe.data.instruction") as first:
        read_instruction_jsonl(local, stats, max_warnings=1)
    problem = malformed_problem(stats, max_malformed)
    if problem:
        example = f"; the first: {first[0].replace(local, path)}" if first and stats.records else ""
        raise ConfigError(f"{flag} {path}{':' if stats.records else ''} {problem}{example}")


@contextlib.contextmanager
def _first_warning(logger_name: str):
    """Collect a logger's warnings instead of printing them (the first names the problem)."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger(logger_name)
    handler, propagate = Collect(level=logging.WARNING), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
