"""JSON Lines reading with line numbers, for every JSONL file the project reads (training data,
prompt files, a run's metrics): each caller decides what a bad line means for it."""

from __future__ import annotations

import json
from typing import Any, Iterator, Union


def numbered_records(path: str,
                     errors: str = "strict") -> Iterator[tuple[int, Union[Any, ValueError]]]:
    """(1-based line number, the line's JSON value or the ValueError that parsing raised) of every
    non-blank line of ``path``; ``errors`` is ``open``'s decoding policy."""
    with open(path, encoding="utf-8", errors=errors) as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except ValueError as err:
                yield number, err
