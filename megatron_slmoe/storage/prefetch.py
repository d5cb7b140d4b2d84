"""Background download of the next shards ahead of the reader.

``ShardPrefetcher(cache, urls, ahead)`` serves the local paths of an ordered list of objects
(the order the sampler will read them in): asking for shard ``i`` starts the downloads of
``i+1 .. i+ahead`` in background threads, so reading shard ``i`` overlaps fetching the next ones.
Through the node cache the ranks of a node share these downloads: whichever rank asks first
fetches, the others wait for it (or find the copy ready). A failed background fetch is raised
when its shard is asked for, not before.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, Sequence

from megatron_slmoe.storage.cache import NodeCache, URLLike


class ShardPrefetcher:
    def __init__(self, cache: NodeCache, urls: Sequence[URLLike], ahead: int):
        self.cache = cache
        self.urls = list(urls)
        self.ahead = max(0, int(ahead))
        self.wait_s = 0.0    # time the reader spent waiting for a shard that was not ready
        self._futures: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, self.ahead),
                                        thread_name_prefix="slmoe-prefetch")

    def __len__(self) -> int:
        return len(self.urls)

    def _schedule(self, index: int) -> Future:
        with self._lock:
            future = self._futures.get(index)
            if future is None:
                future = self._futures[index] = self._pool.submit(self.cache.fetch,
                                                                  self.urls[index])
            return future

    def path(self, index: int) -> str:
        """The local path of shard ``index``; downloads of the next ``ahead`` shards start."""
        if not 0 <= index < len(self.urls):
            raise IndexError(f"shard {index} out of range [0, {len(self.urls)})")
        future = self._schedule(index)
        for nxt in range(index + 1, min(index + 1 + self.ahead, len(self.urls))):
            self._schedule(nxt)
        start = time.monotonic()
        try:
            return future.result()
        finally:
            self.wait_s += time.monotonic() - start
            with self._lock:  # keep only what is still ahead of the reader
                for done in [i for i in self._futures if i < index]:
                    del self._futures[done]

    def __iter__(self) -> Iterator[str]:
        for index in range(len(self.urls)):
            yield self.path(index)

    def close(self) -> None:
        """Stop starting downloads; the ones running finish (a cache entry is never half-made)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "ShardPrefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
