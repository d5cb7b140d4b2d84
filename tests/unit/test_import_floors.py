"""The package's floors: every import of a megatron_slmoe module, at module level or inside a
function, goes to a lower floor or stays inside its own package, and no modules import each
other in a circle. Parsed from the source (nothing is imported), so an import hidden in a function
counts as much as one at the top. ``if TYPE_CHECKING:`` imports are annotations only and are not
imports at run time.
"""

from __future__ import annotations

import ast
import os
from collections import defaultdict

import pytest

import megatron_slmoe

PACKAGE_DIR = os.path.dirname(megatron_slmoe.__file__)

FLOORS = (  # bottom to top; README "Package layout" shows the same map
    ("utils",),
    ("config", "compat"),
    ("ops",),
    ("platform", "parallel", "storage"),
    ("moe",),
    ("lora", "model"),
    ("hf", "data", "plan", "inference"),
    ("runtime",),
    ("training",),
    ("commands", "preflight", "launch"),
    ("", "generate"),  # the root package (its lazy PLATFORM); python -m megatron_slmoe.generate
)
FLOOR_OF = {package: level for level, packages in enumerate(FLOORS) for package in packages}


def _modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(PACKAGE_DIR):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                relative = os.path.relpath(path, os.path.dirname(PACKAGE_DIR))[:-3]
                module = relative.replace(os.sep, ".").removesuffix(".__init__")
                found[module] = path
    return found


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module of ours that an import of ``name`` loads last (a name imported from a module is
    that module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING",
                                                                  "typing.TYPE_CHECKING"):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(module: str) -> set[tuple[str, int]]:
    """(imported module of ours, line) for every run-time import in ``module``."""
    path = MODULES[module]
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    skipped = _type_checking_lines(tree)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "megatron_slmoe":
                owner = _owner(target)
                if owner and owner != module:
                    found.add((owner, node.lineno))
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_package_is_on_a_floor():
    packages = {_package(module) for module in MODULES}
    assert packages - set(FLOOR_OF) == set(), "add the new package to FLOORS"


def test_imports_only_go_down():
    upward = []
    for module, targets in GRAPH.items():
        here = _package(module)
        for target, line in sorted(targets):
            there = _package(target)
            if there != here and FLOOR_OF[there] >= FLOOR_OF[here]:
                upward.append(f"{module}:{line} imports {target} (floor {FLOOR_OF[here]} -> "
                              f"{FLOOR_OF[there]})")
    assert upward == []


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    edges = defaultdict(set)
    for module, targets in GRAPH.items():
        edges[module] = {target for target, _ in targets}

    def visit(node):  # iterative depth-first search: the graph is deep enough for recursion
        work = [(node, iter(sorted(edges[node])))]
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        while work:
            current, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[current])
                if low[current] == index[current]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == current:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in on_stack:
                low[current] = min(low[current], index[child])

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles():
    assert _cycles() == []


@pytest.mark.parametrize("source, expected", [
    ("from megatron_slmoe.moe.config import SLMoEConfig", {"megatron_slmoe.moe.config"}),
    ("def f():\n    import megatron_slmoe.lora.targets", {"megatron_slmoe.lora.targets"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import megatron_slmoe.lora", set()),
    ("from .config import SLMoEConfig", {"megatron_slmoe.moe.config"}),
])
def test_the_parser_sees_imports_inside_functions_and_relative_ones(tmp_path, monkeypatch, source,
                                                                    expected):
    path = tmp_path / "probe.py"
    path.write_text(source)
    monkeypatch.setitem(MODULES, "megatron_slmoe.moe.probe", str(path))
    assert {target for target, _ in imports_of("megatron_slmoe.moe.probe")} == expected
