"""Object storage (S3, MinIO, OBS through its S3 endpoint, msc profiles) and the node-local cache.

Its settings are the ``storage`` section of the run configuration (``megatron_slmoe.storage.config.
StorageConfig``: ``--cache-dir``, ``--cache-max-gb``, ...); a run's ``--output-url`` is in its
``output`` section.

A package of its own rather than part of ``data/``: it serves data (datasets, tokenizers), model
inputs (base checkpoints, adapters to start from) and outputs (checkpoints, adapters, summaries)
alike, and knows nothing about any of their formats.

Modules (one job each):
    urls       ``s3://bucket/key`` and ``msc://profile/path``: parsing, prefixes
    client     ``ObjectStore``: HEAD/GET/PUT/LIST/DELETE through multi-storage-client, errors
               classified once, every operation under the retry policy
    retry      backoff + total timeout for transient errors
    errors     one-line errors naming the URL, never a credential (masked by utils.redact)
    cache      ``NodeCache``: one verified download per node, LRU-bounded, crash-safe
    prefetch   ``ShardPrefetcher``: the next shards downloaded ahead of the reader
    stored_folder  ``StoredFolder``: a prefix as a folder, its bulk fetched as it is read
    transfer   directories to/from the store (manifest last), ``OutputMirror`` for a run's outputs
    preflight  the start-up check: every URL readable or writable, before any process group
               forms (``storage.checks`` runs it)
    checks     the start-up checks of a run's places: local inputs exist, outputs writable,
               every URL usable (once per node)
    session    ``Storage``: the above for one process, taking local paths and URLs alike
"""

from megatron_slmoe.storage.errors import StorageError
from megatron_slmoe.storage.session import Storage
from megatron_slmoe.storage.urls import ObjectURL, is_object_url, parse_url

__all__ = ["ObjectURL", "Storage", "StorageError", "is_object_url", "parse_url"]
