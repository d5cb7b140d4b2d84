"""Image-text samples from energon datasets, for the multimodal model.

**Datasets.** A dataset is a folder of WebDataset tar shards prepared for megatron-energon (its
``.nv-meta/`` holds ``dataset.yaml``, ``split.yaml``, ``.info.json`` and the sample index); make
one with ``tools/prepare_image_text.py`` (``data/image_text_prepare.py``) or ``energon prepare``.
Three sample types are read:

=============  =================================  ============================================
``caption``    energon ``CaptioningSample``        user: ``caption_prompt``; assistant: caption
``vqa``        energon ``VQASample``               user: context (``<image>`` put first when the
                                                   context has none); assistant: first answer
``chat``       energon ``CrudeWebdataset`` sample  ``json``: ``{"messages": [...]}`` (the instruction
               (json + image and video parts)      format of ``data/instruction.py``); images: the
                                                   parts with an image extension, in part-name
                                                   order; clips (``<video>`` marks): the parts with
                                                   a video extension (``data/video.py`` decodes
                                                   them, the family's processor samples frames)
=============  =================================  ============================================

Reading goes through energon's own pieces: ``get_dataset_from_config`` builds the factory that
``dataset.yaml`` names (its field map or sample loader decides the fields), and energon's
``ShardInfosITarReader`` gives random access to sample ``j`` of the split through the tar
indices. Our decoder parses ``.json`` parts and leaves images as bytes, decoded here so that a bad
image is a counted skip, not an exception inside the loader.

**Samples.** The conversation is rendered with the chat template of ``data/instruction.py`` (or
the checkpoint's own); each ``<image>`` in a message becomes what the model's image input
(``data/image_inputs.py``) makes of it: one placeholder that LLaVAModel widens to the image's
tiles, or the placeholder repeated once per merged patch for a native-resolution tower.
``dataset[i]`` is a dict: ``tokens``, ``labels`` (int64 [S]), ``loss_mask`` (float32 [S], 1 on
assistant tokens) and the image input's tensors (``images`` and ``num_image_tiles``, or
``pixel_values`` and ``image_grid_thw``). Its text plus image positions fill at most S
(``seq_length``): the tail is padding (LLaVAModel cuts it, so the combined sequence is exactly S).

**Order and resuming.** As with the text data, sample ``i`` is record ``perm_e[i mod n]`` of
epoch ``e = i // n`` (a permutation per epoch from ``(seed, e)``; none with ``shuffle=False``), so
the number of consumed samples is the whole position of a run (``data/sampler.py``).

**Bad samples** are skipped, never a crash and never a wrong sample: sample ``i`` then reads the
next record of the epoch order (deterministic, the same on every rank and after a resume). Each
bad record is counted once per process by reason and logged with its shard and key (the first
``max_warnings``):

* ``undecodable image``: truncated, corrupt or non-image bytes (``data/image.py``);
* ``image count mismatch``: the ``<image>`` marks in the text do not match the images (or the
  rendered text holds the model's image placeholder where no image goes);
* ``path escapes dataset``: a tar member path that is absolute or climbs with ``..``;
* ``malformed record``: missing or wrongly typed fields, bad JSON, bad turn order;
* ``too long``: the text and image positions do not fit in ``seq_length``.
* ``undecodable video``: a clip that is empty, corrupt, of an unsupported codec, frameless, longer
  than the limit, of frames of different sizes, or refused by the video processor;
* ``video count mismatch``: the ``<video>`` marks do not match the clips (or the model takes no
  videos).

The records a rank found bad are in ``dataset.stats``; :func:`reduce_skip_counts` counts the
distinct bad records over the data-parallel ranks (ranks may meet the same one) for the run's log
and metrics.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import struct
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_slmoe.data.config import IMAGE_TOKEN, VIDEO_TOKEN
from megatron_slmoe.data.errors import DataError
from megatron_slmoe.data.image import ImageDecodeError
from megatron_slmoe.data.image_inputs import (
    TEXT_ONLY,
    ImageCountMismatch,
    TiledImages,
    media_marks,
)
from megatron_slmoe.data.video import VideoDecodeError
from megatron_slmoe.data.instruction import (
    MalformedRecord,
    build_generation_prompt,
    parse_record,
    render_chat,
    split_for_generation,
)
from megatron_slmoe.data.sampler import RankReads, ReadAhead
from megatron_slmoe.data.tokenizer import Tokenizer
from megatron_slmoe.storage.urls import is_object_url

logger = logging.getLogger(__name__)


KINDS = ("caption", "vqa", "chat")
REASONS = ("undecodable image", "image count mismatch", "path escapes dataset",
           "malformed record", "too long", "undecodable video", "video count mismatch")
IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "webp", "bmp", "gif", "tif", "tiff")
VIDEO_EXTENSIONS = ("mp4", "webm", "mkv", "mov", "avi", "m4v")
DEFAULT_CAPTION_PROMPT = f"{IMAGE_TOKEN}\nDescribe the image."
READ_AHEAD = 256
"""How far ahead of the reader (in samples) the next shards to fetch are looked for, when the
dataset is on object storage (``--prefetch-shards`` of them at a time)."""


class BadSample(ValueError):
    """A record that cannot become a correct sample; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass
