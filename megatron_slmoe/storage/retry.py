"""Retries with exponential backoff under a total timeout: the one retry policy of the package.

Only :class:`~megatron_slmoe.storage.errors.TransientStorageError` is retried; every other
error is final at once. While an endpoint is down, an operation stalls (logging once when it
starts failing, then every 30 s) and continues when the endpoint returns; after ``timeout_s`` it
raises :class:`~megatron_slmoe.storage.errors.StorageTimeoutError` naming the operation and the
last error.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from megatron_slmoe.storage.errors import StorageTimeoutError, TransientStorageError

log = logging.getLogger(__name__)
T = TypeVar("T")

_REPORT_EVERY_S = 30.0


@dataclass(frozen=True)
class RetryPolicy:
    timeout_s: float                 # total time one operation may spend retrying
    initial_backoff_s: float = 0.5   # first delay; doubles per attempt (with jitter)
    max_backoff_s: float = 30.0
    flag: str = "--storage-retry-timeout"   # the setting named when the timeout is reached

    def delay(self, attempt: int) -> float:
        """Delay before retry ``attempt`` (0-based): exponential, with jitter so the ranks of a
        job do not retry in lockstep."""
        ceiling = min(self.max_backoff_s, self.initial_backoff_s * (2.0 ** min(attempt, 30)))
        return ceiling * random.uniform(0.5, 1.0)


def call_with_retry(operation: Callable[[], T], policy: RetryPolicy, what: str,
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> T:
    """``operation()``, retried on transient errors until ``policy.timeout_s`` has passed.

    ``what`` names the operation in the recovery message (e.g. ``"GET s3://bucket/key"``); the
    errors name it themselves.
    """
    start = clock()
    attempt, last_report = 0, None
    while True:
        try:
            result = operation()
        except TransientStorageError as err:
            now = clock()
            elapsed = now - start
            if elapsed >= policy.timeout_s:
                raise StorageTimeoutError(f"{err}; still failing after {elapsed:.0f} s of retries "
                                          f"({policy.flag} {policy.timeout_s:g})"
                                          ) from None
            if last_report is None or now - last_report >= _REPORT_EVERY_S:
                log.warning("storage: %s; retrying for up to %.0f s more", err,
                            policy.timeout_s - elapsed)
                last_report = now
            sleep(min(policy.delay(attempt), max(0.0, policy.timeout_s - elapsed)))
            attempt += 1
            continue
        if attempt:
            log.warning("storage: %s succeeded after %d retries (%.1f s)", what, attempt,
                        clock() - start)
        return result
