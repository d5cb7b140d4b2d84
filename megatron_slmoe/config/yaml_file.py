"""YAML as the configuration files read it: safe, and a key given twice in one mapping is an error
(PyYAML keeps the last, so the first would be dropped without a word)."""

from __future__ import annotations

from typing import Any

import yaml


class UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that refuses a key given twice in one mapping."""


def _construct_mapping(loader: UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} given twice", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_unique(text: str) -> Any:
    """``text`` as YAML; raises yaml.YAMLError (a key given twice included)."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)


def describe_yaml_error(err: yaml.YAMLError) -> str:
    """Where and what, to follow "invalid YAML": `` at line L, column C: problem`` (or
    ``: problem`` where PyYAML gives no place)."""
    mark = getattr(err, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{at}: {getattr(err, 'problem', None) or str(err).splitlines()[0]}"
