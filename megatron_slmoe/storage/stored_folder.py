"""A folder of objects under a prefix, on this node, fetched as it is read.

``StoredFolder(cache, prefix, eager, workers)`` lists the prefix once. The objects ``eager``
selects by name (an energon dataset's metadata and tar indices: small, and needed to open it) are
fetched at once; the others (its tar shards: the bulk) when the reader asks for one (``path``),
or in the background when it says which it will read next (``prefetch``: at most ``workers``
downloads at a time, so what is fetched ahead stays bounded). So a run starts after the
metadata, not after the whole dataset, and reads while the shards it needs next arrive.

Each object reaches the node once through the node cache, whichever process asks first (the
others wait for that download or find the copy), and a copy is never half-made: a download
killed with ``kill -9`` leaves nothing the next run would trust. A shard the cache evicted to make
room is fetched again when asked for.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Optional

from megatron_slmoe.storage.cache import NodeCache, URLLike
from megatron_slmoe.storage.errors import ObjectNotFoundError
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
        for name, info in self._infos.items():
            if eager(name):
                cache.fetch(info.url, info)
        self.lazy = frozenset(name for name in self._infos if not eager(name))
        self.workers = max(1, int(workers))
        self.wait_s = 0.0  # time the reader spent waiting for a shard that was not there yet
        self._futures: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pool_pid = -1

    def __getstate__(self) -> dict:  # a copy in another process starts its own downloads
        state = dict(self.__dict__)
        state.update(_futures={}, _lock=None, _pool=None, _pool_pid=-1)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def size(self, name: str) -> Optional[int]:
        """The object's size on the store (None: no such object)."""
        info = self._infos.get(name)
        return None if info is None else info.size

    def local_path(self, name: str) -> str:
        """Where the node's copy of ``name`` is (or will be)."""
        return os.path.join(self.directory, *name.split("/"))

    def path(self, name: str) -> str:
        """The local path of ``name``, fetched first if the node has no copy."""
        if name not in self.lazy:
            return self.local_path(name)
        future = self._schedule(name)
        start = time.monotonic()
        try:
            return future.result()
        finally:
            self.wait_s += time.monotonic() - start

    def prefetch(self, names: Iterable[str]) -> int:
        """Start fetching the first of ``names`` (in the order they will be read) that the node
        has not got or is not getting, while fewer than ``workers`` downloads run. Returns how
        many of ``names`` are now got or coming (the caller need not offer them again); errors
        are raised by ``path``."""
        with self._lock:
            running = sum(not f.done() for f in self._futures.values())
        handled = 0
        for name in names:
            if name in self.lazy and self._usable(name) is None:
                if running >= self.workers:
                    break
                self._schedule(name)
                running += 1
            handled += 1
        return handled

    def _usable(self, name: str) -> Optional[Future]:
        """The download of ``name`` under way or done with its copy still there, else None
        (never asked, failed, or evicted since)."""
        future = self._futures.get(name)
        if future is not None and future.done() and (
                future.exception() is not None or not os.path.exists(future.result())):
            return None
        return future

    def _schedule(self, name: str) -> Future:
        with self._lock:
            future = self._usable(name)
            if future is None:
                if self._pool is None or self._pool_pid != os.getpid():
                    self._pool = ThreadPoolExecutor(max_workers=self.workers,
                                                    thread_name_prefix="slmoe-stored-folder")
                    self._pool_pid = os.getpid()
                info = self._infos[name]
                future = self._futures[name] = self._pool.submit(self.cache.fetch, info.url,
                                                                 info)
            return future

    def close(self) -> None:
        """Start no more downloads; those running finish (a cache entry is never half-made)."""
        if self._pool is not None and self._pool_pid == os.getpid():
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
