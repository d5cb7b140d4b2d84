"""The node-local object cache: one download per node, shared by every rank on it.

Layout under ``cache_dir`` (node-local NVMe; ``SLMOE_CACHE_DIR``)::

    objects/<namespace>/<key>        the object's bytes, read-only; keys are mirrored as paths, so
                                     ``prefix.bin`` and ``prefix.idx`` stay side by side
    meta/<namespace>/<key>.json      size, ETag, when they were last checked against the store;
                                     written last: an object without it is never trusted. Its
                                     mtime is the entry's last use (the LRU clock)
    locks/<namespace>/<key>.lock     flock held while the entry is fetched, revalidated or evicted
    tmp/<bytes>-<pid>-<random>.part  downloads in progress, each flock'ed by its writer
    .evict.lock                      one space reservation at a time

``<namespace>`` is ``s3/<endpoint>/<bucket>`` or ``msc/<profile>``.

How the guarantees come about:

* **One download per node.** The first process to want an entry takes its lock (``flock``) and
  downloads; the others block on the lock, then find a fresh entry. A holder killed with -9
  releases the lock with its last file descriptor, so a lock is a lease, never a stale file.
* **Partial downloads are never used.** Bytes go to ``tmp/`` (fsync'ed), are renamed into
  ``objects/`` and only then is the metadata written (fsync + rename). A kill at any point leaves
  either no metadata (the entry is fetched again) or metadata whose size matches the object.
  Orphaned ``tmp/`` files (their writer's flock is gone) are deleted by the next reservation.
* **Integrity.** An entry is used only if its file has the size recorded in its metadata, and
  the recorded ETag and size match a HEAD of the store made within ``revalidate_s`` seconds (by
  any process on the node); otherwise it is fetched again. An object replaced on the store is
  therefore noticed by the next open after that window (0: on every open).
* **Bounded size.** Before a download, space for it is reserved under ``.evict.lock``: entries
  are evicted least recently used first (entries being fetched are skipped) until the objects,
  plus the downloads in flight, fit in ``max_bytes``. Eviction unlinks files; a process that has
  one open or mapped keeps reading it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Iterator, Optional, Union

from megatron_slmoe.storage.client import ObjectInfo, ObjectStore, s3_endpoint
from megatron_slmoe.storage.errors import (
    CacheError,
    ObjectChangedError,
    ObjectNotFoundError,
    StorageError,
)
from megatron_slmoe.storage.urls import ObjectURL, parse_url
from megatron_slmoe.utils.atomic import fsync_path, write_json_atomic

log = logging.getLogger(__name__)

URLLike = Union[str, ObjectURL]

CACHE_DIR_ENV = "SLMOE_CACHE_DIR"


def default_cache_dir() -> str:
    """``$SLMOE_CACHE_DIR`` (the SLURM batch files point it at node-local scratch), else a
    per-user directory under the system's temporary directory."""
    return os.environ.get(CACHE_DIR_ENV) or os.path.join(tempfile.gettempdir(),
                                                         f"slmoe-cache-{os.getuid()}")


@dataclass
class CacheStats:
    """What this process's cache did (not the node's)."""

    hits: int = 0                 # served from the node's copy (no download)
    downloads: int = 0            # objects this process downloaded
    bytes_downloaded: int = 0
    revalidations: int = 0        # HEADs that confirmed a cached copy
    evictions: int = 0
    bytes_evicted: int = 0
    lock_wait_s: float = 0.0      # time spent waiting for another process's download

    def as_dict(self) -> dict:
        return asdict(self)


def _namespace(url: ObjectURL) -> str:
    if url.scheme == "msc":
        return os.path.join("msc", url.authority)
    endpoint = s3_endpoint() or "aws"
    label = re.sub(r"[^A-Za-z0-9.\-]+", "_", endpoint.split("://")[-1]).strip("_")[:48]
    digest = hashlib.sha256(endpoint.encode()).hexdigest()[:8]
    return os.path.join("s3", f"{label}-{digest}", url.authority)


