"""Resumable training checkpoints, written atomically and verified before they are trusted.

Layout under ``<output>/checkpoints``::

    iter_0000050/
        dist/                    Megatron dist checkpoint: trainable weights + optimizer state
        trainer_state.json       iteration, consumed samples, LR scheduler, run fingerprint
        rng/rank_00000.safetensors   per-rank generator states (CPU, accelerator, Megatron tracker)
        MANIFEST.json            every file with its size and SHA-256, written last
    latest                       name of the newest complete checkpoint

Every rank writes into ``iter_XXXXXXX.tmp`` (its shards possibly in the background, see
``stage_checkpoint``); once all have written, rank 0 writes the manifest, renames the directory
into place and then updates ``latest`` (write + rename), so a crash at any moment leaves the
previous checkpoint as the newest complete one. Loading verifies the manifest and falls back to
the previous checkpoint, with a warning naming the problem, when one is damaged. Our own state is
JSON and safetensors; Megatron's dist checkpoint loads its common state with torch's weights-only
unpickler (torch's own ``.metadata`` file of the format is a plain pickle: load checkpoints you or
your job wrote).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from functools import partial
from typing import Any, Optional

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from safetensors.torch import load_file, save_file

from megatron_slmoe.data.tokenizer import BASE_TOKENIZER
from megatron_slmoe.platform import current as current_platform
from megatron_slmoe.runtime.bases import BASE_MODEL_FILE, BASE_MODEL_NAME
from megatron_slmoe.utils.atomic import (
    promote_directory,
    staging_directory,
    write_json_atomic,
    write_text_atomic,
)
from megatron_slmoe.utils.manifest import MANIFEST, inventory, sha256_file, verify

log = logging.getLogger(__name__)

_NAME = re.compile(r"^iter_(\d{7})$")
_DIGESTS = "digests"  # per-rank shard digests while a checkpoint is staged


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

    states = {"cpu": torch.get_rng_state()}
    if current_platform().name == "cuda":
        states["accelerator"] = torch.cuda.get_rng_state()
    elif current_platform().name == "npu":
        states["accelerator"] = torch.npu.get_rng_state()  # type: ignore[attr-defined]
    for name, state in get_cuda_rng_tracker().get_states().items():
        states[f"tracker.{name}"] = state if torch.is_tensor(state) else torch.tensor(state)
    return {k: v.detach().cpu().contiguous() for k, v in states.items()}


def _set_rng_state(states: dict[str, torch.Tensor]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(states["cpu"])
    if "accelerator" in states and current_platform().name == "cuda":
        torch.cuda.set_rng_state(states["accelerator"])
    elif "accelerator" in states and current_platform().name == "npu":
        torch.npu.set_rng_state(states["accelerator"])  # type: ignore[attr-defined]
    tracker = {k[len("tracker."):]: v for k, v in states.items() if k.startswith("tracker.")}
    if tracker:
        get_cuda_rng_tracker().set_states(tracker)


# --- saving ------------------------------------------------------------------------------------


def stage_checkpoint(root: str, iteration: int, model_chunks, optimizer, trainer_state: dict,
                     keep_last: int, *, strategy=None, snapshot_host_tensors: bool = False
                     ) -> AsyncRequest:
    """Start checkpoint ``iteration`` (collective: every rank calls it) and return Megatron-Core's
    ``AsyncRequest`` for the rest.

    Done here, while the loop waits: ``iter_XXXXXXX.tmp`` is staged, the dist checkpoint is
    planned (its common state written), and the small files (trainer state, RNG) are written. The
    request's write part stores this rank's shards and records their digests; it runs in the
    background (``AsyncCheckpointWriter``) or at once (``save_checkpoint``). Its finalize part runs
    on every rank once all have written: Megatron's metadata, then ``_promote``, which makes the
    checkpoint the newest. A crash at any moment before the promotion leaves only a ``.tmp`` that
    nothing trusts and the next save removes.

    ``snapshot_host_tensors``: copy tensors that live in host memory first (a persistent writer
    process would otherwise read them while training changes them; accelerator tensors are copied
    to the host by Megatron's preload, and a forked writer sees the fork's own memory).
    """
    rank = torch.distributed.get_rank()
    name = f"iter_{iteration:07d}"
    tmp = os.path.join(root, name + ".tmp")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for stale in os.listdir(root):  # leftovers of a save that crashed
            if stale.endswith(".tmp"):
                shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
        for sub in ("dist", "rng", _DIGESTS):
            os.makedirs(os.path.join(tmp, sub))
    torch.distributed.barrier()

    model_sd = trainable_sharded_state_dict(model_chunks)
    state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd)}
    if snapshot_host_tensors:
        _copy_host_tensors(state)
    if strategy is None:
        strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
    request = dist_checkpointing.save(state, os.path.join(tmp, "dist"), sharded_strategy=strategy,
                                      async_sharded_save=True)
    save_file(_rng_state(), os.path.join(tmp, "rng", f"rank_{rank:05d}.safetensors"))
    if rank == 0:
        write_json_atomic(os.path.join(tmp, "trainer_state.json"),
                          {"iteration": iteration, **trainer_state}, sort_keys=True)
    if request.async_fn is not None:
        digest_path = os.path.join(tmp, _DIGESTS, f"rank_{rank:05d}.json")
        request = request._replace(async_fn=partial(_write_then_digest, request.async_fn,
                                                    digest_path, tmp))
    request.add_finalize_fn(partial(_promote, root, name, keep_last))
    return request


def checkpoint_path(root: str, iteration: int) -> str:
    """Where checkpoint ``iteration`` is once promoted."""
    return os.path.join(root, f"iter_{iteration:07d}")


def save_checkpoint(root: str, iteration: int, model_chunks, optimizer, trainer_state: dict,
                    keep_last: int) -> str:
    """Write checkpoint ``iteration`` atomically and wait for it (collective)."""
    stage_checkpoint(root, iteration, model_chunks, optimizer, trainer_state,
                     keep_last).execute_sync()
    return checkpoint_path(root, iteration)


def _copy_host_tensors(state: dict) -> None:
    def copy(value):
        data = getattr(value, "data", None)
        if torch.is_tensor(data) and data.device.type == "cpu":
            value.data = data.detach().clone()
        return value

    dict_list_map_inplace(copy, state)


def _write_then_digest(write_fn, digest_path: str, checkpoint_dir: str, rank: int,
                       write_buckets, results_queue) -> None:
    """Megatron's shard writer, then the size and SHA-256 of each file it wrote, computed where
    the data was written (the writer process) so that promoting the checkpoint stays cheap."""
    write_fn(rank, write_buckets, results_queue)
    digests = {}
    for bucket in write_buckets:
        path = bucket[0]
        if os.path.isfile(path):
            digests[os.path.relpath(path, checkpoint_dir)] = {"bytes": os.path.getsize(path),
                                                              "sha256": sha256_file(path)}
    write_json_atomic(digest_path, digests, sort_keys=True)


def _promote(root: str, name: str, keep_last: int) -> None:
    """The finalize step (collective, after every rank's shards are written): rank 0 writes the
    manifest, renames ``<name>.tmp`` to ``<name>`` and points ``latest`` at it."""
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        final, tmp = os.path.join(root, name), os.path.join(root, name + ".tmp")
        digests: dict[str, dict] = {}
        digest_dir = os.path.join(tmp, _DIGESTS)
        for fname in sorted(os.listdir(digest_dir)):
            with open(os.path.join(digest_dir, fname), encoding="utf-8") as f:
                digests.update(json.load(f))
        shutil.rmtree(digest_dir)
        write_json_atomic(os.path.join(tmp, MANIFEST),
                          {"iteration": int(name[len("iter_"):]),
                           "files": inventory(tmp, known=digests)}, sort_keys=True)
        # An earlier attempt's checkpoint of the same iteration is swapped out, not deleted first.
        promote_directory(tmp, final, replace=True)
        write_text_atomic(os.path.join(root, "latest"), name)
        _prune(root, keep_last)
    torch.distributed.barrier()


def _prune(root: str, keep_last: int) -> None:
    complete = sorted(n for n in os.listdir(root) if _NAME.match(n))
    for name in complete[:-keep_last]:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def save_base_checkpoint(model, directory: str, model_config_name: str, tokenizer,
                         model_file: Optional[str] = None) -> None:
    """The whole model as a Megatron dist checkpoint (a base for LoRA runs), with the name of its
    model config in ``model_config.txt`` (and a copy of ``model_file``, the model config's YAML
    file when it is not a packaged one, as ``model_config.yaml``), the tokenizer it was trained
    with in ``tokenizer.json`` and a MANIFEST.json of every file (so a truncated copy is named
    before a run starts). Collective; it appears under ``directory`` only when complete (written
    to a staging directory beside it, which rank 0 then swaps in: an earlier base at
    ``directory`` stays in place until the new one is whole)."""
    rank = torch.distributed.get_rank()
    directory = os.path.abspath(directory)
    staging = [staging_directory(directory) if rank == 0 else None]
    torch.distributed.broadcast_object_list(staging, src=0)
    tmp = staging[0]
    dist_checkpointing.save(model.sharded_state_dict(), tmp)
    torch.distributed.barrier()
    if rank == 0:
        write_text_atomic(os.path.join(tmp, BASE_MODEL_NAME), model_config_name)
        if model_file:
            shutil.copyfile(model_file, os.path.join(tmp, BASE_MODEL_FILE))
        tokenizer.save(os.path.join(tmp, BASE_TOKENIZER))
        write_json_atomic(os.path.join(tmp, MANIFEST), {"files": inventory(tmp)}, sort_keys=True)
        promote_directory(tmp, directory, replace=True)  # the old base stays until then
    torch.distributed.barrier()


# --- loading -----------------------------------------------------------------------------------


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
