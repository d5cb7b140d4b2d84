"""The storage section (object-storage URLs and the node-local cache) and the one check of
every setting that names a local path or an object-storage URL. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_slmoe.config.schema import Section, setting
from megatron_slmoe.storage.urls import SCHEMES, is_object_url, parse_url


@dataclass(frozen=True)
class StorageConfig(Section):
    """Object storage (s3:// and msc:// URLs) and the node-local cache. Credentials are not
    settings: they come from the environment or a profile file (see megatron_slmoe.storage)."""

    section_name = "storage"

    cache_dir: Optional[str] = setting(
        None, flag="--cache-dir",
        help="node-local directory (NVMe) of the object cache, shared by the ranks of a node "
             "(default: $SLMOE_CACHE_DIR, else a directory under /tmp)")
    cache_max_gb: float = setting(
        200.0, flag="--cache-max-gb",
        help="size bound of the cache; the least recently used objects are evicted beyond it")
    cache_revalidate_seconds: float = setting(
        60.0, flag="--cache-revalidate-seconds",
        help="a cached object whose ETag and size were checked against the store this recently "
             "is used without asking again (0: check on every open)")
    prefetch_shards: int = setting(
        2, flag="--prefetch-shards",
        help="data shards downloaded in the background ahead of the reader")
    retry_timeout_seconds: float = setting(
        1800.0, flag="--storage-retry-timeout",
        help="how long one storage operation retries transient errors (endpoint down, HTTP 5xx, "
             "timeouts) before the run fails; a run stalls meanwhile")
    retry_backoff_seconds: float = setting(
        0.5, flag="--storage-retry-backoff",
        help="first retry delay; it doubles up to 30 s")
    preflight_timeout_seconds: float = setting(
        20.0, flag="--storage-preflight-timeout",
        help="how long the start-up check of every object-storage URL retries before it refuses "
             "the run")

    def validate(self) -> None:
        check_locations(self, "cache_dir", local_only=True)
        self.check(self.cache_dir is None or bool(self.cache_dir), "cache_dir",
                   "must be a non-empty path")
        self.check_positive("cache_max_gb", "retry_timeout_seconds", "retry_backoff_seconds",
                            "preflight_timeout_seconds")
        self.check_non_negative("cache_revalidate_seconds", "prefetch_shards")


def check_locations(section: Section, *names: str, local_only: bool = False,
                    url_only: bool = False) -> None:
    """Fields that name a local path or an ``s3://`` / ``msc://`` URL: a URL must be well formed
    and carry no credentials (they come from the environment or a profile, never from a setting,
    so none reaches config.yaml); ``local_only`` / ``url_only`` fields take just one kind."""
    for name in names:
        value = getattr(section, name)
        if value is None:
            continue
        if is_object_url(value):
            section.check(not local_only, name, f"{value} must be a local path")
            try:
                parse_url(value)
            except ValueError as err:
                section.fail(name, str(err))
        else:
            section.check(not url_only, name, f"{value}: expected an "
                                              f"{' or '.join(s + '://' for s in SCHEMES)} URL")
