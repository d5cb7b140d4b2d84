"""A directory's manifest: every file with its size and SHA-256.

Checkpoints carry one (``MANIFEST.json``, written last, verified before a checkpoint is trusted),
and directories copied to or from object storage are complete exactly when theirs is there.
"""

from __future__ import annotations

import hashlib
import json
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


def verify(directory: str, checksums: bool = True) -> str | None:
    """None if the directory (a checkpoint) is complete and intact, else why not (one line
    naming the file). ``checksums=False`` compares sizes only (fast: for checks before a run
    starts)."""
    manifest_path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(manifest_path):
        return "no MANIFEST.json (the save did not finish)"
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable MANIFEST.json ({err})"
    present = set(_inventory_names(directory))
    for rel, expected in files.items():
        path = os.path.join(directory, rel)
        if rel not in present:
            return f"{rel} is missing"
        if os.path.getsize(path) != expected["bytes"]:
            return f"{rel} has {os.path.getsize(path)} bytes, the manifest says {expected['bytes']}"
        if checksums and sha256_file(path) != expected["sha256"]:
            return f"{rel} does not match its checksum"
    return None


def _inventory_names(directory: str) -> list[str]:
    return [os.path.relpath(os.path.join(b, n), directory)
            for b, _, names in os.walk(directory) for n in names]
