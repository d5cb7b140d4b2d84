"""Object-storage URLs: ``s3://bucket/key`` and ``msc://profile/path``.

* ``s3://BUCKET/KEY``: any S3-compatible endpoint (AWS S3, MinIO, Huawei OBS through its S3
  endpoint). Endpoint, region and credentials come from the standard AWS environment variables or
  the AWS shared credentials file (see :mod:`megatron_slmoe.storage.client`).
* ``msc://PROFILE/PATH``: a profile of NVIDIA's multi-storage-client configuration file
  (``MSC_CONFIG`` or ``~/.msc_config.yaml``), the URLs Megatron-Core and megatron-energon read.

A key that ends with ``/`` (or is empty) names a prefix: every object under it. Keys are mirrored
as paths in the node-local cache, so empty, ``.`` and ``..`` segments are refused; so are
credentials written into the URL.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from megatron_slmoe.storage.errors import StorageConfigError
from megatron_slmoe.utils.redact import MASK

SCHEMES = ("s3", "msc")
_URL = re.compile(r"^(?P<scheme>[a-z0-9]+)://(?P<authority>[^/]*)(?:/(?P<key>.*))?$")
# S3's rules for bucket names (also MinIO's and OBS's); msc profile names are looser.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_PROFILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_USERINFO = re.compile(r"^[^@/]*:[^@]*@")  # "user:secret@" before the bucket


def is_object_url(path) -> bool:
    """Whether ``path`` is an object-storage URL (rather than a local path)."""
    return isinstance(path, ObjectURL) or (
        isinstance(path, str) and any(path.startswith(f"{s}://") for s in SCHEMES))


@dataclass(frozen=True)
class ObjectURL:
    """A parsed object-storage URL; ``str()`` gives it back in canonical form."""

    scheme: str      # "s3" or "msc"
    authority: str   # the bucket (s3) or the profile (msc)
    key: str         # the key (path) inside it, without a leading "/"; "" or ".../" for a prefix

    def __str__(self) -> str:
        return f"{self.scheme}://{self.authority}/{self.key}"

    @property
    def is_prefix(self) -> bool:
        return self.key == "" or self.key.endswith("/")

    @property
    def name(self) -> str:
        """The last segment of the key (``""`` for a prefix)."""
        return self.key.rsplit("/", 1)[-1]

    def join(self, *parts: str) -> "ObjectURL":
        """This prefix (a trailing ``/`` is implied) extended by ``parts``."""
        key = self.key.rstrip("/")
        for part in parts:
            part = part.strip("/")
            if part:
                key = f"{key}/{part}" if key else part
        return parse_url(f"{self.scheme}://{self.authority}/{key}")

    def as_prefix(self) -> "ObjectURL":
        return self if self.is_prefix else ObjectURL(self.scheme, self.authority, self.key + "/")

    def relative_to(self, prefix: "ObjectURL") -> str:
        """This object's key relative to ``prefix`` (which must contain it)."""
        base = prefix.as_prefix().key
        if (self.scheme, self.authority) != (prefix.scheme, prefix.authority) or \
                not self.key.startswith(base):
            raise StorageConfigError(f"{self} is not under {prefix}")
        return self.key[len(base):]


def parse_url(text) -> ObjectURL:
    """Parse an ``s3://`` or ``msc://`` URL (an ObjectURL comes back as it is); a one-line
    :class:`StorageConfigError` if malformed."""
    if isinstance(text, ObjectURL):
        return text
    text = os.fspath(text) if not isinstance(text, str) else text
    match = _URL.match(text)
    if match is None or match.group("scheme") not in SCHEMES:
        raise StorageConfigError(f"{text}: not an object-storage URL (expected "
                                 f"{' or '.join(s + '://...' for s in SCHEMES)})")
    scheme, authority, key = match.group("scheme"), match.group("authority"), match.group("key")
    rest = text.split("://", 1)[1]
    if "@" in authority or _USERINFO.match(rest):
        # Never echo it: the part before "@" is a credential (a secret key may hold a "/").
        raise StorageConfigError(f"{scheme}://{MASK}@{rest.rsplit('@', 1)[-1]}: credentials do "
                                 "not belong in the URL; set them in the environment or a profile")
    pattern, what = (_BUCKET, "bucket") if scheme == "s3" else (_PROFILE, "profile")
    if not pattern.match(authority):
        raise StorageConfigError(f"{text}: {authority!r} is not a valid {what} name")
    key = key or ""
    segments = key.split("/")
    inner = segments[:-1] if key.endswith("/") else segments
    if key and any(s in ("", ".", "..") for s in inner):
        raise StorageConfigError(f"{text}: empty, '.' or '..' path segments are not supported")
    if any(ord(c) < 32 for c in key):
        raise StorageConfigError(f"{text}: control characters in the key")
    return ObjectURL(scheme, authority, key)
