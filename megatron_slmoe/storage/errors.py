"""Errors of the storage package: one line each, naming the URL, never a credential.

``StorageError`` is the base; the kinds below tell a caller (and the retry loop) what to do:

* :class:`TransientStorageError`: the store may answer later (connection refused or reset, a
  timeout, a truncated body, HTTP 5xx, throttling). Retried with backoff until the total
  timeout; then :class:`StorageTimeoutError`.
* the rest are permanent: retrying does not help (wrong credentials, a missing bucket or key,
  a malformed URL, an object too large for the cache, ...).

Every message goes through :func:`~megatron_slmoe.utils.redact.redact` when the error is made.
"""

from __future__ import annotations

from megatron_slmoe.utils.errors import InputError
from megatron_slmoe.utils.redact import redact


class StorageError(Exception):
    """An object-storage operation failed. The message is one line and holds no secret."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(redact(" ".join(str(message).split())))
        self.code = code  # the store's error code where it gave one (e.g. "InvalidAccessKeyId")


class StorageConfigError(StorageError, InputError, ValueError):
    """A malformed URL or storage setting (the user's input)."""


class TransientStorageError(StorageError):
    """The store did not answer usefully this time; the same request may succeed later."""


class StorageTimeoutError(StorageError):
    """A transient failure outlasted the total retry timeout."""


class EndpointUnreachableError(TransientStorageError):
    """No connection to the endpoint (refused, DNS, connect timeout)."""


class AccessDeniedError(StorageError, InputError, PermissionError):
    """HTTP 403: wrong or missing credentials, or no permission on the bucket or key."""


class BucketNotFoundError(StorageError, InputError, FileNotFoundError):
    """The bucket does not exist on this endpoint."""


class ObjectNotFoundError(StorageError, InputError, FileNotFoundError):
    """No object under this key (or, for a prefix, no object under it)."""


class ObjectChangedError(StorageError, InputError):
    """A download's size differs from what was expected of the object (it was replaced while
    being read, or a manifest describes another version of it)."""


class CacheError(StorageError, InputError):
    """The node-local cache cannot hold or serve an object (too large, unwritable directory)."""
