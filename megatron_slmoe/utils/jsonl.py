"""JSON Lines reading with line numbers, for every JSONL file the project reads (training data,
prompt files, a run's metrics): each caller decides what a bad line means for it."""

from __future__ import annotations

import json
from typing import Any, Iterator, Union


def numbered_records(path: str,
                     errors: str = "strict") -> Iterator[tuple[int, Union[Any, ValueError]]]:
    """(1-based line number, the line's JSON value or the ValueError that parsing raised) of every
    non-blank line of ``path``; ``errors`` is the UTF-8 decoding policy (a line that does not
    decode is a ValueError like any other bad line, not the end of the file)."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8", errors=errors)
            except UnicodeDecodeError as err:
                yield number, ValueError(f"not UTF-8 text ({err.reason} at byte {err.start})")
                continue
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except ValueError as err:
                yield number, err
