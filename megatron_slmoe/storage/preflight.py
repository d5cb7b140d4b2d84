"""The start-up check of every object-storage URL a run will use, before any process group forms.

:func:`preflight_check` reads what the run will read (HEAD of each object, one listing page of
each prefix) and writes what it will write (a small probe object under each output prefix,
deleted again), with a short retry budget (``--storage-preflight-timeout``). The first problem
is raised as one line naming the URL and the endpoint: wrong credentials, a missing bucket or
key, an unreachable endpoint. :func:`preflight_or_exit` prints it and exits with code 2.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Iterable

from megatron_slmoe.storage.client import ObjectStore, access_denied, describe_endpoint
from megatron_slmoe.storage.config import StorageConfig
from megatron_slmoe.storage.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    ObjectNotFoundError,
    StorageError,
)
from megatron_slmoe.storage.retry import RetryPolicy
from megatron_slmoe.storage.urls import ObjectURL, parse_url


def _readable(store: ObjectStore, url: ObjectURL) -> None:
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


def _writable(store: ObjectStore, prefix: ObjectURL) -> None:
    probe = prefix.as_prefix().join(f".slmoe-write-check-{socket.gethostname()}-{os.getpid()}")
    store.put_bytes(probe, b"")
    store.delete(probe)


def preflight_check(inputs: Iterable, outputs: Iterable = (), config: StorageConfig = None,
                    store: ObjectStore = None) -> None:
    """Raise a one-line :class:`StorageError` unless every input URL is readable and every
    output prefix writable. Local paths among them are ignored."""
    from megatron_slmoe.storage.urls import is_object_url

    config = config or StorageConfig()
    policy = RetryPolicy(config.preflight_timeout_s, config.retry_backoff_s,
                         max_backoff_s=max(config.retry_backoff_s, 2.0),
                         flag="--storage-preflight-timeout")
    store = store.with_retry(policy) if store is not None else ObjectStore(policy)
    for url in (parse_url(u) if not isinstance(u, ObjectURL) else u for u in inputs
                if isinstance(u, ObjectURL) or is_object_url(u)):
        _readable(store, url)
    for url in (parse_url(u) if not isinstance(u, ObjectURL) else u for u in outputs
                if isinstance(u, ObjectURL) or is_object_url(u)):
        _writable(store, url)


def preflight_or_exit(inputs: Iterable, outputs: Iterable = (), config: StorageConfig = None) -> None:
    """:func:`preflight_check` for a command line: one line on stderr and exit code 2."""
    try:
        preflight_check(inputs, outputs, config)
    except StorageError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