@contextlib.contextmanager
def _flock(path: str, blocking: bool = True, create: bool = True) -> Iterator[bool]:
    """Exclusive flock on ``path`` (created if missing and ``create``); yields False if not
    blocking and busy."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except OSError as err:
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN) and not blocking:
                yield False
                return
            raise
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class NodeCache:
    """Local copies of objects, shared by the processes of a node (see the module doc)."""

    def __init__(self, store: ObjectStore, root: str, max_bytes: int, revalidate_s: float = 60.0):
        self.store = store
        self.root = os.path.abspath(root)
        self.max_bytes = int(max_bytes)
        self.revalidate_s = float(revalidate_s)
        self.stats = CacheStats()
        self._stats_lock = threading.Lock()
        try:
            for sub in ("objects", "meta", "locks", "tmp"):
                os.makedirs(os.path.join(self.root, sub), exist_ok=True)
            with _flock(os.path.join(self.root, ".evict.lock")):
                pass
        except OSError as err:
            raise CacheError(f"--cache-dir {self.root}: not a usable directory "
                             f"({err.strerror or err})") from None

    # -- paths ---------------------------------------------------------------------------------------

    def _paths(self, url: ObjectURL) -> tuple[str, str, str]:
        if url.is_prefix:
            raise CacheError(f"{url}: a prefix, not an object")
        rel = os.path.join(_namespace(url), *url.key.split("/"))
        return (os.path.join(self.root, "objects", rel),
                os.path.join(self.root, "meta", rel + ".json"),
                os.path.join(self.root, "locks", rel + ".lock"))

    def local_path(self, url: URLLike) -> str:
        """Where the node's copy of ``url`` lives (whether or not it is there now)."""
        return self._paths(parse_url(url))[0]

    def local_dir(self, prefix: URLLike) -> str:
        """Where the copies of the objects under ``prefix`` live."""
        url = parse_url(prefix).as_prefix()
        return os.path.join(self.root, "objects", _namespace(url), *url.key.rstrip("/").split("/"))

    # -- fetching ------------------------------------------------------------------------------------

    def fetch(self, url: URLLike, info: Optional[ObjectInfo] = None) -> str:
        """The local path of a verified copy of ``url``, downloading it if the node has none.

        ``info`` (from a listing just made) saves the HEAD when the entry must be checked.
        """
        url = parse_url(url)
        path, meta_path, lock_path = self._paths(url)
        if self._fresh(path, meta_path) is not None:
            return self._hit(meta_path, path)
        try:
            os.makedirs(os.path.dirname(lock_path), exist_ok=True)
            start = time.monotonic()
            with _flock(lock_path):
                self._count(lock_wait_s=time.monotonic() - start)
                return self._fetch_locked(url, path, meta_path, info)
        except StorageError:  # some are OSErrors too (not found, access denied): not ours
            raise
        except OSError as err:
            raise CacheError(f"{url}: cannot write its cache entry under {self.root} "
                             f"({err.strerror or err})") from None

    def fetch_prefix(self, prefix: URLLike) -> tuple[str, list[str]]:
        """(local directory, local paths) of every object under ``prefix``."""
        prefix = parse_url(prefix).as_prefix()
        infos = self.store.list(prefix)
        if not infos:
            raise ObjectNotFoundError(f"{prefix}: no objects under this prefix")
        return self.local_dir(prefix), [self.fetch(i.url, i) for i in infos]

    def _fresh(self, path: str, meta_path: str) -> Optional[dict]:
        """The entry's metadata if its copy is complete and was checked recently, else None."""
        meta = self._complete(path, meta_path)
        if meta is None or time.time() - meta.get("validated_at", 0.0) >= self.revalidate_s:
            return None
        return meta

    @staticmethod
    def _complete(path: str, meta_path: str) -> Optional[dict]:
        """The entry's metadata if its copy has the recorded size, else None."""
        try:
            with open(meta_path, encoding="utf-8") as f:
                meta = json.load(f)
            if os.path.getsize(path) == meta["size"]:
                return meta
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return None

    def _hit(self, meta_path: str, path: str) -> str:
        with contextlib.suppress(OSError):
            os.utime(meta_path)  # last use, for LRU
        self._count(hits=1)
        return path

    def _fetch_locked(self, url: ObjectURL, path: str, meta_path: str,
                      info: Optional[ObjectInfo]) -> str:
        if self._fresh(path, meta_path) is not None:  # another process just did it
            return self._hit(meta_path, path)
        info = info or self.store.head(url)
        meta = self._complete(path, meta_path)
        if meta is not None and meta.get("etag") == info.etag and meta["size"] == info.size:
            meta["validated_at"] = time.time()
            write_json_atomic(meta_path, meta)
            self._count(revalidations=1)
            return self._hit(meta_path, path)
        if meta is not None:
            log.info("storage: %s changed on the store (ETag %s -> %s); fetching it again",
                     url, meta.get("etag"), info.etag)
        try:
            self._download(info, path, meta_path)
        except ObjectChangedError:  # replaced between the HEAD and the GET: once more
            self._download(self.store.head(url), path, meta_path)
        return path

    def _download(self, info: ObjectInfo, path: str, meta_path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(meta_path)  # from here on the old copy is not trusted
        tmp_path, tmp_fd = self._reserve(info)
        try:
            with os.fdopen(os.dup(tmp_fd), "w+b") as sink:
                self.store.download(info, sink)
                sink.flush()
                os.fsync(sink.fileno())
            for directory in (os.path.dirname(path), os.path.dirname(meta_path)):
                os.makedirs(directory, exist_ok=True)
            os.chmod(tmp_path, 0o444)
            os.replace(tmp_path, path)
            fsync_path(os.path.dirname(path))
            write_json_atomic(meta_path, {"url": str(info.url), "size": info.size,
                                           "etag": info.etag, "validated_at": time.time()})
            fsync_path(os.path.dirname(meta_path))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_path)
            raise
        finally:
            os.close(tmp_fd)  # releases the tmp file's flock
        self._count(downloads=1, bytes_downloaded=info.size)

    # -- space ---------------------------------------------------------------------------------------

    def _reserve(self, info: ObjectInfo) -> tuple[str, int]:
        """A flock'ed temporary file for ``info``'s bytes, made once they fit in ``max_bytes``."""
        if info.size > self.max_bytes:
            raise CacheError(f"{info.url} has {info.size} bytes, more than the whole cache "
                             f"({self.max_bytes} bytes): raise --cache-max-gb")
        with _flock(os.path.join(self.root, ".evict.lock")):
            in_flight = self._in_flight_bytes()
            entries = self._entries()
            used = sum(size for _, size, _ in entries) + in_flight
            if used + info.size > self.max_bytes:
                used -= self._evict(entries, used + info.size - self.max_bytes)
            if used + info.size > self.max_bytes:
                raise CacheError(f"{info.url}: no room in the cache ({used} of {self.max_bytes} "
                                 "bytes held by objects being fetched): raise --cache-max-gb")
            tmp_path = os.path.join(self.root, "tmp", f"{info.size}-{os.getpid()}-"
                                                      f"{uuid.uuid4().hex[:12]}.part")
            fd = os.open(tmp_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            return tmp_path, fd

    def _in_flight_bytes(self) -> int:
        """Bytes reserved by downloads in progress; orphans of dead writers are deleted."""
        total = 0
        tmp_dir = os.path.join(self.root, "tmp")
        for name in os.listdir(tmp_dir):
            path = os.path.join(tmp_dir, name)
            try:  # (not created: it may just have been renamed into place)
                with _flock(path, blocking=False, create=False) as got:
                    if got:  # nobody writes it: left by a killed process
                        os.unlink(path)
                        continue
            except FileNotFoundError:
                continue
            with contextlib.suppress(ValueError):
                total += int(name.split("-", 1)[0])
        return total

    def _entries(self) -> list[tuple[str, int, float]]:
        """(object path, bytes, last use) of every stored object; no metadata: last use 0."""
        objects = os.path.join(self.root, "objects")
        meta_root = os.path.join(self.root, "meta")
        entries = []
        for base, _, names in os.walk(objects):
            for name in names:
                path = os.path.join(base, name)
                meta = os.path.join(meta_root, os.path.relpath(path, objects)) + ".json"
                try:
                    size = os.path.getsize(path)
                except FileNotFoundError:
                    continue
                try:
                    used = os.path.getmtime(meta)
                except FileNotFoundError:
                    used = 0.0
                entries.append((path, size, used))
        return entries

    def _evict(self, entries: list[tuple[str, int, float]], needed: int) -> int:
        """Evict least recently used entries not locked by others until ``needed`` bytes are
        freed (or none is left); returns the bytes freed."""
        objects = os.path.join(self.root, "objects")
        freed = 0
        for path, size, _ in sorted(entries, key=lambda e: e[2]):
            if freed >= needed:
                break
            rel = os.path.relpath(path, objects)
            lock = os.path.join(self.root, "locks", rel + ".lock")
            os.makedirs(os.path.dirname(lock), exist_ok=True)
            with _flock(lock, blocking=False) as got:
                if not got:  # being fetched or checked right now
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.root, "meta", rel + ".json"))
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            freed += size
            self._count(evictions=1, bytes_evicted=size)
            log.info("storage: evicted %s (%d bytes) from the node cache", rel, size)
        return freed

    def used_bytes(self) -> int:
        """Bytes of the objects stored now (not counting downloads in flight)."""
        return sum(size for _, size, _ in self._entries())

    def _count(self, **increments) -> None:
        with self._stats_lock:
            for name, value in increments.items():
                setattr(self.stats, name, getattr(self.stats, name) + value)

