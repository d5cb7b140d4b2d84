"""Object storage as one process of a run sees it: its settings, the store and the node cache.

Every method takes local paths too and gives them back unchanged, so callers need no branches::

    storage = Storage(StorageConfig.from_args(args))
    train_file = storage.local_file(args.train_data)       # s3://..., msc://... or a path
    base_dir = storage.local_dir(args.base_checkpoint)      # a prefix of objects, or a directory
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Union

from megatron_slmoe.storage.cache import NodeCache
from megatron_slmoe.storage.client import ObjectStore
from megatron_slmoe.storage.config import StorageConfig
from megatron_slmoe.storage.errors import CacheError, ObjectNotFoundError
from megatron_slmoe.storage.prefetch import ShardPrefetcher
from megatron_slmoe.storage.retry import RetryPolicy
from megatron_slmoe.storage.transfer import OutputMirror
from megatron_slmoe.storage.urls import ObjectURL, is_object_url, parse_url

PathOrURL = Union[str, os.PathLike, ObjectURL]


class Storage:
    def __init__(self, config: Optional[StorageConfig] = None):
        self.config = config or StorageConfig()
        self.store = ObjectStore(RetryPolicy(self.config.retry_timeout_s,
                                             self.config.retry_backoff_s))
        self._cache: Optional[NodeCache] = None

    @property
    def cache_in_use(self) -> bool:
        """Whether anything went through the node cache in this process."""
        return self._cache is not None

    @property
    def cache(self) -> NodeCache:
        """The node cache (its directory is made on first use, so local-only runs make none)."""
        if self._cache is None:
            self._cache = NodeCache(self.store, self.config.cache_dir, self.config.cache_max_bytes,
                                    self.config.cache_revalidate_s)
        return self._cache

    # -- inputs ----------------------------------------------------------------------------------

    def local_file(self, path: PathOrURL) -> str:
        """A local path of the file: the path itself, or the node's copy of the object."""
        if isinstance(path, ObjectURL) or is_object_url(path):
            return self.cache.fetch(path)
        return os.fspath(path)

    def local_files(self, paths: Sequence[PathOrURL]) -> list[str]:
        """Local paths of several files in order; objects are downloaded ``--prefetch-shards`` at
        a time in the background."""
        objects = [i for i, p in enumerate(paths) if isinstance(p, ObjectURL) or is_object_url(p)]
        local = [os.fspath(p) if i not in objects else None for i, p in enumerate(paths)]
        if objects:
            with self.prefetcher([paths[i] for i in objects]) as prefetcher:
                for i, path in zip(objects, prefetcher):
                    local[i] = path
            evicted = [paths[i] for i in objects if not os.path.exists(local[i])]
            if evicted:  # the caller needs them all at once: they must fit together
                raise CacheError(f"{len(objects)} objects ({evicted[0]}, ...) do not fit in the "
                                 f"node cache at once ({self.config.cache_max_bytes} bytes): "
                                 "raise --cache-max-gb")
        return local

    def local_dir(self, path: PathOrURL) -> str:
        """A local directory: the path itself, or the node's copies of every object under the
        prefix (a trailing ``/`` is implied)."""
        if isinstance(path, ObjectURL) or is_object_url(path):
            directory, _ = self.cache.fetch_prefix(path)
            return directory
        return os.fspath(path)

    def local_indexed_datasets(self, prefixes: Sequence[PathOrURL]) -> list[str]:
        """Local Megatron indexed-dataset prefixes (``PREFIX.idx`` + ``PREFIX.bin`` each); the
        objects among them are downloaded in order, ``--prefetch-shards`` ahead."""
        files = [f for p in prefixes for f in (f"{p}.idx", f"{p}.bin")]
        local = self.local_files(files)
        return [idx[: -len(".idx")] for idx in local[0::2]]

    def expand(self, path: PathOrURL, suffix: str) -> list[PathOrURL]:
        """A prefix URL (ending in ``/``) -> its objects whose keys end with ``suffix``, in key
        order (the shard order); anything else -> itself."""
        if not (isinstance(path, ObjectURL) or is_object_url(path)):
            return [path]
        url = path if isinstance(path, ObjectURL) else parse_url(path)
        if not url.is_prefix:
            return [url]
        found = [info.url for info in self.store.list(url) if info.url.key.endswith(suffix)]
        if not found:
            raise ObjectNotFoundError(f"{url}: no '*{suffix}' objects under this prefix")
        return found

    def prefetcher(self, urls: Sequence[PathOrURL]) -> ShardPrefetcher:
        return ShardPrefetcher(self.cache, urls, self.config.prefetch_shards)

    # -- outputs ---------------------------------------------------------------------------------

    def output_mirror(self, keep_last: int) -> Optional[OutputMirror]:
        """The mirror of ``--output-url`` (None without one)."""
        if self.config.output_url is None:
            return None
        return OutputMirror(self.store, parse_url(self.config.output_url), keep_last)

    # -- start-up check --------------------------------------------------------------------------

    def preflight(self, inputs: Sequence[PathOrURL], outputs: Sequence[PathOrURL] = ()) -> None:
        """Raise a one-line StorageError unless the inputs are readable and outputs writable
        (see :mod:`megatron_slmoe.storage.preflight`); ``--output-url`` is always an output."""
        from megatron_slmoe.storage.preflight import preflight_check

        outputs = list(outputs) + ([self.config.output_url] if self.config.output_url else [])
        preflight_check(inputs, outputs, self.config, self.store)
