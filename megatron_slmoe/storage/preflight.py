"""The start-up check of the object-storage URLs a run will use, before any process group forms.

:func:`check_readable` reads what the run will read (a HEAD of an object, one listing page of a
prefix); :func:`check_writable` writes what it will write (a small probe object under an output
prefix, deleted again). Both run on the store of :func:`preflight_store`, whose retry budget is
short (``--storage-preflight-timeout``), and raise the first problem as one line naming the URL
and the endpoint: wrong credentials, a missing bucket or key, an unreachable endpoint.
``storage.checks`` names the flag (a ConfigError: exit code 2).
"""

from __future__ import annotations

import os
import socket

from megatron_slmoe.storage.config import StorageConfig
from megatron_slmoe.storage.client import ObjectStore, access_denied, describe_endpoint
from megatron_slmoe.storage.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    ObjectNotFoundError,
)
from megatron_slmoe.storage.retry import RetryPolicy
from megatron_slmoe.storage.urls import ObjectURL


def preflight_store(settings: StorageConfig, store: ObjectStore | None = None) -> ObjectStore:
    """``store`` (or a new one) under the start-up check's short retry policy."""
    policy = RetryPolicy(settings.preflight_timeout_seconds, settings.retry_backoff_seconds,
                         max_backoff_s=max(settings.retry_backoff_seconds, 2.0),
                         flag="--storage-preflight-timeout")
    return store.with_retry(policy) if store is not None else ObjectStore(policy)


def check_readable(store: ObjectStore, url: ObjectURL) -> None:
    """The object exists (or, for a prefix, some object under it) and may be read."""
    bucket_root = ObjectURL(url.scheme, url.authority, "")
    try:
        if url.is_prefix:
            if not store.any_under(url):
                raise ObjectNotFoundError(f"{url}: no objects under this prefix")
            return
        store.head(url)
    except AccessDeniedError as err:
        # A HEAD's 403 carries no reason; a listing's names it (InvalidAccessKeyId, ...).
        code = err.code
        try:
            store.any_under(bucket_root)
        except AccessDeniedError as listed:
            code = listed.code or code
        raise access_denied(url, code) from None
    except ObjectNotFoundError:
        try:
            store.any_under(bucket_root)
        except BucketNotFoundError:
            raise BucketNotFoundError(f"{url}: bucket {url.authority!r} does not exist on "
                                      f"{describe_endpoint(url)}") from None
        if not url.is_prefix and store.any_under(url.as_prefix()):
            raise ObjectNotFoundError(f"{url}: no such object, but objects exist under "
                                      f"{url.as_prefix()} (end the URL with '/' for all of them)"
                                      ) from None
        raise


def check_writable(store: ObjectStore, prefix: ObjectURL) -> None:
    """Objects may be written (and deleted) under ``prefix``."""
    probe = prefix.as_prefix().join(f".slmoe-write-check-{socket.gethostname()}-{os.getpid()}")
    store.put_bytes(probe, b"")
    store.delete(probe)
