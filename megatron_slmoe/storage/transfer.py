"""Directories to and from object storage, complete or not at all, and a run's output mirror.

A directory on the store is *complete* when its ``MANIFEST.json`` exists: the manifest lists every
file with its size and SHA-256 (``megatron_slmoe.utils.manifest``, as checkpoints carry it) and is
uploaded last,
after every file it lists, and deleted first when the directory is replaced. Object stores have
no rename, so the manifest is the commit point:

* :func:`upload_tree` uploads a local directory (its own ``MANIFEST.json`` if it has one, as a
  checkpoint does, else one made here);
* :func:`download_tree` downloads a complete directory into a staging directory, checks every size
  and checksum against the manifest and renames it into place (``utils.atomic.atomic_directory``).

:class:`OutputMirror` is what a run uses: checkpoints are uploaded in a background thread, one at a
time, and the store's ``checkpoints/latest`` names a checkpoint only once it is complete there;
the adapter and the summary are uploaded at the end; on resume the newest complete stored
checkpoint is brought back when the local ones are older.

Remote layout under ``--output-url``::

    checkpoints/iter_0000050/...   + MANIFEST.json (last)
    checkpoints/latest             name of the newest complete checkpoint (written after it)
    adapter/...                    + MANIFEST.json (last)
    export-hf/..., plots/...       the --export-hf PEFT adapter and the pictures, when made
    config.yaml, metrics.jsonl, summary.json (last)
"""

from __future__ import annotations

import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from megatron_slmoe.storage.client import ObjectInfo, ObjectStore
from megatron_slmoe.storage.errors import ObjectNotFoundError, StorageError
from megatron_slmoe.storage.urls import ObjectURL
from megatron_slmoe.utils.atomic import atomic_directory
from megatron_slmoe.utils.manifest import MANIFEST, inventory, sha256_file

log = logging.getLogger(__name__)

_WORKERS = 4


def _read_manifest(text: bytes, where: str) -> dict[str, dict[str, Any]]:
    try:
        files = json.loads(text)["files"]
        for rel, entry in files.items():
            if os.path.isabs(rel) or ".." in rel.split("/") or \
                    not isinstance(entry.get("bytes"), int) or not isinstance(entry.get("sha256"), str):
                raise ValueError(rel)
        return files
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise StorageError(f"{where}: unreadable {MANIFEST} ({type(err).__name__})") from None


# --- directories ----------------------------------------------------------------------------------


def upload_tree(store: ObjectStore, local_dir: str, prefix: ObjectURL) -> int:
    """Upload ``local_dir`` under ``prefix``, manifest last; returns the bytes uploaded."""
    manifest_path = os.path.join(local_dir, MANIFEST)
    if os.path.isfile(manifest_path):
        with open(manifest_path, "rb") as f:
            manifest_bytes = f.read()
        files = _read_manifest(manifest_bytes, manifest_path)
    else:
        files = inventory(local_dir)
        manifest_bytes = json.dumps({"files": files}, indent=2, sort_keys=True).encode()
    store.delete(prefix.join(MANIFEST))  # a reader now sees "incomplete", never a mix
    with ThreadPoolExecutor(_WORKERS, thread_name_prefix="slmoe-upload") as pool:
        for future in [pool.submit(store.upload, os.path.join(local_dir, rel), prefix.join(rel))
                       for rel in sorted(files)]:
            future.result()
    store.put_bytes(prefix.join(MANIFEST), manifest_bytes)
    return sum(entry["bytes"] for entry in files.values()) + len(manifest_bytes)


