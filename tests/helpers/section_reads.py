"""Which run-configuration fields package code reads, found by parsing (nothing is imported).

A field ``f`` of section ``S`` is read where an attribute ``.f`` is taken of an expression that
holds that section:

* ``<run>.S`` where ``<run>`` is a run configuration (a name or attribute called ``run`` or
  ``run_config``, or one annotated ``RunConfig``);
* a name annotated with ``S``'s class, or assigned such an expression (``schedule = run.schedule``,
  ``data, schedule = self.data, self.schedule``), in the same function;
* ``self.x`` where the class assigns ``self.x`` such an expression;
* ``run_section(args, "S")`` (a command's own flags for the section).

Reads inside the section's own class (its checks) do not count: a field is meant to be used.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

RUN_NAMES = {"run", "run_config"}


def _last_name(node: ast.AST):
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _annotated_class(annotation):
    """The class an annotation names: ``X``, ``"X"``, ``Optional[X]``, ``X | None``."""
    if isinstance(annotation, ast.Name):
        return annotation.id
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotation.value.split("[")[-1].split("|")[0].strip(" ]\"'")
    if isinstance(annotation, ast.Subscript):
        return _annotated_class(annotation.slice)
    if isinstance(annotation, ast.BinOp):
        return _annotated_class(annotation.left)
    return None


class _Reads(ast.NodeVisitor):
    def __init__(self, sections: dict[str, str]) -> None:
        self.sections = sections  # section name -> class name
        self.by_class = {cls: name for name, cls in sections.items()}
        self.reads: set[tuple[str, str]] = set()
        self.scopes: list[dict[str, str]] = [{}]  # name -> section, per function
        self.self_attrs: list[dict[str, str]] = [{}]  # self.x -> section, per class
        self.class_stack: list[str] = []

    # -- what an expression holds ------------------------------------------------------------------

    def section_of(self, node: ast.AST):
        if isinstance(node, ast.Attribute):
            if node.attr in self.sections and self.is_run(node.value):
                return node.attr
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                return self.self_attrs[-1].get(node.attr)
        if isinstance(node, ast.Name):
            for scope in reversed(self.scopes):
                if node.id in scope:
                    return scope[node.id]
        if (isinstance(node, ast.Call) and _last_name(node.func) == "run_section"
                and len(node.args) == 2 and isinstance(node.args[1], ast.Constant)):
            return node.args[1].value
        if isinstance(node, ast.Call) and _last_name(node.func) in self.by_class:
            return self.by_class[_last_name(node.func)]  # a section made here (its defaults)
        if isinstance(node, ast.BoolOp):  # config or StorageConfig()
            return next((s for s in map(self.section_of, node.values) if s), None)
        return None

    def is_run(self, node: ast.AST) -> bool:
        name = _last_name(node)
        if name in RUN_NAMES:
            return True
        return isinstance(node, ast.Name) and any(
            scope.get(node.id) == "<run>" for scope in self.scopes)

    # -- bindings --------------------------------------------------------------------------------

    def _bind(self, target: ast.AST, value: ast.AST) -> None:
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)):
            for t, v in zip(target.elts, value.elts):
                self._bind(t, v)
            return
        section = self.section_of(value)
        if section is None:
            return
        if isinstance(target, ast.Name):
            self.scopes[-1][target.id] = section
        elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
              and target.value.id == "self"):
            self.self_attrs[-1][target.attr] = section

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.class_stack.append(node.name)
        self.self_attrs.append({})
        # self.x assignments anywhere in the class bind for all its methods: two passes.
        for _ in range(2):
            for child in ast.walk(node):
                if isinstance(child, ast.FunctionDef):
                    self.scopes.append(self._params(child))
                    for stmt in ast.walk(child):
                        if isinstance(stmt, ast.Assign):
                            for target in stmt.targets:
                                if isinstance(target, ast.Attribute):
                                    self._bind(target, stmt.value)
                    self.scopes.pop()
        self.generic_visit(node)
        self.self_attrs.pop()
        self.class_stack.pop()

    def _params(self, node: ast.FunctionDef) -> dict[str, str]:
        bound = {}
        for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
            name = _annotated_class(arg.annotation)
            if name == "RunConfig":
                bound[arg.arg] = "<run>"
            elif name in self.by_class:
                bound[arg.arg] = self.by_class[name]
        return bound

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.scopes.append(self._params(node))
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        for target in node.targets:
            self._bind(target, node.value)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        section = self.section_of(node.value)
        if section and section != "<run>" and self.sections.get(section) not in self.class_stack:
            self.reads.add((section, node.attr))
        self.generic_visit(node)


def field_reads(package_dir: Path, sections: dict[str, str]) -> dict[str, set[str]]:
    """Section name -> the field names read of it in the package's modules."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in sorted(package_dir.rglob("*.py")):
        reads = _Reads(sections)
        reads.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        for section, name in reads.reads:
            found[section].add(name)
    return found
