"""A registry of named monkey-patches, in the spirit of MindSpeed's patch manager.

A patch replaces one attribute named by its dotted path (``pkg.module.Class.attr``). Applying it
also rebinds every already-imported module that holds the original object under a global name
(``from torch.cuda import device`` style imports), so no stale reference keeps the old behaviour.
Applying is idempotent, and every target must exist: a renamed target in a new megatron-core
release fails loudly instead of silently not patching. A class may only be replaced by a subclass
of itself: other libraries in the same process use public classes in annotations
(``torch.cuda.Stream | None``) and isinstance checks.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from typing import Any, Callable


class PatchTargetError(RuntimeError):
    """A registered patch names an attribute that does not exist."""


@dataclass
class Patch:
    target: str
    replacement: Any
    reason: str
    original: Any = field(default=None, repr=False)
    define_missing: bool = False  # the target is a name the owner forgot to define


def resolve(dotted: str, must_exist: bool = True) -> tuple[Any, str]:
    """Return ``(owner, attribute)`` for a dotted name, importing the longest module prefix."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        try:
            owner = importlib.import_module(module_name)
        except ImportError:
            continue
        for name in parts[split:-1]:
            if not hasattr(owner, name):
                raise PatchTargetError(f"patch target {dotted!r}: {name!r} not found in {owner!r}")
            owner = getattr(owner, name)
        if must_exist and not hasattr(owner, parts[-1]):
            raise PatchTargetError(f"patch target {dotted!r}: {parts[-1]!r} not found in {owner!r}")
        return owner, parts[-1]
    raise PatchTargetError(f"patch target {dotted!r}: no importable module prefix")


@dataclass
class _Wrapped:
    wrapper: Callable[[Any], Any]


def _wrap_keeping_descriptor(owner: Any, attr: str, wrapper: Callable[[Any], Any]) -> Any:
    """Wrap a function, keeping a class's staticmethod/classmethod kind."""
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else None
    if isinstance(raw, (staticmethod, classmethod)):
        return type(raw)(wrapper(raw.__func__))
    return wrapper(getattr(owner, attr))


def _check_class_stays_class(patch: Patch) -> None:
    original, replacement = patch.original, patch.replacement
    if isinstance(original, type) and not (
        isinstance(replacement, type) and issubclass(replacement, original)
    ):
        raise PatchTargetError(
            f"patch {patch.target!r}: a class may only be replaced by a subclass of itself, "
            f"got {replacement!r}"
        )


class PatchRegistry:
    def __init__(self) -> None:
        self._patches: dict[str, Patch] = {}
        self._applied = False

    def register(self, target: str, replacement: Any, reason: str) -> None:
        if self._applied:
            raise RuntimeError(f"cannot register {target!r}: patches were already applied")
        if target in self._patches:
            raise ValueError(f"patch target {target!r} registered twice")
        self._patches[target] = Patch(target, replacement, reason)

    def define_missing(self, target: str, value: Any, reason: str) -> None:
        """Define a global that the owner module uses but fails to define (a bug upstream)."""
        self.register(target, value, reason)
        self._patches[target].define_missing = True

    def wrap(self, target: str, wrapper: Callable[[Any], Any], reason: str) -> None:
        """Register ``wrapper(original)`` as the replacement, resolved when patches are applied."""
        self.register(target, _Wrapped(wrapper), reason)

    def patch(self, target: str, reason: str) -> Callable[[Any], Any]:
        """Decorator form of :meth:`register`."""

        def wrap(replacement: Any) -> Any:
            self.register(target, replacement, reason)
            return replacement

        return wrap

    @property
    def applied(self) -> bool:
        return self._applied

    def targets(self) -> list[str]:
        return list(self._patches)

    def missing_targets(self) -> list[str]:
        missing = []
        for target in self._patches:
            try:
                resolve(target, must_exist=not self._patches[target].define_missing)
            except PatchTargetError:
                missing.append(target)
        return missing

    def apply(self) -> None:
        if self._applied:
            return
        resolved = [
            (patch, *resolve(patch.target, must_exist=not patch.define_missing))
            for patch in self._patches.values()
        ]
        # Resolve and check every replacement before changing anything: all or nothing.
        for patch, owner, attr in resolved:
            if patch.define_missing:
                continue
            patch.original = getattr(owner, attr)
            if isinstance(patch.replacement, _Wrapped):
                patch.replacement = _wrap_keeping_descriptor(owner, attr, patch.replacement.wrapper)
            _check_class_stays_class(patch)
        rebind: dict[int, Any] = {}
        for patch, owner, attr in resolved:
            if patch.define_missing:
                if not hasattr(owner, attr):
                    setattr(owner, attr, patch.replacement)
                continue
            setattr(owner, attr, patch.replacement)
            # Plain functions and classes can be imported by name elsewhere; rebind those copies.
            if callable(patch.original) and not isinstance(owner, type):
                rebind[id(patch.original)] = patch.replacement
        if rebind:
            for module in list(sys.modules.values()):
                namespace = getattr(module, "__dict__", None)
                if not namespace:
                    continue
                for name, value in list(namespace.items()):
                    replacement = rebind.get(id(value))
                    if replacement is not None and value is not replacement:
                        namespace[name] = replacement
        self._applied = True

    def describe(self) -> list[dict[str, str]]:
        return [{"target": p.target, "reason": p.reason} for p in self._patches.values()]
