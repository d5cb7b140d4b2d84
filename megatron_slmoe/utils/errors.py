"""The one base class of the user's mistakes.

Every error type that means "the input is wrong" (a flag or file, a model or tokenizer that does
not fit, data or a stored object that is missing, damaged or changed, an output that cannot be
written) derives from :class:`InputError`. Such a failure repeats on every attempt, so a command
catches this one type, prints its one line and exits with code 2, and the training engine ends
the job instead of spending the restart budget on it. Anything else is a fault a restart may cure
(or a bug) and keeps its traceback.
"""

from __future__ import annotations

import errno


class InputError(Exception):
    """A mistake in what the user gave; the message is one line naming it and what to change."""


class OutputUnwritable(InputError, OSError):
    """The run's output cannot be written (a read-only file system, no permission, a full disk);
    ``errno`` and ``filename`` are the original OSError's."""


UNWRITABLE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EROFS, errno.EDQUOT})
"""Why a write fails again on a restart: no permission, a full disk or quota, a read-only file
system."""
