"""Object operations on ``s3://`` and ``msc://`` URLs through NVIDIA's multi-storage-client.

The client library is multi-storage-client (msc), the one Megatron-Core (``megatron.core.
msc_utils``, its dist-checkpoint reader/writer and indexed datasets) and megatron-energon
(``EPath``) read object storage with; its S3 provider is boto3. What this module adds:

* where settings come from. ``s3://BUCKET/KEY`` uses the standard AWS variables, so the same
  environment works for the aws CLI:

  ==========================================  =============================================
  ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``  endpoint (MinIO, OBS ``https://obs.<region>.
                                                  myhuaweicloud.com``; unset: AWS S3)
  ``AWS_REGION`` / ``AWS_DEFAULT_REGION``         region for request signing (default us-east-1)
  ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, credentials; or ``AWS_PROFILE`` with
  ``AWS_SESSION_TOKEN``                           ``~/.aws/credentials`` (``AWS_SHARED_CREDENTIALS_FILE``)
  ``SLMOE_S3_ADDRESSING_STYLE``                   ``path`` or ``virtual`` (default: boto3's choice)
  ==========================================  =============================================

  ``msc://PROFILE/PATH`` uses that profile of the msc configuration file (``MSC_CONFIG``, else
  ``~/.msc_config.yaml``), with msc's ``${VAR}`` expansion for credentials.
* one retry policy (:mod:`megatron_slmoe.storage.retry`) for every operation: msc retries only
  what it classifies as retryable (not a refused connection), so its own retries are turned off
  for the profiles built here and every failure is classified once, in :func:`classify`.
* one-line errors naming the URL and the endpoint, never a credential
  (:mod:`megatron_slmoe.storage.errors`).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import IO, Callable, Optional, TypeVar, Union

from megatron_slmoe.storage.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    EndpointUnreachableError,
    ObjectChangedError,
    ObjectNotFoundError,
    StorageConfigError,
    StorageError,
    TransientStorageError,
)
from megatron_slmoe.utils.redact import register_secret, register_secrets_in
from megatron_slmoe.storage.retry import RetryPolicy, call_with_retry
from megatron_slmoe.storage.urls import ObjectURL, parse_url

log = logging.getLogger(__name__)
T = TypeVar("T")

_CONNECT_TIMEOUT_S = 10
_READ_TIMEOUT_S = 60


@dataclass(frozen=True)
class ObjectInfo:
    """What the store says about one object."""

    url: ObjectURL
    size: int
    etag: Optional[str]


# --- where settings come from ---------------------------------------------------------------------


def s3_endpoint() -> Optional[str]:
    """The S3 endpoint of ``s3://`` URLs (None: AWS's own)."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def _s3_profile(bucket: str) -> dict:
    options = {
        "base_path": bucket,
        "region_name": os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        or "us-east-1",
        "connect_timeout": _CONNECT_TIMEOUT_S,
        "read_timeout": _READ_TIMEOUT_S,
        # botocore's own retries stay short: the retry loop here decides how long to wait.
        "retries": {"mode": "standard", "total_max_attempts": 2},
    }
    endpoint = s3_endpoint()
    if endpoint:
        options["endpoint_url"] = endpoint
    style = os.environ.get("SLMOE_S3_ADDRESSING_STYLE", "").strip()
    if style:
        if style not in ("path", "virtual", "auto"):
            raise StorageConfigError(f"SLMOE_S3_ADDRESSING_STYLE={style!r}: expected path, "
                                     "virtual or auto")
        options["s3"] = {"addressing_style": style}
    # No credentials here: boto3's chain finds them (environment, AWS_PROFILE, instance role).
    return {"storage_provider": {"type": "s3", "options": options}, "retry": {"attempts": 1}}


def _msc_config(profile: str):
    from multistorageclient import StorageClientConfig
    from multistorageclient.utils import expand_env_vars

    raw, path = StorageClientConfig.read_msc_config()
    register_secrets_in(expand_env_vars(raw or {}))
    if profile not in (raw or {}).get("profiles", {}):
        where = path or "no configuration file found; set MSC_CONFIG"
        raise StorageConfigError(f"msc://{profile}/: no profile {profile!r} in the "
                                 f"multi-storage-client configuration ({where})")
    return StorageClientConfig.from_file(profile=profile)


def _register_boto3_credentials() -> None:
    """Mask the credentials boto3 will sign with, wherever they come from (a shared credentials
    file or a role as well as the environment)."""
    import boto3

    credentials = boto3.Session().get_credentials()
    if credentials is not None:
        frozen = credentials.get_frozen_credentials()
        for value in (frozen.access_key, frozen.secret_key, frozen.token):
            register_secret(value)


