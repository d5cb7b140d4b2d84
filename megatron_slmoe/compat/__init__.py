"""Other libraries' private names, one module per library (``torch``, ``megatron``, ``peft``).

Everything megatron_slmoe reads or writes that a library does not publish goes through here or
through the patch registry (``platform.patching``), so that a release which moves one fails in one
place with one line naming the installed version (tests/unit/test_compat.py checks each name).
The replacements that adapt Megatron-Core to a device stay in ``platform.adaptors``.
"""

from __future__ import annotations

from importlib.metadata import version


class CompatError(RuntimeError):
    """An installed library no longer has a private name we rely on. The message is one line."""


def moved(distribution: str, what: str, tested: str) -> CompatError:
    """The error for a private name ``what`` that the installed ``distribution`` lacks."""
    return CompatError(f"{distribution} {version(distribution)} has no {what}, which "
                       f"megatron_slmoe relies on (tested with {distribution} {tested})")