class ImageTextStats:
    """What one process met: samples made, and the bad records (``(path, split, record)``) by
    reason."""

    samples: int = 0
    bad: Dict[str, set] = field(default_factory=lambda: {r: set() for r in REASONS})

    @property
    def skipped(self) -> Dict[str, int]:
        """Bad records by reason."""
        return {reason: len(records) for reason, records in self.bad.items()}

    @property
    def total_skipped(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        reasons = ", ".join(f"{k}: {v}" for k, v in self.skipped.items() if v)
        return (f"{self.samples} samples, {self.total_skipped} bad records skipped"
                f"{f' ({reasons})' if reasons else ''}")


# --- records -> conversations ---------------------------------------------------------------------


def image_marks(messages: Sequence[Dict[str, str]]) -> int:
    return sum(m["content"].count(IMAGE_TOKEN) for m in messages)


def check_image_count(messages: Sequence[Dict[str, str]], num_images: int) -> None:
    """BadSample unless the messages mark exactly ``num_images`` images."""
    marks = image_marks(messages)
    if marks != num_images:
        raise BadSample("image count mismatch",
                        f"the text marks {marks} {IMAGE_TOKEN} but the sample has {num_images} "
                        f"image(s)")


def _part_order(name: str) -> Tuple:
    """Natural order of part names: img2.png before img10.png."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def _image_parts(sample: dict, extensions: Sequence[str] = IMAGE_EXTENSIONS) -> List[bytes]:
    names = [k for k in sample if not k.startswith("__")
             and k.rsplit(".", 1)[-1].lower() in extensions]
    return [sample[k] for k in sorted(names, key=_part_order)]


@dataclass
class MediaParts:
    """A record's encoded images and video clips, in part-name order."""

    images: List[bytes]
    videos: List[bytes] = field(default_factory=list)


def videos_of(sample, messages: Sequence[Dict[str, str]]) -> List[bytes]:
    """The clips of an energon sample (the parts of a chat record with a video extension);
    BadSample unless its ``<video>`` marks match them."""
    from megatron.energon import CrudeSample

    videos = _image_parts(sample, VIDEO_EXTENSIONS) if isinstance(sample, CrudeSample) else []
    marks = sum(m["content"].count(VIDEO_TOKEN) for m in messages)
    if marks != len(videos):
        raise BadSample("video count mismatch", f"the text marks {marks} {VIDEO_TOKEN} but the "
                                                f"sample has {len(videos)} video(s)")
    return videos


def _text(value, what: str) -> str:
    if not isinstance(value, str):
        raise BadSample("malformed record", f"{what} must be a string, got {type(value).__name__}")
    return value


def _image_bytes(value, what: str) -> bytes:
    if not isinstance(value, (bytes, bytearray)):
        raise BadSample("malformed record", f"{what} is missing or not raw image bytes")
    return bytes(value)


def conversation_of(sample, caption_prompt: str = DEFAULT_CAPTION_PROMPT
                    ) -> Tuple[List[Dict[str, str]], List[bytes]]:
    """(messages, encoded images) of an energon sample (see the module doc); BadSample if the
    record is malformed or its ``<image>`` marks do not match its images."""
    from megatron.energon import CaptioningSample, CrudeSample, VQASample

    if isinstance(sample, CaptioningSample):
        images = [_image_bytes(sample.image, "image")]
        messages = [{"role": "user", "content": caption_prompt},
                    {"role": "assistant", "content": _text(sample.caption, "caption")}]
    elif isinstance(sample, VQASample):
        images = [_image_bytes(sample.image, "image")]
        context = _text(sample.context, "context")
        if IMAGE_TOKEN not in context:
            context = f"{IMAGE_TOKEN}\n{context}"
        answers = sample.answers
        if not isinstance(answers, (list, tuple)) or not answers:
            raise BadSample("malformed record", "answers must be a non-empty list")
        messages = [{"role": "user", "content": context},
                    {"role": "assistant", "content": _text(answers[0], "answers[0]")}]
    elif isinstance(sample, CrudeSample):
        record = sample.get("json")
        if not isinstance(record, dict) or "messages" not in record:
            raise BadSample("malformed record", "the json part must be an object with 'messages'")
        try:
            messages = parse_record({"messages": record["messages"]})
        except MalformedRecord as err:
            raise BadSample("malformed record", str(err)) from None
        images = _image_parts(sample)
    else:
        raise BadSample("malformed record", f"unsupported sample type {type(sample).__name__}")
    if not messages or messages[-1]["role"] != "assistant" or not messages[-1]["content"].strip():
        raise BadSample("malformed record", "the conversation must end with an assistant answer")
    check_image_count(messages, len(images))
    return messages, images


def escaping_path(path: str) -> bool:
    """Whether a tar member path is absolute or leaves its folder (``..``)."""
    normal = posixpath.normpath(path.replace("\\", "/"))
    return normal.startswith("/") or normal == ".." or normal.startswith("../") or ":" in normal[:2]


# --- energon access -------------------------------------------------------------------------------


class _JsonPartsDecoder:
    """Energon sample decoder: ``.json`` parts parsed, everything else (images) left as bytes."""

    def __call__(self, sample: dict) -> dict:
        out = dict(sample)
        for key, value in sample.items():
            if not key.startswith("__") and key.rsplit(".", 1)[-1] == "json":
                try:
                    out[key] = json.loads(value)
                except (ValueError, UnicodeDecodeError) as err:
                    raise BadSample("malformed record", f"{key}: bad json ({err})") from None
        return out

    def config(self) -> dict:
        return {"decoder": type(self).__name__}


def energon_metadata(name: str) -> bool:
    """Whether a file of an energon dataset is needed to open it (everything but the tar shards:
    ``.nv-meta/*`` and the tar indices), as a ``StoredFolder`` fetches them first."""
    return not name.endswith(".tar")


def node_view(storage, path: str):
    """(local folder, StoredFolder or None) of a dataset setting: a local folder as it is; one on
    object storage as this node's view of it (``storage``: a ``storage.Storage``), its metadata
    fetched now and its shards as they are read (each once per node, through the node cache)."""
    if not is_object_url(path):
        return path, None
    stored = storage.stored_folder(path, energon_metadata)
    if not os.path.isdir(os.path.join(stored.directory, ".nv-meta")):
        raise DataError(f"{path}: not an energon dataset (no .nv-meta/ under the prefix; "
                        f"prepare one with tools/prepare_image_text.py and upload the folder)")
    return stored.directory, stored


def open_energon_split(path: str, split: str, stored=None):
    """(factory, reader) of one split of an energon dataset: the factory ``dataset.yaml`` names and
    energon's random-access reader over the split's shards. One DataError line if it is unusable.
    ``stored``: the dataset's ``StoredFolder`` when its shards come from object storage as read."""
    from megatron.energon import WorkerConfig
    from megatron.energon.dataset_config import get_dataset_from_config
    from megatron.energon.flavors.webdataset.itar_reader import ShardInfosITarReader

    shown = dataset_name(path, stored)
    if not os.path.isdir(os.path.join(path, ".nv-meta")):
        raise DataError(f"{shown}: not an energon dataset (no .nv-meta folder; prepare it with "
                        f"tools/prepare_image_text.py or 'energon prepare')")
    try:
        factory = get_dataset_from_config(
            path, split_part=split, training=False, decoder=_JsonPartsDecoder(),
            worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    except Exception as err:  # energon raises asserts, KeyErrors, YAML errors ...
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"{shown}: cannot open split {split!r} of the energon dataset: "
                        f"{reason}") from None
    if not getattr(factory, "shards", None):
        raise DataError(f"{shown}: split {split!r} has no shards")
    _check_shards(path, factory.shards, stored)
    reader = ShardInfosITarReader(factory.path, factory.shards, part_filter=factory.part_filter,
                                  sample_filter=factory.sample_filter)
    return factory, reader


def dataset_name(path: str, stored=None) -> str:
    """The dataset as the user named it: its object-storage prefix when it is read from there
    (``path`` is then the node cache's copy), else ``path``."""
    return str(stored.prefix).rstrip("/") if stored is not None else path


def shard_name(path: str, shard) -> str:
    """A shard's file name relative to the dataset folder, ``/``-separated."""
    return os.path.relpath(str(shard.path), path).replace(os.sep, "/")


def _check_shards(path: str, shards, stored=None) -> None:
    """Every shard is there and whole: its tar index (written when the dataset was prepared)
    ends within the file (for a shard still on the object store: within the object). One
    DataError line naming the shard."""
    from megatron.energon.flavors.webdataset.itar import TarIndexReader

    shown = dataset_name(path, stored)
    for shard in shards:
        tar = str(shard.path)
        remote = stored is not None and shard_name(path, shard) in stored.lazy
        if not remote and not os.path.isfile(tar):
            raise DataError(f"{shown}: shard {shard.name} is missing")
        try:
            with TarIndexReader(tar) as index:
                end = index[len(index) - 1] if len(index) else 0
        except (OSError, IndexError, struct.error) as err:
            raise DataError(f"{shown}: shard {shard.name} has no readable index ({err}; prepare "
                            f"the dataset again)") from None
        size = stored.size(shard_name(path, shard)) if remote else os.path.getsize(tar)
        if end > size:
            raise DataError(f"{shown}: shard {shard.name} is truncated: its index reaches byte "
                            f"{end}, the file has {size} (an incomplete copy?)")


# --- the dataset ----------------------------------------------------------------------------------


class ImageTextDataset(torch.utils.data.Dataset):
    """Image-text samples of one split of an energon dataset (see the module doc).

    Args:
        path: the dataset folder (with ``.nv-meta``).
        tokenizer: a tokenizer with the chat role tokens.
        seq_length: S, the combined text + image positions of a sample.
        images: how the model takes images (``data/image_inputs.py``: ``TiledImages`` or
            ``NativeResolutionImages``).
        split: energon split part ('train', 'val', ...).
        caption_prompt: the user turn of captioning samples.
        seed: order of the records; num_samples: length (default one epoch); shuffle: False keeps
            the split's order; max_warnings: bad-record warnings logged.
        stored: the dataset as a ``storage.StoredFolder`` (``path`` is its local directory) when
            it is on object storage: a shard is fetched when a sample of it is read, and the next
            shards the reader will need (within its next ``READ_AHEAD`` samples) in the
            background.
        reads: the positions this process reads (``data.sampler.RankReads``: its data-parallel
            share of each global batch), which read-ahead follows; None: every position.
    """

    def __init__(self, path: str, tokenizer: Tokenizer, seq_length: int, *, images,
                 split: str = "train",
                 caption_prompt: str = DEFAULT_CAPTION_PROMPT, seed: int = 1234,
                 num_samples: Optional[int] = None, shuffle: bool = True, max_warnings: int = 20,
                 stored=None, reads: Optional[RankReads] = None):
        super().__init__()
        self.path, self.split = os.fspath(path), split
        self.stored = stored
        self.name = dataset_name(self.path, stored)  # in every line: the user's name for it
        self._shard_names: Optional[List[str]] = None
        self.factory, self._reader = open_energon_split(self.path, split, stored)
        self._reader_pid = os.getpid()
        self.records = len(self._reader)
        if self.records == 0:
            raise DataError(f"{self.name}: split {split!r} is empty")
        self.tokenizer = tokenizer
        self.images = images
        self.tokens = images.tokenizer(tokenizer)
        self.seq_length = int(seq_length)
        self.caption_prompt = caption_prompt
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.num_samples = self.records if num_samples is None else int(num_samples)
        self._read_ahead = ReadAhead(reads, READ_AHEAD, self.num_samples)
        self.max_warnings = max_warnings
        self.stats = ImageTextStats()
        self._bad: Dict[int, str] = {}
        self._perms: Dict[int, np.ndarray] = {}
        self._warned = 0
        logger.info("image-text data %s [%s]: %d records in %d shards", self.name, split,
                    self.records, len(self._reader.tar_filenames))
        self.first_usable()

    def first_usable(self) -> int:
        """The first record in split order that makes a sample; DataError when none does (a
        dataset of bad records is bad input, not an epoch of skips)."""
        samples = self.stats.samples  # a probe, not a sample the run read
        for record in range(self.records):
            if self._try(record) is not None:
                self.stats.samples = samples
                return record
        raise DataError(f"{self.name} [{self.split}]: no usable sample: every one of its "
                        f"{self.records} records is bad ({self.stats.summary()})")

    def __len__(self) -> int:
        return self.num_samples

    @property
    def reader(self):
        """Energon's tar reader, its open shard files this process's own: a DataLoader worker
        forked after reads would share their file offsets with its parent and siblings (reads
        interleave: "Inconsistent sample base name"), so a new process reopens them."""
        if self._reader_pid != os.getpid():
            self._reader.close()
            self._reader_pid = os.getpid()
        return self._reader

    @property
    def captioning(self) -> bool:
        """Whether the split holds energon captioning samples."""
        from megatron.energon import CaptioningSample

        return issubclass(getattr(self.factory, "__sample_type__", object), CaptioningSample)

    def record_index(self, position: int) -> int:
        """The record read at position ``position`` of the (epoch-repeated) order."""
        epoch, within = divmod(int(position), self.records)
        if not self.shuffle:
            return within
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.records)
            self._perms = {epoch: perm}
        return int(perm[within])

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range [0, {self.num_samples})")
        if self.stored is not None:
            self._fetch_ahead(idx)
        for offset in range(self.records):
            sample = self._try(self.record_index(idx + offset))
            if sample is not None:
                return sample
        raise DataError(f"{self.name} [{self.split}]: every record is bad "
                        f"({self.stats.summary()})")

    # -- one record ----------------------------------------------------------------------------

    def _try(self, record: int) -> Optional[Dict[str, torch.Tensor]]:
        if record in self._bad:
            return None
        try:
            messages, images, _ = self._read(record)
            return self._encode(messages, images)
        except BadSample as err:
            self._skip(record, err)
            return None

    def _fetch_ahead(self, idx: int) -> None:
        """Offer the shards of this process's next ``READ_AHEAD`` samples after ``idx``, in read
        order, for fetching in the background; positions already offered and taken are
        skipped."""
        offer = self._read_ahead.offer(idx)
        if offer:
            self._read_ahead.taken(offer, self.stored.prefetch(
                self._shard_of(self.record_index(p)) for p in offer))

    def _shard_index(self, record: int) -> int:
        """The index of the shard that holds ``record`` in the split's shard list."""
        from bisect import bisect_right

        return bisect_right(self._reader.shard_count_cumsum, record) - 1

    def _shard_of(self, record: int) -> str:
        """The name of the shard that holds ``record`` (relative to the dataset folder)."""
        if self._shard_names is None:
            self._shard_names = [shard_name(self.path, s) for s in self._reader.shard_infos]
        return self._shard_names[self._shard_index(record)]

    def _fetch_shard(self, record: int) -> None:
        """The shard of ``record`` and its tar index on this node (fetched again if the cache
        evicted them); a StorageError is the store's or the cache's problem, not the data's."""
        shard = self._shard_of(record)
        for name in (shard + ".idx", shard):
            if self.stored.size(name) is not None:
                self.stored.path(name)

    def _read(self, record: int):
        for attempt in range(2):
            if self.stored is not None:
                self._fetch_shard(record)
            try:
                raw = self.reader[record]
                break
            except Exception as err:  # noqa: BLE001  (a damaged tar: energon, tarfile errors)
                if isinstance(err, FileNotFoundError) and self.stored is not None and not attempt:
                    continue  # the cache evicted it before energon opened it: fetch it again
                reason = " ".join(str(err).split())[:200] or type(err).__name__
                raise DataError(f"{self.name} [{self.split}]: {self._where(record)} cannot be "
                                f"read ({reason}): a damaged shard") from None
        if raw is None:  # excluded by split.yaml
            raise BadSample("malformed record", "excluded by the split config")
        where = f"{raw['__shard__']}: sample {raw['__key__']!r}"
        names = [raw["__key__"], *(n for s in raw.get("__sources__", ()) for n in s.file_names)]
        escaping = [n for n in names if escaping_path(n)]
        if escaping:
            raise BadSample("path escapes dataset", f"tar member {escaping[0]!r} leaves the "
                                                    f"dataset folder")
        try:
            sample = self.factory.load_sample(raw)
        except BadSample:
            raise
        except Exception as err:  # energon's field access and sample construction
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise BadSample("malformed record", reason) from None
        messages, images = conversation_of(sample, self.caption_prompt)
        return messages, MediaParts(images, videos_of(sample, messages)), where

    def _pixels(self, media: MediaParts, messages) -> Dict[str, torch.Tensor]:
        try:
            if media.videos:
                return self.images.pixels(media.images, media.videos, media_marks(messages))
            return self.images.pixels(media.images)
        except ImageDecodeError as err:
            raise BadSample("undecodable image", str(err)) from None
        except VideoDecodeError as err:
            raise BadSample("undecodable video", str(err)) from None
        except ImageCountMismatch as err:
            raise BadSample("video count mismatch", str(err)) from None

    def _expand(self, ids: List[int], targets: List[int], pixels: Dict[str, torch.Tensor]
                ) -> Tuple[List[int], List[int]]:
        """(ids, targets) with room for the images."""
        try:
            return self.images.expand(ids, targets, pixels)
        except ImageCountMismatch as err:
            raise BadSample("image count mismatch", str(err)) from None

    def _encode(self, messages, media: MediaParts) -> Dict[str, torch.Tensor]:
        pixels = self._pixels(media, messages)
        ids, targets = render_chat(self.tokens, self.images.messages(messages, pixels))
        ids, targets = self._expand(ids, targets, pixels)
        self._check_fits(len(ids), pixels)
        for key in TEXT_ONLY:  # written in the text
            pixels.pop(key, None)
        return self._pack(ids, targets, pixels)

    def _check_fits(self, num_ids: int, pixels: Dict[str, torch.Tensor]) -> None:
        width = self.images.positions(num_ids - 1, pixels)  # inputs are ids[:-1]
        if width > self.seq_length:
            raise BadSample("too long", f"{width} text + image positions exceed seq_length "
                                        f"{self.seq_length}")

    def _pack(self, ids: List[int], targets: List[int],
              pixels: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        n, pad = len(ids) - 1, self.tokenizer.pad_id
        tokens = torch.full((self.seq_length,), pad, dtype=torch.int64)
        labels = torch.full((self.seq_length,), pad, dtype=torch.int64)
        loss_mask = torch.zeros(self.seq_length, dtype=torch.float32)
        row = torch.tensor(ids, dtype=torch.int64)
        tokens[:n], labels[:n] = row[:-1], row[1:]
        loss_mask[:n] = torch.tensor(targets[1:], dtype=torch.float32)
        self.stats.samples += 1
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, **pixels}

    def _skip(self, record: int, err: BadSample) -> None:
        self._bad[record] = err.reason
        self.stats.bad[err.reason].add((self.path, self.split, record))
        where = self._where(record)
        if self._warned < self.max_warnings:
            self._warned += 1
            logger.warning("%s: %s: skipped %s: %s", self.name, where, err.reason, err)
        elif self._warned == self.max_warnings and self.max_warnings:  # after those shown
            self._warned += 1
            logger.warning("%s: more bad records skipped (not shown; counts in the metrics)",
                           self.name)

    def _where(self, record: int) -> str:
        """'SHARD: sample KEY' of a record, from the index alone (it may not parse)."""
        reader = self.reader
        shard_idx = self._shard_index(record)
        shard = reader.shard_infos[shard_idx]
        try:
            if self.stored is not None and not os.path.exists(str(shard.path)):
                raise FileNotFoundError(shard.path)  # naming a record fetches nothing
            raw = reader[record]
            key = raw["__key__"] if raw is not None else "?"
        except Exception:  # the tar itself is damaged
            key = f"#{record - reader.shard_count_cumsum[shard_idx]}"
        return f"{shard.name}: sample {key!r}"

    # -- evaluation ----------------------------------------------------------------------------

    def generation_examples(self, limit: Optional[int] = None):
        """(GenerationPrompt, reference answer) of the good records in split order, up to
        ``limit``: the last assistant turn is the answer to generate."""
        examples = []
        for record in range(self.records):
            if limit is not None and len(examples) >= limit:
                break
            if record in self._bad:
                continue
            try:
                messages, images, _ = self._read(record)
                context, answer = split_for_generation(messages)
                pixels = self._pixels(images, context)
                prompt = build_generation_prompt(self.tokens,
                                                 self.images.messages(context, pixels))
                prompt, _ = self._expand(prompt, [0] * len(prompt), pixels)
                self._check_fits(len(prompt) + len(self.tokenizer.encode(answer)) + 1, pixels)
            except BadSample as err:
                self._skip(record, err)
                continue
            examples.append((self._prompt(prompt, pixels), answer))
        return examples


    def _prompt(self, tokens: List[int], pixels: Dict[str, torch.Tensor]) -> "GenerationPrompt":
        if isinstance(self.images, TiledImages):
            return GenerationPrompt(tokens, pixels["images"], pixels["num_image_tiles"])
        return GenerationPrompt(tokens, pixels["pixel_values"],
                                image_grid_thw=pixels["image_grid_thw"],
                                videos=pixels.get("pixel_values_videos"),
                                video_grid_thw=pixels.get("video_grid_thw"))


