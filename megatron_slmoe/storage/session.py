"""Object storage as one process of a run sees it: its settings, the store and the node cache.

Every method takes local paths too and gives them back unchanged, so callers need no branches::

    storage = Storage(run.storage)                              # the run's storage section
    train_file = storage.local_file(run.data.train_data)        # s3://..., msc://... or a path
    base_dir = storage.local_dir(run.model.base_checkpoint)     # a prefix of objects, or a directory
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Sequence, Union

from megatron_slmoe.storage.config import StorageConfig
from megatron_slmoe.storage.cache import NodeCache, default_cache_dir
from megatron_slmoe.storage.client import ObjectStore
from megatron_slmoe.storage.errors import CacheError, ObjectNotFoundError
from megatron_slmoe.storage.prefetch import ShardPrefetcher
from megatron_slmoe.storage.retry import RetryPolicy
from megatron_slmoe.storage.stored_folder import StoredFolder
from megatron_slmoe.storage.transfer import OutputMirror
from megatron_slmoe.storage.urls import ObjectURL, is_object_url, parse_url

PathOrURL = Union[str, os.PathLike, ObjectURL]


def indexed_dataset_files(prefix: PathOrURL) -> list[str]:
    """The two files of a Megatron indexed dataset: ``PREFIX.idx`` and ``PREFIX.bin``."""
    return [f"{prefix}.idx", f"{prefix}.bin"]


class Storage:
    def __init__(self, config: Optional[StorageConfig] = None):
        self.config = config or StorageConfig()
        self.store = ObjectStore(RetryPolicy(self.config.retry_timeout_seconds,
                                             self.config.retry_backoff_seconds))
        self._cache: Optional[NodeCache] = None

    @property
    def cache_in_use(self) -> bool:
        """Whether anything went through the node cache in this process."""
        return self._cache is not None

    @property
    def cache_dir(self) -> str:
        """``--cache-dir``, else ``$SLMOE_CACHE_DIR``, else a per-user directory under /tmp."""
        return self.config.cache_dir or default_cache_dir()

    @property
    def cache(self) -> NodeCache:
        """The node cache (its directory is made on first use, so local-only runs make none)."""
        if self._cache is None:
            self._cache = NodeCache(self.store, self.cache_dir,
                                    int(self.config.cache_max_gb * 2**30),
                                    self.config.cache_revalidate_seconds)
        return self._cache

    # -- inputs ----------------------------------------------------------------------------------

    def local_file(self, path: PathOrURL) -> str:
        """A local path of the file: the path itself, or the node's copy of the object."""
        if is_object_url(path):
            return self.cache.fetch(path)
        return os.fspath(path)

    def local_files(self, paths: Sequence[PathOrURL]) -> list[str]:
        """Local paths of several files in order; objects are downloaded ``--prefetch-shards`` at
        a time in the background."""
        objects = [i for i, p in enumerate(paths) if is_object_url(p)]
        local = [os.fspath(p) if i not in objects else None for i, p in enumerate(paths)]
        if objects:
            with self.prefetcher([paths[i] for i in objects]) as prefetcher:
                for i, path in zip(objects, prefetcher):
                    local[i] = path
            evicted = [paths[i] for i in objects if not os.path.exists(local[i])]
            if evicted:  # the caller needs them all at once: they must fit together
                raise CacheError(f"{len(objects)} objects ({evicted[0]}, ...) do not fit in the "
                                 f"node cache at once ({self.cache.max_bytes} bytes): "
                                 "raise --cache-max-gb")
        return local

    def local_dir(self, path: PathOrURL) -> str:
        """A local directory: the path itself, or the node's copies of every object under the
        prefix (a trailing ``/`` is implied)."""
        if is_object_url(path):
            directory, _ = self.cache.fetch_prefix(path)
            return directory
        return os.fspath(path)

    def stored_folder(self, url: PathOrURL, eager: Callable[[str], bool]) -> StoredFolder:
        """The objects under ``url`` as a folder on this node: those ``eager`` selects by name
        now, the others as they are read (``--prefetch-shards`` downloads at a time)."""
        return StoredFolder(self.cache, url, eager, self.config.prefetch_shards)

    def local_shards(self, path: PathOrURL, suffix: str) -> list[str]:
        """Local paths of a data setting: a local file or one object -> its one path; a URL ending
        in ``/`` -> every object under it whose key ends with ``suffix``, in key order (the shard
        order), downloaded ``--prefetch-shards`` ahead."""
        return self.local_files(self.expand(path, suffix))

    def local_indexed_datasets(self, prefix: PathOrURL) -> list[str]:
        """Local Megatron indexed-dataset prefixes of a data setting: a local prefix -> itself; a
        URL -> the node's copies of ``PREFIX.idx`` and ``PREFIX.bin``; a URL ending in ``/`` ->
        every such pair under it, in key order."""
        if not is_object_url(prefix):
            return [os.fspath(prefix)]
        url = parse_url(prefix)
        prefixes = [str(idx)[: -len(".idx")] for idx in self.expand(url, ".idx")] \
            if url.is_prefix else [str(url)]
        local = self.local_files([f for p in prefixes for f in indexed_dataset_files(p)])
        return [idx[: -len(".idx")] for idx in local[0::2]]

    def expand(self, path: PathOrURL, suffix: str) -> list[PathOrURL]:
        """A URL ending in ``/`` -> its objects whose keys end with ``suffix``, in key order;
        anything else -> itself."""
        if not is_object_url(path) or not parse_url(path).is_prefix:
            return [path]
        url = parse_url(path)
        found = [info.url for info in self.store.list(url) if info.url.key.endswith(suffix)]
        if not found:
            raise ObjectNotFoundError(f"{url}: no '*{suffix}' objects under this prefix")
        return found

    def prefetcher(self, urls: Sequence[PathOrURL]) -> ShardPrefetcher:
        return ShardPrefetcher(self.cache, urls, self.config.prefetch_shards)

    # -- outputs ---------------------------------------------------------------------------------

    def output_mirror(self, output_url: Optional[str], keep_last: int) -> Optional[OutputMirror]:
        """The mirror of a run's outputs under ``output_url`` (None without one)."""
        if output_url is None:
            return None
        return OutputMirror(self.store, parse_url(output_url), keep_last)

