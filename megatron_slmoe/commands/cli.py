"""What every console script does with a user's mistake: one ``error:`` line on stderr and exit
code 2, never a traceback. Anything else is a bug and keeps its traceback."""

from __future__ import annotations

import functools
import sys
from typing import Callable, Union

from megatron_slmoe.utils.errors import InputError


class BadInput(InputError):
    """A user's mistake a command found itself: one line for the user, exit code 2."""


USER_ERRORS = ("megatron_slmoe.platform.PlatformError",)
"""Raised by any command that starts the platform (no device, a bad device setting)."""


def _is_user_error(err: BaseException, kinds) -> bool:
    for kind in (BadInput, InputError, *kinds, *USER_ERRORS):
        if isinstance(kind, str):  # "module.Class": only if that module was imported
            module, _, name = kind.rpartition(".")
            kind = getattr(sys.modules.get(module), name, None)
            if kind is None:
                continue
        if isinstance(err, kind):
            return True
    return False


def user_errors(*kinds: Union[type, str]) -> Callable:
    """Decorate a command's ``main(argv)``: BadInput, the user's mistakes
    (``utils.errors.InputError``), a platform error and the exception types ``kinds`` (classes,
    or ``"module.Class"`` names for modules the command imports lazily) print
    ``error: <message>`` and return 2."""

    def decorate(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(argv=None) -> int:
            try:
                return main(argv)
            except Exception as err:  # noqa: BLE001  (sorted below: user mistake or bug)
                if not _is_user_error(err, kinds):
                    raise
                print(f"error: {err}", file=sys.stderr)
                return 2

        return run

    return decorate
