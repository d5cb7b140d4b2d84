"""Resumable training checkpoints, written atomically and verified before they are trusted.

Layout under ``<output>/checkpoints``::

    iter_0000050/
        dist/                    Megatron dist checkpoint: trainable weights + optimizer state
        trainer_state.json       iteration, consumed samples, LR scheduler, run fingerprint
        rng/rank_00000.safetensors   per-rank generator states (CPU, accelerator, Megatron tracker)
        MANIFEST.json            every file with its size and SHA-256, written last
    latest                       name of the newest complete checkpoint

Every rank writes into ``iter_XXXXXXX.tmp``; after a barrier rank 0 writes the manifest, renames
the directory into place and then updates ``latest`` (write + rename), so a crash mid-save leaves
the previous checkpoint as the newest complete one. Loading verifies the manifest and falls back to
the previous checkpoint, with a warning naming the problem, when one is damaged. Nothing here is
unpickled: our own state is JSON and safetensors, and Megatron's dist checkpoint loads its common
state with torch's weights-only unpickler.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from typing import Any, Optional

import torch
from megatron.core import dist_checkpointing
from safetensors.torch import load_file, save_file

from megatron_slmoe.utils.atomic import write_json_atomic, write_text_atomic

log = logging.getLogger(__name__)

_NAME = re.compile(r"^iter_(\d{7})$")
_MANIFEST = "MANIFEST.json"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used. The message is one line."""


# --- what goes in ------------------------------------------------------------------------------


def trainable_sharded_state_dict(model_chunks) -> dict[str, Any]:
    """The model's sharded state dict restricted to trainable parameters (the LoRA weights in a
    LoRA run; everything in a full fine-tune). Base weights live in the base checkpoint."""
    trainable = {(p.data_ptr(), tuple(p.shape)) for chunk in model_chunks
                 for p in chunk.parameters() if p.requires_grad}
    sharded: dict[str, Any] = {}
    for i, chunk in enumerate(model_chunks):
        prefix = f"chunk{i}." if len(model_chunks) > 1 else ""
        for key, value in chunk.sharded_state_dict().items():
            data = getattr(value, "data", None)
            if torch.is_tensor(data) and (data.data_ptr(), tuple(data.shape)) in trainable:
                sharded[prefix + key] = value
    return sharded


def _rng_state() -> dict[str, torch.Tensor]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    import megatron_slmoe

    states = {"cpu": torch.get_rng_state()}
    if megatron_slmoe.PLATFORM.name == "cuda":
        states["accelerator"] = torch.cuda.get_rng_state()
    elif megatron_slmoe.PLATFORM.name == "npu":
        states["accelerator"] = torch.npu.get_rng_state()  # type: ignore[attr-defined]
    for name, state in get_cuda_rng_tracker().get_states().items():
        states[f"tracker.{name}"] = state if torch.is_tensor(state) else torch.tensor(state)
    return {k: v.detach().cpu().contiguous() for k, v in states.items()}


def _set_rng_state(states: dict[str, torch.Tensor]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    import megatron_slmoe

    torch.set_rng_state(states["cpu"])
    if "accelerator" in states and megatron_slmoe.PLATFORM.name == "cuda":
        torch.cuda.set_rng_state(states["accelerator"])
    elif "accelerator" in states and megatron_slmoe.PLATFORM.name == "npu":
        torch.npu.set_rng_state(states["accelerator"])  # type: ignore[attr-defined]
    tracker = {k[len("tracker."):]: v for k, v in states.items() if k.startswith("tracker.")}
    if tracker:
        get_cuda_rng_tracker().set_states(tracker)


# --- saving ------------------------------------------------------------------------------------


def save_checkpoint(root: str, iteration: int, model_chunks, optimizer, trainer_state: dict,
                    keep_last: int) -> str:
    """Write checkpoint ``iteration`` atomically (collective: every rank calls it)."""
    rank = torch.distributed.get_rank()
    name = f"iter_{iteration:07d}"
    final, tmp = os.path.join(root, name), os.path.join(root, name + ".tmp")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for stale in os.listdir(root):  # leftovers of a save that crashed
            if stale.endswith(".tmp"):
                shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
        os.makedirs(os.path.join(tmp, "dist"))
        os.makedirs(os.path.join(tmp, "rng"))
    torch.distributed.barrier()

    model_sd = trainable_sharded_state_dict(model_chunks)
    state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd)}
    dist_checkpointing.save(state, os.path.join(tmp, "dist"))
    save_file(_rng_state(), os.path.join(tmp, "rng", f"rank_{rank:05d}.safetensors"))
    if rank == 0:
        write_json_atomic(os.path.join(tmp, "trainer_state.json"), {"iteration": iteration, **trainer_state},
                          sort_keys=True)
    torch.distributed.barrier()

    if rank == 0:
        write_json_atomic(os.path.join(tmp, _MANIFEST),
                          {"iteration": iteration, "files": _inventory(tmp)}, sort_keys=True)
        if os.path.exists(final):  # an earlier run's checkpoint of the same iteration
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_text_atomic(os.path.join(root, "latest"), name)
        _prune(root, keep_last)
    torch.distributed.barrier()
    return final


