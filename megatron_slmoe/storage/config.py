"""Settings of object storage and the node-local cache (one frozen dataclass, flags made from it).

Defaults come from the environment where a cluster sets them per node (``SLMOE_CACHE_DIR``,
which the SLURM batch files point at node-local scratch) and are otherwise safe for one machine.
Credentials are deliberately *not* settings: they come from the environment or a profile file
(see :mod:`megatron_slmoe.storage.client`), so they never reach a config dump.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

CACHE_DIR_ENV = "SLMOE_CACHE_DIR"


def default_cache_dir() -> str:
    """``$SLMOE_CACHE_DIR``, else a per-user directory under the system's temporary directory."""
    return os.environ.get(CACHE_DIR_ENV) or os.path.join(tempfile.gettempdir(),
                                                         f"slmoe-cache-{os.getuid()}")


def _setting(default: Any, flag: str, doc: str, **kw) -> Any:
    meta = {"flag": flag, "help": doc}
    if callable(default):
        return field(default_factory=default, metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


@dataclass(frozen=True)
class StorageConfig:
    """Object storage and node-local cache settings of a run."""

    cache_dir: str = _setting(
        default_cache_dir, "--cache-dir",
        f"node-local directory (NVMe) of the object cache, shared by the ranks of a node "
        f"(default: ${CACHE_DIR_ENV}, else a directory under /tmp)")
    cache_max_gb: float = _setting(
        200.0, "--cache-max-gb",
        "size bound of the cache; least recently used objects are evicted beyond it")
    cache_revalidate_s: float = _setting(
        60.0, "--cache-revalidate-seconds",
        "a cached object whose ETag and size were checked against the store this recently is used "
        "without asking again (0: check on every open)")
    prefetch_shards: int = _setting(
        2, "--prefetch-shards", "data shards downloaded in the background ahead of the reader")
    retry_timeout_s: float = _setting(
        1800.0, "--storage-retry-timeout",
        "seconds one storage operation keeps retrying transient errors (endpoint down, 5xx, "
        "timeouts) before the run fails")
    retry_backoff_s: float = _setting(
        0.5, "--storage-retry-backoff", "first retry delay in seconds; doubles up to 30 s")
    preflight_timeout_s: float = _setting(
        20.0, "--storage-preflight-timeout",
        "seconds the start-up check of every object-storage URL may retry before exit code 2")
    output_url: Optional[str] = _setting(
        None, "--output-url",
        "s3:// or msc:// prefix that receives the run's checkpoints, adapter and summary (the "
        "output directory stays the local staging area); resume reads the newest stored "
        "checkpoint when the local one is older or missing")

    @property
    def cache_max_bytes(self) -> int:
        return int(self.cache_max_gb * (1 << 30))

    def validate(self) -> None:
        """Raise ``ValueError`` with one line naming the flag of the first bad setting."""
        from megatron_slmoe.storage.urls import is_object_url, parse_url

        def flag(name: str) -> str:
            return _FIELDS[name].metadata["flag"]

        if not self.cache_dir:
            raise ValueError(f"{flag('cache_dir')} must not be empty")
        if is_object_url(self.cache_dir):
            raise ValueError(f"{flag('cache_dir')} {self.cache_dir}: must be a local directory")
        for name in ("cache_max_gb", "retry_timeout_s", "retry_backoff_s", "preflight_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{flag(name)} must be positive, got {getattr(self, name)}")
        if self.cache_revalidate_s < 0:
            raise ValueError(f"{flag('cache_revalidate_s')} must be >= 0, got "
                             f"{self.cache_revalidate_s}")
        if self.prefetch_shards < 0:
            raise ValueError(f"{flag('prefetch_shards')} must be >= 0, got {self.prefetch_shards}")
        if self.output_url is not None:
            if not is_object_url(self.output_url):
                raise ValueError(f"{flag('output_url')} {self.output_url}: expected an s3:// or "
                                 "msc:// URL")
            try:
                parse_url(self.output_url)
            except ValueError as err:
                raise ValueError(f"{flag('output_url')}: {err}") from None

    # -- command line ----------------------------------------------------------------------------

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """One flag per field (defaults None: unset flags keep the dataclass defaults)."""
        group = parser.add_argument_group("object storage and node-local cache")
        hints = typing.get_type_hints(StorageConfig)
        for f in dataclasses.fields(StorageConfig):
            kind = hints[f.name]
            kind = next(t for t in typing.get_args(kind) if t is not type(None)) \
                if typing.get_origin(kind) is typing.Union else kind
            group.add_argument(f.metadata["flag"], dest=f.name, type=kind, default=None,
                               help=f.metadata["help"])

    @staticmethod
    def from_args(args: Any) -> "StorageConfig":
        """The config of parsed flags (``add_arguments``); unset ones keep their defaults."""
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(StorageConfig)
                 if getattr(args, f.name, None) is not None}
        return StorageConfig(**given)


_FIELDS = {f.name: f for f in dataclasses.fields(StorageConfig)}