@dataclass
class GenerationPrompt:
    """One prompt to answer: ``tokens`` (ids with image placeholders, ending in the assistant
    role token) and its images: LLaVA's tiles ``images`` [tiles, 3, H, W] with
    ``num_image_tiles`` [images], or a tower's patches ``images`` [patches, 3, p, p] with
    ``image_grid_thw`` [images, 3] (the tokens then hold one placeholder per image token)."""

    tokens: List[int]
    images: torch.Tensor
    num_image_tiles: Optional[torch.Tensor] = None
    image_grid_thw: Optional[torch.Tensor] = None
    videos: Optional[torch.Tensor] = None
    """A tower's video patches ``[patches, ...]`` with ``video_grid_thw`` [videos, 3]."""
    video_grid_thw: Optional[torch.Tensor] = None



def collate_image_text(samples: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """One micro-batch: text tensors stacked [b, S]; the image tensors of all samples (tiles and
    their counts, or patches and their grids) concatenated in sample order (the order the model
    fills the placeholders in)."""
    if not samples:
        raise DataError("collate_image_text: no samples")
    text = ("tokens", "labels", "loss_mask")
    batch = {key: torch.stack([s[key] for s in samples]) for key in text}
    for key in samples[0]:
        if key not in text:
            batch[key] = torch.cat([s[key] for s in samples])
    return batch


def reduce_skip_counts(*stats: ImageTextStats) -> Dict[str, int]:
    """Distinct bad records by reason that the data-parallel ranks met in these datasets
    (collective over the data-parallel group; bad records are few, so their ids travel)."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    mine = {reason: set().union(*(s.bad[reason] for s in stats)) for reason in REASONS}
    gathered = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, mine, group=group)
    return {reason: len(set().union(*(g[reason] for g in gathered))) for reason in REASONS}