def _inventory(directory: str) -> dict[str, dict[str, Any]]:
    files = {}
    for base, _, names in os.walk(directory):
        for fname in sorted(names):
            path = os.path.join(base, fname)
            rel = os.path.relpath(path, directory)
            if rel == _MANIFEST:
                continue
            files[rel] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
    return files


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _prune(root: str, keep_last: int) -> None:
    complete = sorted(n for n in os.listdir(root) if _NAME.match(n))
    for name in complete[:-keep_last]:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def save_base_checkpoint(model, directory: str, model_config_name: str) -> None:
    """The whole model as a Megatron dist checkpoint (a base for LoRA runs), with the name of its
    model config in ``model_config.txt``. Collective; it appears under ``directory`` only when
    complete (written to ``<directory>.tmp``, then renamed by rank 0)."""
    rank = torch.distributed.get_rank()
    directory = os.path.abspath(directory)
    tmp = directory + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed
        os.makedirs(tmp)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), tmp)
    torch.distributed.barrier()
    if rank == 0:
        write_text_atomic(os.path.join(tmp, "model_config.txt"), model_config_name)
        if os.path.exists(directory):
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    torch.distributed.barrier()


# --- loading -----------------------------------------------------------------------------------


def verify(directory: str) -> Optional[str]:
    """None if the checkpoint is complete and intact, else why not (one line)."""
    manifest_path = os.path.join(directory, _MANIFEST)
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
        if _sha256(path) != expected["sha256"]:
            return f"{rel} does not match its checksum"
    return None


def _inventory_names(directory: str) -> list[str]:
    return [os.path.relpath(os.path.join(b, n), directory)
            for b, _, names in os.walk(directory) for n in names]


def find_resumable(root: str) -> Optional[str]:
    """The newest intact checkpoint under ``root`` (rank 0 decides; all ranks get the answer)."""
    choice = [None]
    if torch.distributed.get_rank() == 0 and os.path.isdir(root):
        for name in sorted((n for n in os.listdir(root) if _NAME.match(n)), reverse=True):
            problem = verify(os.path.join(root, name))
            if problem is None:
                choice[0] = os.path.join(root, name)
                break
            log.warning("checkpoint %s is not usable: %s; trying the previous one",
                        os.path.join(root, name), problem)
    torch.distributed.broadcast_object_list(choice, src=0)
    return choice[0]


def load_checkpoint(directory: str, model_chunks, optimizer) -> dict:
    """Restore trainable weights, optimizer and RNG from ``directory``; returns the trainer state."""
    rank = torch.distributed.get_rank()
    model_sd = trainable_sharded_state_dict(model_chunks)
    state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True)}
    loaded = dist_checkpointing.load(state, os.path.join(directory, "dist"))
    with torch.no_grad():
        for chunk_index, chunk in enumerate(model_chunks):
            prefix = f"chunk{chunk_index}." if len(model_chunks) > 1 else ""
            own = {k[len(prefix):]: v for k, v in loaded["model"].items() if k.startswith(prefix)}
            missing = [k for k in own if k not in chunk.state_dict(keep_vars=True)]
            if missing:
                raise CheckpointError(f"{directory}: checkpoint keys {missing[:3]} are not in the model")
            chunk.load_state_dict(own, strict=False)
    optimizer.load_state_dict(loaded["optimizer"])
    rng_path = os.path.join(directory, "rng", f"rank_{rank:05d}.safetensors")
    if os.path.isfile(rng_path):
        _set_rng_state(load_file(rng_path))
    else:
        log.warning("%s has no RNG state for rank %d (a different world size?): "
                    "continuing with fresh random streams", directory, rank)
    with open(os.path.join(directory, "trainer_state.json"), encoding="utf-8") as f:
        return json.load(f)
