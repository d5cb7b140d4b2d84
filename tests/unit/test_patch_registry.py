"""The patch registry: replacement by dotted name, rebinding of imported copies, idempotence,
loud failure on a missing target; and every registered patch target exists in the installed
megatron-core / torch (so an upgrade that moves one fails here instead of silently not patching)."""

import sys
import types

import pytest

from megatron_slmoe.platform.adaptors import adaptor_for
from megatron_slmoe.platform.adaptors.compat import register_without_te
from megatron_slmoe.platform.patching import PatchRegistry, PatchTargetError


@pytest.fixture
def fake_modules():
    """Two throwaway modules: `slmoe_fake_a` defines things, `slmoe_fake_b` imported one by name."""
    a = types.ModuleType("slmoe_fake_a")

    def greet():
        return "original"

    class Thing:
        @staticmethod
        def make():
            return "static"

        def value(self):
            return 1

    a.greet, a.Thing = greet, Thing
    b = types.ModuleType("slmoe_fake_b")
    b.greet = greet  # as `from slmoe_fake_a import greet` would
    sys.modules.update(slmoe_fake_a=a, slmoe_fake_b=b)
    yield a, b
    del sys.modules["slmoe_fake_a"], sys.modules["slmoe_fake_b"]


def test_replaces_and_rebinds_imported_copies(fake_modules):
    a, b = fake_modules
    registry = PatchRegistry()
    registry.register("slmoe_fake_a.greet", lambda: "patched", "test")
    registry.apply()
    assert a.greet() == "patched"
    assert b.greet() == "patched"


def test_apply_is_idempotent(fake_modules):
    a, _ = fake_modules
    calls = []

    def wrapper(original):
        calls.append(original)
        return lambda: original() + "+wrapped"

    registry = PatchRegistry()
    registry.wrap("slmoe_fake_a.greet", wrapper, "test")
    registry.apply()
    registry.apply()
    assert a.greet() == "original+wrapped"
    assert len(calls) == 1


def test_wrap_keeps_staticmethod_and_patches_methods(fake_modules):
    a, _ = fake_modules
    registry = PatchRegistry()
    registry.wrap("slmoe_fake_a.Thing.make", lambda fn: lambda: fn() + "!", "test")
    registry.wrap("slmoe_fake_a.Thing.value", lambda fn: lambda self: fn(self) + 1, "test")
    registry.apply()
    assert a.Thing.make() == "static!"
    assert a.Thing().make() == "static!"
    assert a.Thing().value() == 2


def test_missing_target_fails_loudly(fake_modules):
    registry = PatchRegistry()
    registry.register("slmoe_fake_a.no_such_function", lambda: None, "test")
    assert registry.missing_targets() == ["slmoe_fake_a.no_such_function"]
    with pytest.raises(PatchTargetError, match="no_such_function"):
        registry.apply()


def test_define_missing_only_fills_a_gap(fake_modules):
    a, _ = fake_modules
    registry = PatchRegistry()
    registry.define_missing("slmoe_fake_a.forgotten", None, "test")
    registry.define_missing("slmoe_fake_a.greet", None, "test")  # exists: left alone
    registry.apply()
    assert a.forgotten is None
    assert a.greet() == "original"


def test_cannot_register_after_apply_or_twice(fake_modules):
    registry = PatchRegistry()
    registry.register("slmoe_fake_a.greet", lambda: "x", "test")
    with pytest.raises(ValueError, match="twice"):
        registry.register("slmoe_fake_a.greet", lambda: "y", "test")
    registry.apply()
    with pytest.raises(RuntimeError, match="already applied"):
        registry.register("slmoe_fake_a.Thing", object, "test")


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_every_patch_target_exists_in_installed_packages(platform):
    registry = adaptor_for(platform)
    assert registry.missing_targets() == []


def test_compat_targets_exist_even_where_transformer_engine_is_installed(monkeypatch):
    monkeypatch.setattr(
        "megatron_slmoe.platform.adaptors.compat.transformer_engine_installed", lambda: False
    )
    registry = PatchRegistry()
    register_without_te(registry)
    assert registry.targets() and registry.missing_targets() == []


def test_every_patch_says_why():
    for entry in adaptor_for("cpu").describe():
        assert entry["reason"].strip(), entry["target"]


def test_a_class_is_only_replaced_by_a_subclass(fake_modules):
    a, _ = fake_modules
    original = a.Thing
    registry = PatchRegistry()
    registry.register("slmoe_fake_a.greet", lambda: "patched", "test")
    registry.register("slmoe_fake_a.Thing", lambda: original(), "test")
    with pytest.raises(PatchTargetError, match="subclass"):
        registry.apply()
    assert a.Thing is original and a.greet() == "original"  # nothing was half-applied

    class BetterThing(original):
        pass

    registry = PatchRegistry()
    registry.register("slmoe_fake_a.Thing", BetterThing, "test")
    registry.apply()
    assert a.Thing is BetterThing and a.Thing | None == BetterThing | None
