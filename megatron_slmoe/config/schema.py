"""How a configuration section is declared: a frozen dataclass whose fields are ``setting``s.

Each field carries its command-line flag (Megatron's spelling) and its help text, so the flags,
the ``--config`` YAML, ``--print-config`` and every error message are generated from the one
declaration::

    @dataclass(frozen=True)
    class LoRAConfig(Section):
        rank: int = setting(8, flag="--lora-rank", help="inner dimension r of every adapter")

        def validate(self) -> None:
            self.check(1 <= self.rank <= 256, "rank", f"must be in 1..256, got {self.rank}")

A section's values are type-checked when it is constructed (from flags, YAML or code), then
``validate()`` checks its own ranges; rules that span sections live in
``megatron_slmoe.training.config``.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, ClassVar, NoReturn

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.config.types import coerce, describe, matches


def setting(default: Any = dataclasses.MISSING, *, flag: str, help: str,
            default_factory: Any = dataclasses.MISSING,
            switches: dict[str, Any] | None = None, overrides: str | None = None) -> Any:
    """A field of a configuration section.

    ``flag``: the command-line flag. ``switches``: extra value-less flags that set the field to a
    fixed value (``{"--bf16": "bf16", "--fp32": "fp32"}``). ``overrides``: the field of a model
    file's section that this run setting replaces when given (see ``given_overrides``).
    """
    metadata = {"flag": flag, "help": help, "switches": dict(switches or {}),
                "overrides": overrides}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@functools.lru_cache(maxsize=None)
def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def settings(cls: type) -> list[dataclasses.Field]:
    """The fields of a section class that are settings (all of them, for our sections)."""
    return [f for f in dataclasses.fields(cls) if "flag" in f.metadata]


def given_overrides(section: "Section") -> dict[str, Any]:
    """``{model-file field: value}`` for each setting of ``section`` that declares the field it
    ``overrides`` and was given (differs from its default): a run flag over a model-file field by
    declaration, so no caller maps the two by hand."""
    changes = {}
    for f in settings(type(section)):
        target, value = f.metadata.get("overrides"), getattr(section, f.name)
        if target and value != _default(f):
            changes[target] = value
    return changes


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


class Section:
    """Base of the configuration sections (see the module doc)."""

    section_name: ClassVar[str] = ""
    """The section's key in YAML (``lora``)."""

    def __post_init__(self) -> None:
        for f in settings(type(self)):
            value = getattr(self, f.name)
            hint = hints(type(self))[f.name]
            if not matches(value, hint):
                self.fail(f.name, f"must be {describe(hint)}, got {value!r}")
            coerced = coerce(value, hint)
            if coerced is not value:
                object.__setattr__(self, f.name, coerced)
        self.validate()

    def validate(self) -> None:
        """The section's own rules; one ConfigError line naming the flag."""

    @classmethod
    def flag(cls, name: str) -> str:
        return next(f.metadata["flag"] for f in settings(cls) if f.name == name)

    def fail(self, name: str, message: str) -> NoReturn:
        """One line naming the field as YAML spells it, then its flag:
        ``lora.rank: --lora-rank must be ...``."""
        raise ConfigError(f"{self.section_name}.{name}: {self.flag(name)} {message}")

    def check(self, condition: bool, name: str, message: str) -> None:
        if not condition:
            self.fail(name, message)

    def check_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value <= 0:
                self.fail(name, f"must be positive, got {value}")

    def check_non_negative(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value < 0:
                self.fail(name, f"must be >= 0, got {value}")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in settings(type(self))}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
