"""Keep credentials out of logs, config dumps, ``summary.json`` and error messages.

Three layers, each cheap enough to apply everywhere text leaves the process:

* :func:`redact` masks secrets inside free text: the values of credential-like environment
  variables (``AWS_SECRET_ACCESS_KEY``, ``*_TOKEN``, ``*_PASSWORD``, ...), values registered with
  :func:`register_secret` (e.g. keys read from a profile file), ``user:password@`` in URLs,
  pre-signed query parameters (``X-Amz-Signature=``, ``X-Amz-Credential=``, ...), ``Authorization``
  headers and ``key = value`` / ``"key": "value"`` pairs whose key names a secret.
* :func:`redact_mapping` returns a copy of a (nested) mapping for dumping: values under
  secret-like keys become ``***`` and every string goes through :func:`redact`.
* :class:`RedactingFilter` applies :func:`redact` to every log record passing a handler (botocore
  logs signed headers at DEBUG level).

The mask is :data:`MASK`; access key *ids* are masked too: they are not secret on AWS, but they
identify an account, and nothing here needs them in a message.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import Any, Iterable

MASK = "***"

# Names (environment variables, mapping keys, ``key=value`` in text) whose values are
# credentials, matched on the end of the name so that ``eos_token``, ``tokens_per_s`` or
# ``TOKENIZERS_PARALLELISM`` stay readable.
_SECRET_SUFFIX = (
    r"(?:secret(?:[_\-.]?access)?(?:[_\-.]?key)?|"
    r"(?:session|security|access|auth|refresh|bearer|api|hf|github|gh)[_\-.]?token|"
    r"password|passwd|api[_\-.]?key|private[_\-.]?key|access[_\-.]?key(?:[_\-.]?id)?|"
    r"credentials?|signature|authorization|awsaccesskeyid)")
_SECRET_NAME = re.compile(r"(?:^|[_\-.])" + _SECRET_SUFFIX + r"$", re.IGNORECASE)
# Too short to be a credential, and masking them would garble ordinary text ("1", "true").
_MIN_SECRET_LENGTH = 6

_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.\-]*://)[^/\s@]+@")
_AUTH_HEADER = re.compile(r"(?P<key>Authorization['\"]?\s*[:=]\s*['\"]?)[^'\"\n]+",
                          re.IGNORECASE)
# key=value, key: value, "key": "value", key='value' (also query-string parameters)
_PAIR = re.compile(r"(?<![A-Za-z0-9])(?P<key>[\"']?(?:[A-Za-z0-9]+[_\-.])*" + _SECRET_SUFFIX +
                   r"[\"']?\s*[:=]\s*)(?P<quote>[\"']?)(?P<value>[^\"'\s,;&}{]+)", re.IGNORECASE)

_registered: set[str] = set()
_registered_lock = threading.Lock()


def register_secret(value: Any) -> None:
    """Mask this value wherever :func:`redact` sees it from now on (this process)."""
    if isinstance(value, str) and len(value) >= _MIN_SECRET_LENGTH:
        with _registered_lock:
            _registered.add(value)


def _secret_values() -> list[str]:
    values = {v for name, v in os.environ.items()
              if _SECRET_NAME.search(name) and len(v) >= _MIN_SECRET_LENGTH}
    with _registered_lock:
        values |= _registered
    # Longest first, so a secret that contains another is masked whole.
    return sorted(values, key=len, reverse=True)


def redact(text: Any) -> str:
    """``text`` (made a str) with every credential this module knows about masked."""
    text = str(text)
    for secret in _secret_values():
        if secret in text:
            text = text.replace(secret, MASK)
    text = _URL_USERINFO.sub(lambda m: m.group("scheme") + MASK + "@", text)
    text = _AUTH_HEADER.sub(lambda m: m.group("key") + MASK, text)
    return _PAIR.sub(lambda m: m.group("key") + m.group("quote") + MASK, text)


def is_secret_key(name: Any) -> bool:
    """Whether a mapping key names a credential (``secret_key``, ``aws_session_token``, ...)."""
    return isinstance(name, str) and _SECRET_NAME.search(name) is not None


def redact_mapping(value: Any) -> Any:
    """A copy of a nested dict/list structure that is safe to dump (see the module doc)."""
    if isinstance(value, dict):
        return {k: (MASK if is_secret_key(k) and v not in (None, "") else redact_mapping(v))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_mapping(v) for v in value)
    if isinstance(value, str):
        return redact(value)
    return value


def register_secrets_in(mapping: Any) -> None:
    """Register every value under a secret-like key of a nested mapping (e.g. a loaded profile)."""
    if isinstance(mapping, dict):
        for key, value in mapping.items():
            if is_secret_key(key):
                register_secret(value)
            register_secrets_in(value)
    elif isinstance(mapping, (list, tuple)):
        for value in mapping:
            register_secrets_in(value)


class RedactingFilter(logging.Filter):
    """A handler filter that masks credentials in the formatted message of every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        if record.exc_info and record.exc_info[1] is not None:
            # The traceback text is formatted later from exc_info; format it now, cleaned.
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True


def install_log_redaction(handlers: Iterable[logging.Handler] | None = None) -> None:
    """Attach one :class:`RedactingFilter` to each handler (default: the root logger's)."""
    for handler in handlers if handlers is not None else logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
