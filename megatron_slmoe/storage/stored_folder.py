"""A folder of objects under a prefix, on this node, fetched as it is read.

``StoredFolder(cache, prefix, eager, workers)`` lists the prefix once. The objects ``eager``
selects by name (an energon dataset's metadata and tar indices: small, and needed to open it) are
fetched at once; the others (its tar shards: the bulk) when the reader asks for one (``path``,
in the reader's own thread, ahead of any background download), or in the background when it says
which it will read next (``prefetch``: at most ``workers`` downloads at a time per folder, so what
is fetched ahead stays bounded; 0: none). So a run starts after the metadata, not after the
whole dataset, and reads while the shards it needs next arrive.

Each object reaches the node once through the node cache, whichever process asks first (the
others wait for that download or find the copy), and a copy is never half-made: a download
killed with ``kill -9`` leaves nothing the next run would trust. Every ``path`` counts as a use
of the copy for the cache's least-recently-used eviction, and a copy evicted to make room (a
shard or a tar index) is fetched again when asked for. An object whose size on the store is no
longer the one listed when the folder was opened is an ``ObjectChangedError`` (its index, read at
open, would no longer match it).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Optional

from megatron_slmoe.storage.cache import NodeCache, URLLike
from megatron_slmoe.storage.errors import ObjectChangedError, ObjectNotFoundError
from megatron_slmoe.storage.urls import parse_url


class StoredFolder:
    """The node's view of the objects under ``prefix`` (names relative to it, ``/``-separated)."""

    def __init__(self, cache: NodeCache, prefix: URLLike, eager: Callable[[str], bool],
                 workers: int = 2):
        self.prefix = parse_url(prefix).as_prefix()
        infos = cache.store.list(self.prefix)
        if not infos:
            raise ObjectNotFoundError(f"{self.prefix}: no objects under this prefix")
        self.cache = cache
        self.directory = cache.local_dir(self.prefix)
        self._infos = {info.url.key[len(self.prefix.key):]: info for info in infos}
        self.lazy = frozenset(name for name in self._infos if not eager(name))
        self.workers = max(0, int(workers))
        self.wait_s = 0.0  # time the reader spent waiting for objects it asked for
        self._pid = -1
        self._start_process()
        for name in self._infos:
            if name not in self.lazy:
                self._fetch(name)

    def _start_process(self) -> None:
        """Background state of this process (a forked copy starts its own: the parent's
        downloads and pool threads are not there)."""
        self._futures: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pid = os.getpid()

    def _this_process(self) -> None:
        if self._pid != os.getpid():
            self._start_process()

    def size(self, name: str) -> Optional[int]:
        """The object's size on the store when the folder was opened (None: no such object)."""
        info = self._infos.get(name)
        return None if info is None else info.size

    def local_path(self, name: str) -> str:
        """Where the node's copy of ``name`` is (or will be)."""
        return os.path.join(self.directory, *name.split("/"))

    def path(self, name: str) -> str:
        """The local path of a copy of ``name``, fetched first (in this thread, or by waiting for
        its background download) if the node has none; marked as just used."""
        self._this_process()
        start = time.monotonic()
        try:
            with self._lock:
                future = self._futures.get(name)
            if future is not None and not future.done():
                future.result()  # its background download; errors are raised here
            return self._fetch(name)
        finally:
            self.wait_s += time.monotonic() - start

    def _fetch(self, name: str) -> str:
        """The cache's copy of ``name`` (a hit only marks it used), checked against the listing."""
        info = self._infos[name]
        path = self.cache.fetch(info.url, info)
        size = os.path.getsize(path)
        if size != info.size:
            raise ObjectChangedError(f"{info.url}: {size} bytes on the store now, {info.size} "
                                     f"when the dataset was opened (replaced during the run; "
                                     f"its index no longer matches)")
        return path

    def prefetch(self, names: Iterable[str]) -> int:
        """Start fetching, in the background, the first of ``names`` (in the order they will be
        read) that the node has not got or is not getting, while fewer than ``workers``
        downloads run. Returns how many of ``names`` are now got or coming (the caller need not
        offer them again); errors are raised by ``path``."""
        if self.workers == 0:
            return 0
        self._this_process()
        handled = 0
        with self._lock:
            running = sum(not f.done() for f in self._futures.values())
            for name in names:
                if name in self.lazy and not self._got_or_coming(name):
                    if running >= self.workers:
                        break
                    if self._pool is None:
                        self._pool = ThreadPoolExecutor(max_workers=self.workers,
                                                        thread_name_prefix="slmoe-stored-folder")
                    self._futures[name] = self._pool.submit(self._fetch, name)
                    running += 1
                handled += 1
        return handled

    def _got_or_coming(self, name: str) -> bool:
        future = self._futures.get(name)
        if future is not None and not future.done():
            return True
        return os.path.exists(self.local_path(name))

    def close(self) -> None:
        """Start no more downloads and cancel the queued ones; those running finish (a cache
        entry is never half-made)."""
        if self._pool is not None and self._pid == os.getpid():
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
