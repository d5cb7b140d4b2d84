"""Start-up checks of the places a run reads and writes, local paths and object-storage URLs
alike: each problem is one ConfigError line naming the flag and the path (or the URL).

A local input must exist and a local output directory must be makeable; the URLs are checked
against the store (readable inputs, a writable ``--output-url``) once per node, by its local rank
0, so that a wrong credential, a missing bucket or key, or an unreachable endpoint stops the run
before start-up instead of in its middle (``preflight`` does the store's part).
"""

from __future__ import annotations

import os
from typing import Iterable, Optional

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.storage.config import StorageConfig
from megatron_slmoe.storage.errors import StorageError
from megatron_slmoe.storage.preflight import check_readable, check_writable, preflight_store
from megatron_slmoe.storage.session import indexed_dataset_files
from megatron_slmoe.storage.urls import is_object_url, parse_url

Named = Iterable[tuple[str, Optional[str]]]
"""(flag, path or URL or None) pairs."""


def nearest_existing(path: str) -> str:
    """``path``, or the nearest directory above it that exists."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_writable_dir(flag: str, path: Optional[str]) -> None:
    """A directory a run will make or write into: not a file, under a writable directory."""
    if not path or is_object_url(path):
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a file, not a directory")
    existing = nearest_existing(path)
    if not os.path.isdir(existing):
        raise ConfigError(f"{flag} {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: {existing} is not writable")


def check_local_inputs_exist(named: Named) -> None:
    """Every local path named exists (a URL is the store's to check)."""
    for flag, path in named:
        if path and not is_object_url(path) and not os.path.exists(path):
            raise ConfigError(f"{flag} {path}: no such file or directory")


def check_local_files_exist(named: Named) -> None:
    """Every local path named is a file."""
    for flag, path in named:
        if path and not is_object_url(path) and not os.path.isfile(path):
            raise ConfigError(f"{flag} {path}: no such file")


def object_inputs(directories: Named, files: Named, datasets: Named,
                  indexed: bool) -> list[tuple[str, str]]:
    """(flag, URL) of every object or prefix a run reads from object storage: ``directories``
    (every object under the prefix), single ``files``, and ``datasets`` (an ``indexed`` dataset
    prefix not ending in ``/`` is its two objects)."""
    found = [(flag, str(parse_url(url).as_prefix())) for flag, url in directories
             if is_object_url(url)]
    found += [(flag, url) for flag, url in files if is_object_url(url)]
    for flag, url in datasets:
        if not is_object_url(url):
            continue
        if indexed and not url.endswith("/"):
            found += [(flag, name) for name in indexed_dataset_files(url)]
        else:
            found.append((flag, url))
    return found


def check_store_access(settings: StorageConfig, inputs: list[tuple[str, str]],
                       output_url: Optional[str]) -> None:
    """Every input URL readable and ``output_url`` writable; checked by the local rank 0 of each
    node (the node's other ranks rely on it: its failure stops the job before the process group
    has formed)."""
    if not (inputs or output_url) or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return
    store = preflight_store(settings)
    checks = [(flag, url, check_readable) for flag, url in inputs]
    if output_url:
        checks.append(("--output-url", output_url, check_writable))
    for flag, url, check in checks:
        try:
            check(store, parse_url(url))
        except StorageError as err:
            raise ConfigError(f"{flag}: {err}") from None