def download_tree(store: ObjectStore, prefix: ObjectURL, local_dir: str) -> str:
    """Download the complete directory at ``prefix`` into ``local_dir`` (replaced atomically)."""
    try:
        manifest_bytes = store.get_bytes(prefix.join(MANIFEST))
    except ObjectNotFoundError:
        raise ObjectNotFoundError(f"{prefix.as_prefix()}: incomplete or missing (no {MANIFEST})"
                                  ) from None
    files = _read_manifest(manifest_bytes, str(prefix.join(MANIFEST)))
    with atomic_directory(local_dir, replace=True) as staging:
        def fetch(rel: str) -> None:
            path = os.path.join(staging, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            expected = files[rel]
            # The manifest's size, not a HEAD: a stored file of another size fails the download.
            info = ObjectInfo(prefix.join(rel), expected["bytes"], None)
            with open(path, "w+b") as sink:
                store.download(info, sink)
            if sha256_file(path) != expected["sha256"]:
                raise StorageError(f"{prefix.join(rel)} does not match {MANIFEST} (size or "
                                   "checksum): the stored directory is damaged")

        with ThreadPoolExecutor(_WORKERS, thread_name_prefix="slmoe-download") as pool:
            for future in [pool.submit(fetch, rel) for rel in sorted(files)]:
                future.result()
        with open(os.path.join(staging, MANIFEST), "wb") as f:
            f.write(manifest_bytes)
    return local_dir


def delete_tree(store: ObjectStore, prefix: ObjectURL) -> None:
    """Delete every object under ``prefix``, the manifest first (a half-deleted directory reads
    as incomplete)."""
    store.delete(prefix.join(MANIFEST))
    for info in store.list(prefix):
        store.delete(info.url)


# --- a run's outputs ------------------------------------------------------------------------------


class OutputMirror:
    """Copies a run's outputs under ``output_url`` (see the module doc). Used on one rank."""

    def __init__(self, store: ObjectStore, output_url: ObjectURL, keep_last: int):
        self.store = store
        self.root = output_url.as_prefix()
        self.keep_last = keep_last
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.uploaded_bytes = 0

    @property
    def checkpoints(self) -> ObjectURL:
        return self.root.join("checkpoints/")

    # -- checkpoints -----------------------------------------------------------------------------

    def submit_checkpoint(self, local_checkpoint: str) -> None:
        """Upload a complete local checkpoint in the background (after the previous upload)."""
        self.wait()
        self._thread = threading.Thread(target=self._upload_checkpoint, args=(local_checkpoint,),
                                        name="slmoe-checkpoint-upload", daemon=True)
        self._thread.start()

    def _upload_checkpoint(self, local_checkpoint: str) -> None:
        try:
            name = os.path.basename(os.path.normpath(local_checkpoint))
            self.uploaded_bytes += upload_tree(self.store, local_checkpoint,
                                               self.checkpoints.join(name))
            self.store.put_bytes(self.checkpoints.join("latest"), name.encode())
            for old in self.stored_checkpoints()[:-self.keep_last]:
                delete_tree(self.store, self.checkpoints.join(old))
            log.info("storage: checkpoint %s is on the store at %s", name, self.checkpoints.join(name))
        except BaseException as err:  # raised by wait() on the training thread
            self._error = err

    def wait(self) -> None:
        """Block until the upload in flight is done; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def stored_checkpoints(self) -> list[str]:
        """Names of the complete checkpoints on the store (with a manifest), oldest first (the
        names sort by iteration: ``iter_%07d``)."""
        names = set()
        for info in self.store.list(self.checkpoints):
            parts = info.url.relative_to(self.checkpoints).split("/")
            if len(parts) == 2 and parts[1] == MANIFEST:
                names.add(parts[0])
        return sorted(names)

    def restore_checkpoint(self, local_root: str, local_newest: Optional[str]) -> Optional[str]:
        """Bring back the newest complete stored checkpoint whose name sorts after
        ``local_newest`` (None: there is no local one); returns its local path, or None. A stored
        checkpoint that turns out damaged is skipped with a warning, as the local loader does."""
        for name in reversed(self.stored_checkpoints()):
            if local_newest is not None and name <= local_newest:
                return None
            try:
                path = download_tree(self.store, self.checkpoints.join(name),
                                     os.path.join(local_root, name))
                log.info("storage: restored checkpoint %s from %s", name, self.checkpoints)
                return path
            except StorageError as err:
                log.warning("storage: stored checkpoint %s is not usable: %s; trying the previous "
                            "one", name, err)
        return None

    # -- everything else -------------------------------------------------------------------------

    def upload_directory(self, local_dir: str, name: str) -> None:
        """A directory (e.g. the adapter) under ``name/``, complete or not at all."""
        self.uploaded_bytes += upload_tree(self.store, local_dir, self.root.join(name + "/"))

    def upload_file(self, local_path: str, name: str) -> None:
        """One file (e.g. ``summary.json``); a single object is replaced atomically."""
        self.store.upload(local_path, self.root.join(name))
        self.uploaded_bytes += os.path.getsize(local_path)
