"""The package's floors: every import of a megatron_slmoe module, at module level or inside a
function, goes to a lower floor or stays inside its own package, and no modules import each
other in a circle. Parsed from the source (nothing is imported), so an import hidden in a function
counts as much as one at the top, and so does one under ``if TYPE_CHECKING:`` (an annotation
that names an upper floor depends on it all the same).

Imports of our own modules inside functions hide the map, so they are few and each file holding
one says why (``INSIDE_FUNCTIONS``): an optional or heavy dependency loaded only when used.
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
    ("data", "plan"),
    ("inference",),  # answering held-out prompts reads data (chat template, scoring)
    ("families",),
    ("hf",),
    ("runtime",),
    ("training",),
    ("commands", "preflight", "launch"),
    ("", "generate"),  # the root package (its lazy PLATFORM); python -m megatron_slmoe.generate and
    # every package's __main__
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


def imports_of(module: str) -> set[tuple[str, int]]:
    """(imported module of ours, line) for every import in ``module`` (``TYPE_CHECKING`` ones
    too)."""
    path = MODULES[module]
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
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
    if parts[-1] == "__main__":  # python -m megatron_slmoe.X: an entry point nothing imports
        return ""  # stands on the top floor, with the root package
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
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import megatron_slmoe.lora",
     {"megatron_slmoe.lora"}),
    ("from .config import SLMoEConfig", {"megatron_slmoe.moe.config"}),
])
def test_the_parser_sees_imports_inside_functions_type_checking_and_relative_ones(tmp_path, monkeypatch, source,
                                                                    expected):
    path = tmp_path / "probe.py"
    path.write_text(source)
    monkeypatch.setitem(MODULES, "megatron_slmoe.moe.probe", str(path))
    assert {target for target, _ in imports_of("megatron_slmoe.moe.probe")} == expected


CLI_START = ("CLI start-up: --help and a bad flag are one line in about 1 s; torch and "
             "Megatron-Core (about 15 s to import on a loaded 2-core machine) load once the flags "
             "are checked")

INSIDE_FUNCTIONS = {  # file under megatron_slmoe/ -> why its imports of our modules wait for a call
    "__init__.py": "import megatron_slmoe stays torch-free: PLATFORM is applied on first use",
    "commands/convert_hf.py": CLI_START,
    "commands/generate.py": CLI_START,
    "commands/merge_lora.py": CLI_START,
    "commands/preprocess_data.py": CLI_START,
    "commands/rank_sweep.py": CLI_START,
    "commands/train_tokenizer.py": CLI_START,
    "data/motion.py": "the demo-data generator stays torch-free (image_text_prepare needs torch)",
    "data/shapes.py": "the demo-data generator stays torch-free (image_text_prepare needs torch)",
    "data/pretrain.py": "Megatron-Core's indexed-dataset header (compat.megatron) loads where "
                        "stored pretraining data is read, like the module's other Megatron-Core "
                        "imports",
    "families/slmoe/family.py": "the registry imports every family: transformers (the modeling "
                                "module's config class) loads only when asked for",
    "hf/peft_export.py": "compat.peft imports peft, an optional dependency needed only to name "
                         "fused-expert targets",
    "moe/dispatch/__init__.py": "the factories import their dispatcher when called: the names "
                                "and the planner's byte rules load no collective code",
    "training/finetune.py": CLI_START,
}
LIMIT = 38
"""Imports of our own modules inside functions, package-wide, at most (271 before issue 39)."""


def imports_inside_functions(path: str) -> list[int]:
    """The lines of the imports of our own modules (absolute or relative) inside a function."""
    found = []

    def visit(node, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if inside and isinstance(child, ast.Import):
                if any(alias.name.split(".")[0] == "megatron_slmoe" for alias in child.names):
                    found.append(child.lineno)
            elif inside and isinstance(child, ast.ImportFrom):
                if child.level or (child.module or "").split(".")[0] == "megatron_slmoe":
                    found.append(child.lineno)
            visit(child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                      ast.Lambda)))

    visit(ast.parse(open(path, encoding="utf-8").read(), path), False)
    return found


def test_imports_inside_functions_are_few_and_each_file_says_why(capsys):
    counts = {}
    for path in MODULES.values():
        lines = imports_inside_functions(path)
        if lines:
            counts[os.path.relpath(path, PACKAGE_DIR).replace(os.sep, "/")] = len(lines)
    total = sum(counts.values())
    with capsys.disabled():
        print(f"\nimports of our modules inside functions: {total} in {len(counts)} files "
              f"(limit {LIMIT})")
    assert sorted(set(counts) - set(INSIDE_FUNCTIONS)) == [], "hoist them, or say why here"
    assert sorted(set(INSIDE_FUNCTIONS) - set(counts)) == [], "no longer needed: take it off"
    assert all(reason for reason in INSIDE_FUNCTIONS.values())
    assert total <= LIMIT, "hoist imports to the top of their module (or raise LIMIT with a reason)"


@pytest.mark.parametrize("source, expected", [
    ("def f():\n    from megatron_slmoe.moe.config import SLMoEConfig", [2]),
    ("def f():\n    def g():\n        from . import config\n    import os", [3]),
    ("class A:\n    def m(self):\n        import megatron_slmoe.lora", [3]),
    ("from megatron_slmoe.moe.config import SLMoEConfig\nimport torch\n"
     "def f():\n    import torch", []),
])
def test_imports_inside_functions_are_found_at_any_depth(tmp_path, source, expected):
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert imports_inside_functions(str(path)) == expected
