"""Sizes in lines meant for people."""

from __future__ import annotations

_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(count: float) -> str:
    """``count`` bytes in the largest binary unit that keeps the figure at least 1, with three
    significant digits (``4.00 KiB``, ``512 MiB``, ``1.25 GiB``): a small free space or need
    does not read as ``0.00 GiB``."""
    value, unit = float(count), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{int(count)} bytes"
    shown = f"{value:.0f}" if abs(value) >= 1000 else f"{value:#.3g}".rstrip(".")
    return f"{shown} {_UNITS[unit]}"
