"""Whether a value read from YAML, JSON or a flag fits a field's type hint: the one type checker of
every configuration file the project reads (run configs, model configs, adapter configs)."""

from __future__ import annotations

import math
import types
import typing
from typing import Any, Literal, Union


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or float, not a bool, finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def matches(value: Any, hint: Any) -> bool | None:
    """Whether ``value`` fits ``hint``; None when the hint has no YAML form (a callable, a dtype)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return is_int(value)
    if hint is float:  # infinity and NaN mean nothing in any setting we read
        return is_number(value)
    if hint is str:
        return isinstance(value, str)
    if hint is list:
        return isinstance(value, list)
    if hint is dict:
        return isinstance(value, dict)
    if origin is Literal:
        return any(value == arg and type(value) is type(arg) for arg in args)
    if origin in (Union, types.UnionType):
        results = [matches(value, arg) for arg in args]
        if any(results):
            return True
        return False if any(r is not None for r in results) else None
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        item = args[0] if args else Any
        if item is Any or item is Ellipsis:
            return True
        results = [matches(v, item) for v in value]
        return None if None in results else all(results)
    if origin is dict:
        return isinstance(value, dict)
    return None


def describe(hint: Any) -> str:
    """A type hint as a user reads it (``int``, ``Optional[int]``, ``Literal['a', 'b']``)."""
    text = str(hint).replace("typing.", "").replace("float", "finite float")
    if hint is float:
        return "a finite number"
    return getattr(hint, "__name__", text) if not typing.get_args(hint) else text


def wants_tuple(hint: Any) -> bool:
    """Whether a YAML list for this hint becomes a tuple (``window_size: Tuple[int, int]``)."""
    if typing.get_origin(hint) is tuple:
        return True
    return typing.get_origin(hint) in (Union, types.UnionType) and any(
        typing.get_origin(arg) is tuple for arg in typing.get_args(hint))


def coerce(value: Any, hint: Any) -> Any:
    """A value that ``matches`` its hint, in the hint's own Python type (int -> float for a float
    field, list -> tuple for a tuple field)."""
    if isinstance(value, list) and wants_tuple(hint):
        return tuple(value)
    if isinstance(value, tuple) and typing.get_origin(hint) in (list,):
        return list(value)
    base = _strip_optional(hint)
    if base is float and is_int(value):
        return float(value)
    return value


def _strip_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return hint


def literal_choices(hint: Any) -> tuple | None:
    """The allowed values of a (possibly Optional) Literal hint, else None."""
    base = _strip_optional(hint)
    return typing.get_args(base) if typing.get_origin(base) is Literal else None


def scalar_type(hint: Any) -> Any:
    """The element type a flag parses: int/float/str/bool, looking through Optional and list."""
    base = _strip_optional(hint)
    if typing.get_origin(base) in (list, tuple):
        base = typing.get_args(base)[0] if typing.get_args(base) else str
    choices = literal_choices(base)
    if choices:
        return type(choices[0])
    return base


def is_list(hint: Any) -> bool:
    return typing.get_origin(_strip_optional(hint)) in (list, tuple)


def is_optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (Union, types.UnionType) and type(None) in typing.get_args(hint)
