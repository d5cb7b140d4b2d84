"""A directory's manifest: every file with its size and SHA-256.

Checkpoints carry one (``MANIFEST.json``, written last, verified before a checkpoint is trusted),
and directories copied to or from object storage are complete exactly when theirs is there.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

MANIFEST = "MANIFEST.json"


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def inventory(directory: str | os.PathLike,
              known: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Every file under ``directory`` but the manifest: relative path -> bytes and SHA-256.
    ``known`` entries (digests computed where the file was written) are taken as they are while
    the file's size still matches, instead of reading the file again."""
    files = {}
    for base, _, names in os.walk(directory):
        for name in sorted(names):
            path = os.path.join(base, name)
            rel = os.path.relpath(path, directory)
            if rel == MANIFEST:
                continue
            size = os.path.getsize(path)
            entry = (known or {}).get(rel)
            if entry is None or entry["bytes"] != size:
                entry = {"bytes": size, "sha256": sha256_file(path)}
            files[rel] = entry
    return files
