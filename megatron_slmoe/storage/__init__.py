"""Object storage (S3, MinIO, OBS through its S3 endpoint, msc profiles) and the node-local cache.

A package of its own rather than part of ``data/``: it serves data (datasets, tokenizers), model
inputs (base checkpoints, adapters to start from) and outputs (checkpoints, adapters, summaries)
alike, and knows nothing about any of their formats.

Modules (one job each):
    urls       ``s3://bucket/key`` and ``msc://profile/path``: parsing, prefixes
    config     ``StorageConfig``: the settings and their flags (``--cache-dir``, ``--output-url``...)
    client     ``ObjectStore``: HEAD/GET/PUT/LIST/DELETE through multi-storage-client, errors
               classified once, every operation under the retry policy
    retry      backoff + total timeout for transient errors
    errors     one-line errors naming the URL, never a credential (masked by utils.redact)
    cache      ``NodeCache``: one verified download per node, LRU-bounded, crash-safe
    prefetch   ``ShardPrefetcher``: the next shards downloaded ahead of the reader
    transfer   directories to/from the store (manifest last), ``OutputMirror`` for a run's outputs
    preflight  ``preflight_check``: every URL usable, before any process group forms
    session    ``Storage``: the above for one process, taking local paths and URLs alike
"""

from megatron_slmoe.storage.config import StorageConfig
from megatron_slmoe.storage.errors import StorageError
from megatron_slmoe.storage.preflight import preflight_check, preflight_or_exit
from megatron_slmoe.storage.session import Storage
from megatron_slmoe.storage.urls import ObjectURL, is_object_url, parse_url

__all__ = ["ObjectURL", "Storage", "StorageConfig", "StorageError", "is_object_url", "parse_url",
           "preflight_check", "preflight_or_exit"]