def describe_endpoint(url: ObjectURL) -> str:
    """Where requests for ``url`` go, for messages (never with credentials)."""
    if url.scheme == "s3":
        return s3_endpoint() or "AWS S3"
    return f"msc profile {url.authority!r}"


# --- classification of failures -------------------------------------------------------------------

_UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionRefusedError",
                "gaierror", "NewConnectionError", "ProxyConnectionError"}
_TRANSIENT = {"ReadTimeoutError", "IncompleteReadError", "ResponseStreamingError",
              "ConnectionClosedError", "ProtocolError", "IncompleteRead", "ConnectionResetError",
              "ConnectionAbortedError", "BrokenPipeError", "TimeoutError", "RetryableError",
              "RemoteDisconnected"}
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError"}
_TRANSIENT_CODES = {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable",
                    "Throttling", "ThrottlingException"}


def access_denied(url: ObjectURL, code: Optional[str], operation: str = "") -> AccessDeniedError:
    """The error of an HTTP 403 (``code``: the store's reason, where it gave one)."""
    where = f"{operation} {url}".strip()
    return AccessDeniedError(f"{where}: access denied by {describe_endpoint(url)} "
                             f"({code or 'HTTP 403'}): check the credentials and the permissions "
                             "on the bucket", code)


def _chain(err: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while err is not None and len(seen) < 16 and err not in seen:
        seen.append(err)
        err = err.__cause__ or err.__context__
    return seen


def classify(err: BaseException, url: ObjectURL, operation: str) -> StorageError:
    """The :class:`StorageError` kind of a failure raised by msc / boto3 for ``url``."""
    if isinstance(err, StorageError):
        return err
    chain = _chain(err)
    names = {type(e).__name__ for e in chain}
    codes, statuses = [], []
    for e in chain:
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            codes.append(str(response.get("Error", {}).get("Code", "")))
            statuses.append(response.get("ResponseMetadata", {}).get("HTTPStatusCode"))
    endpoint = describe_endpoint(url)
    where = f"{operation} {url}"
    if "NoSuchBucket" in codes:
        return BucketNotFoundError(f"{url}: bucket {url.authority!r} does not exist on {endpoint}")
    if names & _NO_CREDENTIALS:
        return AccessDeniedError(f"{url}: no credentials for {endpoint}: set AWS_ACCESS_KEY_ID "
                                 "and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or use an msc:// "
                                 "profile")
    if 403 in statuses or "PermissionError" in names:
        code = next((c for c in codes if c and c != "403"), None)
        return access_denied(url, code, operation)
    if 404 in statuses or "FileNotFoundError" in names:
        return ObjectNotFoundError(f"{url}: no such object on {endpoint}")
    if names & _UNREACHABLE:
        kind = ("connection refused" if "ConnectionRefusedError" in names else
                "connect timeout" if "ConnectTimeoutError" in names else
                "host name not resolved" if "gaierror" in names else "no connection")
        return EndpointUnreachableError(f"{where}: cannot connect to {endpoint} ({kind})")
    if any(s is not None and (s >= 500 or s in (408, 429)) for s in statuses) or \
            set(codes) & _TRANSIENT_CODES:
        status = next((s for s in statuses if s is not None), "?")
        return TransientStorageError(f"{where}: {endpoint} answered HTTP {status}")
    if names & _TRANSIENT:
        kind = sorted(names & _TRANSIENT)[0]
        return TransientStorageError(f"{where}: transfer from {endpoint} broke off ({kind})")
    root = chain[-1]
    first_line = (str(root).splitlines() or [""])[0][:200]
    return StorageError(f"{where} failed on {endpoint}: {type(root).__name__}: {first_line}")


# --- the store ------------------------------------------------------------------------------------


class ObjectStore:
    """Operations on object URLs, each retried under one :class:`RetryPolicy`.

    Thread-safe; one msc client per bucket or profile, made on first use.
    """

    def __init__(self, retry: RetryPolicy):
        self.retry = retry
        self._clients: dict[tuple[str, str], object] = {}
        self._lock = threading.Lock()
        # This module reports retries itself, once per stall and naming the URL.
        logging.getLogger("multistorageclient.retry").setLevel(logging.CRITICAL)

    def with_retry(self, retry: RetryPolicy) -> "ObjectStore":
        """The same clients under another retry policy (e.g. the short one of the start-up check)."""
        other = ObjectStore.__new__(ObjectStore)
        other.retry, other._clients, other._lock = retry, self._clients, self._lock
        return other

    def connect(self, url: Union[str, ObjectURL]) -> None:
        """Set up the client of ``url``'s bucket or profile now (it is otherwise made on first use),
        e.g. before timing a data path."""
        self._client(parse_url(url))

    def _client(self, url: ObjectURL):
        key = (url.scheme, url.authority)
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                client = self._clients[key] = self._make_client(url)
            return client

    @staticmethod
    def _make_client(url: ObjectURL):
        try:
            from multistorageclient import StorageClient, StorageClientConfig
        except ImportError:  # the client is an optional dependency: say which extra brings it
            raise StorageConfigError(f"{url}: object storage needs multi-storage-client and "
                                     "boto3: pip install 'megatron-slmoe[s3]'") from None
        try:
            if url.scheme == "s3":
                profile = f"slmoe-s3-{url.authority}"
                config = StorageClientConfig.from_dict({"profiles": {profile: _s3_profile(
                    url.authority)}}, profile=profile)
                _register_boto3_credentials()
            else:
                config = _msc_config(url.authority)
            return StorageClient(config)
        except StorageError:
            raise
        except Exception as err:  # msc: ValueError / jsonschema errors on a bad profile
            raise StorageConfigError(f"{url}: cannot set up the storage client: "
                                     f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                                     ) from None

    def _call(self, url: ObjectURL, operation: str, fn: Callable[[object], T]) -> T:
        def attempt() -> T:
            client = self._client(url)
            try:
                return fn(client)
            except Exception as err:  # classified: nothing unclassified leaves this module
                raise classify(err, url, operation) from None

        return call_with_retry(attempt, self.retry, f"{operation} {url}")

    # -- reading ---------------------------------------------------------------------------------

    def head(self, url: ObjectURL) -> ObjectInfo:
        """Size and ETag of one object (ObjectNotFoundError for a missing key)."""
        # strict=False: one HEAD, without msc's follow-up listing that looks for a "directory".
        meta = self._call(url, "HEAD", lambda c: c.info(url.key, strict=False))
        return ObjectInfo(url, int(meta.content_length), meta.etag)

    def list(self, prefix: ObjectURL) -> list[ObjectInfo]:
        """Every object under ``prefix`` (a trailing ``/`` is implied), sorted by key."""
        prefix = prefix.as_prefix()

        def listing(client) -> list:
            return list(client.list(path=prefix.key))

        found = []
        for meta in self._call(prefix, "LIST", listing):
            if meta.type == "file":
                key = meta.key.lstrip("/")
                found.append(ObjectInfo(parse_url(f"{prefix.scheme}://{prefix.authority}/{key}"),
                                        int(meta.content_length), meta.etag))
        return sorted(found, key=lambda info: info.url.key)

    def any_under(self, prefix: ObjectURL) -> bool:
        """Whether any object exists under ``prefix`` (one page of a listing, not all of it)."""
        prefix = prefix.as_prefix()

        def first(client) -> bool:
            for meta in client.list(path=prefix.key):
                if meta.type == "file":
                    return True
            return False

        return self._call(prefix, "LIST", first)

    def download(self, info: ObjectInfo, sink: IO[bytes]) -> None:
        """Write the object's bytes into ``sink`` (a seekable binary file), which is rewound
        before every attempt; a short body is an error, never a result."""
        from multistorageclient.types import AWARE_DATETIME_MIN, ObjectMetadata

        meta = ObjectMetadata(key=info.url.key, type="file", content_length=info.size,
                              last_modified=AWARE_DATETIME_MIN, etag=info.etag)

        def get(client) -> None:
            sink.seek(0)
            sink.truncate()
            client.download_file(info.url.key, sink, meta)
            sink.flush()
            # The file's end, not tell(): large objects arrive as ranged parts written in any order.
            received = sink.seek(0, os.SEEK_END)
            if received != info.size:
                # A cut transfer is an exception in botocore; a complete one of another size
                # is another version of the object.
                raise ObjectChangedError(f"GET {info.url}: received {received} bytes, "
                                         f"expected {info.size}")

        self._call(info.url, "GET", get)

    def get_bytes(self, url: ObjectURL) -> bytes:
        return self._call(url, "GET", lambda c: bytes(c.read(url.key)))

    def exists(self, url: ObjectURL) -> bool:
        try:
            self.head(url)
            return True
        except ObjectNotFoundError:
            return False

    # -- writing ---------------------------------------------------------------------------------

    def upload(self, local_path: str, url: ObjectURL) -> None:
        """One file to one object; S3 makes it visible only complete (multipart included)."""
        self._call(url, "PUT", lambda c: c.upload_file(url.key, local_path))

    def put_bytes(self, url: ObjectURL, data: bytes) -> None:
        self._call(url, "PUT", lambda c: c.write(url.key, data))

    def delete(self, url: ObjectURL) -> None:
        """Delete one object; a missing one is not an error."""
        def remove(client) -> None:
            try:
                client.delete(url.key)
            except FileNotFoundError:
                pass

        self._call(url, "DELETE", remove)
