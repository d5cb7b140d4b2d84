"""Make energon image-text datasets: LLaVA-style JSON plus an image folder -> WebDataset shards with
energon's metadata (``tools/prepare_image_text.py`` is the command line).

Input: a JSON list (or JSON lines) of records::

    {"id": "0001", "image": "shapes/0001.png",          # or "images": [...], or neither
     "conversations": [{"from": "human", "value": "<image>\\nWhat colour is the circle?"},
                       {"from": "gpt", "value": "red"}]}

(``"messages"`` with ``role``/``content`` is read too; roles human/user, gpt/assistant, system).
Image paths are relative to the image folder. Video clips come as ms-swift and LLaMA-Factory
write them: ``"videos": ["clips/0001.mp4", ...]`` (or ``"video": "..."``), relative to the same
folder, one ``<video>`` mark each in the text (chat samples only); each clip is decoded once
(``data/video.py``, PyAV) to check it and stored as it was (the family's processor samples its
frames when the data is read).

Output, one folder (written under a temporary name and renamed when complete)::

    train/shard-000000.tar ...   val/shard-000000.tar ...   .nv-meta/{dataset.yaml, split.yaml,
                                                                      .info.json, index.sqlite}

Each sample is ``KEY.json`` plus ``KEY.img0.<ext>``, ``KEY.img1.<ext>`` ... (the image bytes as
they were) and ``KEY.vid0.<ext>`` ... (the clips'). The JSON and ``dataset.yaml`` depend on the sample type:

=========  ===========================================  ======================================
type       KEY.json                                     dataset.yaml
=========  ===========================================  ======================================
chat       ``{"id", "messages"}``                       energon ``CrudeWebdataset``
vqa        ``{"id", "question", "answers"}``            ``VQASample`` + field map
caption    ``{"id", "caption"}``                        ``CaptioningSample`` + field map
=========  ===========================================  ======================================

(vqa and caption records need exactly one image and one user/assistant exchange; the caption
type keeps the assistant text, the user turn becoming the reader's caption prompt.) The shards
are indexed by energon's own preparation (``BaseWebdatasetFactory.prepare_dataset``).

Records that cannot make a correct sample are skipped, counted by reason and logged with the file
and record: malformed, image or clip missing, a path leaving the folder, undecodable image,
undecodable clip (zero-length, corrupt, unsupported codec, no frames, frames of different sizes,
longer than ``max_video_seconds``), ``<image>`` or ``<video>`` count not matching, or not of the
requested type. With ``max_bad_fraction``, a split with more bad records than that fraction is
refused (one line, nothing written).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import tarfile
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from megatron_slmoe.data.errors import DataError, require_file
from megatron_slmoe.utils.atomic import atomic_directory
from megatron_slmoe.data.image import ImageDecodeError, decode_image
from megatron_slmoe.data.config import VIDEO_TOKEN
from megatron_slmoe.data.image_text import (
    IMAGE_EXTENSIONS,
    KINDS,
    VIDEO_EXTENSIONS,
    BadSample,
    check_image_count,
)
from megatron_slmoe.data.video import MAX_SECONDS, VideoDecodeError, decode_clip
from megatron_slmoe.data.instruction import MalformedRecord, parse_record

logger = logging.getLogger(__name__)

ROLE_NAMES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
              "system": "system"}
PREPARE_REASONS = ("malformed record", "missing image", "path escapes dataset",
                   "undecodable image", "image count mismatch", "wrong sample type",
                   "missing video", "undecodable video", "video count mismatch")
_IMAGE_FIELDS = ",".join(f"img0.{ext}" for ext in IMAGE_EXTENSIONS)

DATASET_YAML = {
    "chat": {"__module__": "megatron.energon", "__class__": "CrudeWebdataset"},
    "vqa": {"sample_type": {"__module__": "megatron.energon", "__class__": "VQASample"},
            "field_map": {"image": _IMAGE_FIELDS, "context": "json[question]",
                          "answers": "json[answers]"}},
    "caption": {"sample_type": {"__module__": "megatron.energon", "__class__": "CaptioningSample"},
                "field_map": {"image": _IMAGE_FIELDS, "caption": "json[caption]"}},
}


@dataclass
class ShardRecord:
    """One sample to write: its JSON payload, its encoded images and clips ``(extension,
    bytes)``."""

    payload: dict
    images: List[Tuple[str, bytes]]
    videos: List[Tuple[str, bytes]] = field(default_factory=list)


@dataclass
class PrepareStats:
    records: int = 0
    written: int = 0
    skipped: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(PREPARE_REASONS, 0))

    def summary(self) -> str:
        reasons = ", ".join(f"{k}: {v}" for k, v in self.skipped.items() if v)
        total = sum(self.skipped.values())
        return (f"{self.records} records, {self.written} written, {total} skipped"
                f"{f' ({reasons})' if reasons else ''}")


# --- LLaVA JSON -> records ------------------------------------------------------------------------


def read_llava_json(path: str) -> List[dict]:
    """The records of a LLaVA-style JSON list or JSON-lines file; one DataError line if neither."""
    require_file(path, "image-text JSON")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except ValueError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError as err:
            raise DataError(f"{path}: neither a JSON list nor JSON lines ({err})") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
    return data


def _messages(record: dict) -> List[Dict[str, str]]:
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list):
        raise BadSample("malformed record", "needs a 'conversations' (or 'messages') list")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadSample("malformed record", f"turn {i} is not an object")
        role = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        if role not in ROLE_NAMES:
            raise BadSample("malformed record", f"turn {i} has unknown role {role!r}")
        messages.append({"role": ROLE_NAMES[role], "content": content})
    try:
        return parse_record({"messages": messages})
    except MalformedRecord as err:
        raise BadSample("malformed record", str(err)) from None


def _image_paths(record: dict) -> List[str]:
    if "images" in record and "image" in record:
        raise BadSample("malformed record", "has both 'image' and 'images'")
    paths = record.get("images", [record["image"]] if "image" in record else [])
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        raise BadSample("malformed record", "'image'/'images' must be a path or a list of paths")
    return paths


def _video_paths(record: dict) -> List[str]:
    if "videos" in record and "video" in record:
        raise BadSample("malformed record", "has both 'video' and 'videos'")
    paths = record.get("videos", [record["video"]] if "video" in record else [])
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        raise BadSample("malformed record", "'video'/'videos' must be a path or a list of paths")
    return paths


def _read_video(media_dir: str, relative: str, max_seconds: float) -> Tuple[str, bytes]:
    root = os.path.realpath(media_dir)
    full = os.path.realpath(os.path.join(root, relative))
    if os.path.commonpath([root, full]) != root:
        raise BadSample("path escapes dataset", f"video {relative!r} is outside {media_dir}")
    if not os.path.isfile(full):
        raise BadSample("missing video", f"video {relative!r} not found in {media_dir}")
    ext = os.path.splitext(full)[1].lstrip(".").lower()
    if ext not in VIDEO_EXTENSIONS:
        raise BadSample("undecodable video", f"video {relative!r}: extension {ext!r} is not one "
                                             f"of {', '.join(VIDEO_EXTENSIONS)}")
    with open(full, "rb") as f:
        data = f.read()
    try:
        decode_clip(data, max_seconds)
    except VideoDecodeError as err:
        raise BadSample("undecodable video", f"video {relative!r}: {err}") from None
    return ext, data


def _read_image(image_dir: str, relative: str) -> Tuple[str, bytes]:
    root = os.path.realpath(image_dir)
    full = os.path.realpath(os.path.join(root, relative))
    if os.path.commonpath([root, full]) != root:
        raise BadSample("path escapes dataset", f"image {relative!r} is outside {image_dir}")
    if not os.path.isfile(full):
        raise BadSample("missing image", f"image {relative!r} not found in {image_dir}")
    with open(full, "rb") as f:
        data = f.read()
    try:
        decode_image(data)
    except ImageDecodeError as err:
        raise BadSample("undecodable image", f"image {relative!r}: {err}") from None
    ext = os.path.splitext(full)[1].lstrip(".").lower()
    if ext not in IMAGE_EXTENSIONS:
        raise BadSample("undecodable image", f"image {relative!r}: unknown extension {ext!r}")
    return ext, data


def _payload(kind: str, ident: str, messages: List[Dict[str, str]], num_images: int) -> dict:
    if kind == "chat":
        return {"id": ident, "messages": messages}
    if num_images != 1 or [m["role"] for m in messages] != ["user", "assistant"]:
        raise BadSample("wrong sample type", f"a {kind} sample needs one image and one "
                                             f"user/assistant exchange")
    if kind == "vqa":
        return {"id": ident, "question": messages[0]["content"],
                "answers": [messages[1]["content"]]}
    return {"id": ident, "caption": messages[1]["content"]}


def llava_records(json_path: str, image_dir: str, kind: str, stats: PrepareStats,
                  max_warnings: int = 20, max_video_seconds: float = MAX_SECONDS
                  ) -> Iterator[ShardRecord]:
    """The good records of a LLaVA-style JSON file as ShardRecords of ``kind``; the others are
    counted in ``stats`` and logged (``FILE record N (id X): skipped REASON: ...``)."""
    if kind not in KINDS:
        raise DataError(f"sample type {kind!r} is not one of {', '.join(KINDS)}")
    warned = 0
    for number, record in enumerate(read_llava_json(json_path)):
        stats.records += 1
        ident = str(record.get("id", number)) if isinstance(record, dict) else str(number)
        try:
            if not isinstance(record, dict):
                raise BadSample("malformed record", "not a JSON object")
            messages = _messages(record)
            paths = _image_paths(record)
            check_image_count(messages, len(paths))
            video_paths = _video_paths(record)
            marks = sum(m["content"].count(VIDEO_TOKEN) for m in messages)
            if marks != len(video_paths):
                raise BadSample("video count mismatch", f"the text marks {marks} {VIDEO_TOKEN} "
                                                        f"but the record has {len(video_paths)} "
                                                        f"video(s)")
            if video_paths and kind != "chat":
                raise BadSample("wrong sample type", f"a {kind} sample holds no videos")
            images = [_read_image(image_dir, p) for p in paths]
            videos = [_read_video(image_dir, p, max_video_seconds) for p in video_paths]
            payload = _payload(kind, ident, messages, len(images))
        except BadSample as err:
            stats.skipped[err.reason] += 1
            if warned < max_warnings:
                warned += 1
                logger.warning("%s record %d (id %s): skipped %s: %s", json_path, number, ident,
                               err.reason, err)
            continue
        yield ShardRecord(payload, images, videos)


# --- writing shards -------------------------------------------------------------------------------


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644  # fixed metadata: reproducible shards
    tar.addfile(info, io.BytesIO(data))


def _fsynced(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write_shards(records: Iterable[ShardRecord], folder: str, split: str,
                 samples_per_shard: int) -> int:
    """Write ``records`` as ``folder/split/shard-NNNNNN.tar`` (keys ``split_NNNNNNNN``); returns
    how many were written."""
    os.makedirs(os.path.join(folder, split), exist_ok=True)
    count, tar, path = 0, None, None
    try:
        for record in records:
            if count % samples_per_shard == 0:
                if tar is not None:
                    tar.close()
                    _fsynced(path)
                path = os.path.join(folder, split, f"shard-{count // samples_per_shard:06d}.tar")
                tar = tarfile.open(path, "w", format=tarfile.PAX_FORMAT)
            key = f"{split}_{count:08d}"
            _add_member(tar, f"{key}.json", json.dumps(record.payload, sort_keys=True).encode())
            for i, (ext, data) in enumerate(record.images):
                _add_member(tar, f"{key}.img{i}.{ext}", data)
            for i, (ext, data) in enumerate(record.videos):
                _add_member(tar, f"{key}.vid{i}.{ext}", data)
            count += 1
    finally:
        if tar is not None:
            tar.close()
            _fsynced(path)
    return count


def index_energon_dataset(folder: str, kind: str) -> None:
    """energon's preparation of the shards under ``folder`` (tar indices, ``split.yaml`` with one
    split per top-level folder, ``.info.json``) plus the ``dataset.yaml`` of ``kind``."""
    import yaml
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory

    shards = sorted(os.path.relpath(os.path.join(root, name), folder)
                    for root, _, files in os.walk(folder) for name in files
                    if name.endswith(".tar"))
    if not shards:
        raise DataError(f"{folder}: no shards to index (no usable records)")
    splits = sorted({s.split(os.sep, 1)[0] for s in shards})
    chatter = io.StringIO()  # energon prints its progress; keep it for the debug log
    with contextlib.redirect_stdout(chatter):
        BaseWebdatasetFactory.prepare_dataset(
            folder, shards, split_parts_patterns=[(s, rf"^{s}/.*\.tar$") for s in splits],
            workers=1, shuffle_seed=None)
    logger.debug("energon prepare: %s", chatter.getvalue().strip())
    text = yaml.safe_dump(DATASET_YAML[kind], sort_keys=False)
    with open(os.path.join(folder, ".nv-meta", "dataset.yaml"), "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def prepare_image_text(output: str, splits: Dict[str, Iterable[ShardRecord]], kind: str,
                       samples_per_shard: int = 1000,
                       check: Optional[Callable[[], None]] = None) -> Dict[str, int]:
    """Write and index an energon dataset at ``output`` (which must not exist) from the records
    of each split; returns the samples written per split. Built under a temporary name and
    renamed into place only when complete; ``check`` (raising DataError) runs once the records
    are written, before anything is in place."""
    if os.path.exists(output):
        raise DataError(f"{output} already exists (choose a new output folder)")
    if samples_per_shard < 1:
        raise DataError(f"--samples-per-shard must be positive, got {samples_per_shard}")
    with atomic_directory(output) as staging:
        written = {split: write_shards(records, staging, split, samples_per_shard)
                   for split, records in splits.items()}
        if check is not None:
            check()
        empty = [s for s, n in written.items() if n == 0]
        if empty:
            raise DataError(f"split {empty[0]!r} has no usable records")
        index_energon_dataset(staging, kind)
    return written


def prepare_from_llava_json(output: str, train_json: str, image_dir: str, *, kind: str = "chat",
                            val_json: Optional[str] = None, samples_per_shard: int = 1000,
                            max_warnings: int = 20, max_bad_fraction: float = 1.0,
                            max_video_seconds: float = MAX_SECONDS
                            ) -> Tuple[Dict[str, int], Dict[str, PrepareStats]]:
    """The command behind ``tools/prepare_image_text.py``: (samples written, stats) per split."""
    if not os.path.isdir(image_dir):
        raise DataError(f"--image-dir {image_dir}: no such folder")
    if not 0.0 <= max_bad_fraction <= 1.0:
        raise DataError(f"--max-bad-fraction must be in [0, 1], got {max_bad_fraction}")
    if not max_video_seconds > 0:
        raise DataError(f"--max-video-seconds must be positive, got {max_video_seconds}")
    sources = {"train": train_json, **({"val": val_json} if val_json else {})}
    stats = {split: PrepareStats() for split in sources}
    splits = {split: llava_records(path, image_dir, kind, stats[split], max_warnings,
                                   max_video_seconds)
              for split, path in sources.items()}

    def within_bad_fraction() -> None:
        for split, split_stats in stats.items():
            bad = sum(split_stats.skipped.values())
            if split_stats.records and bad / split_stats.records > max_bad_fraction:
                raise DataError(f"{sources[split]}: {split_stats.summary()}: more bad records "
                                f"than --max-bad-fraction {max_bad_fraction:g} allows (nothing "
                                f"written)")

    written = prepare_image_text(output, splits, kind, samples_per_shard, within_bad_fraction)
    for split, count in written.items():
        stats[split].written = count
    return written, stats

