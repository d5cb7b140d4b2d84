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


def inventory(directory: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Every file under ``directory`` but the manifest: relative path -> bytes and SHA-256."""
    files = {}
    for base, _, names in os.walk(directory):
        for name in sorted(names):
            path = os.path.join(base, name)
            rel = os.path.relpath(path, directory)
            if rel != MANIFEST:
                files[rel] = {"bytes": os.path.getsize(path), "sha256": sha256_file(path)}
    return files
