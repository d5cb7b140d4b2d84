"""Adapters as files that do not depend on the parallel layout, and merging them into the base.

An adapter directory holds two files and nothing that is unpickled:

* ``adapter_config.json``: format version, tensor naming, the LoRAConfig, the base model identity
  (``adapter_config_json`` writes it, ``lora_config_from_json`` / ``read_base_info`` read it);
* ``adapter_model.safetensors``: every LoRA tensor, unsharded, in its TP=1 layout.

**Tensor names** (``tensor_naming = megatron_slmoe.global.v1``): the Megatron module path with the
*global* layer index, then ``lora_A.weight`` [r, in] or ``lora_B.weight`` [out, r]::

    decoder.layers.0.self_attention.linear_qkv.lora_A.weight    [r, d]
    decoder.layers.0.self_attention.linear_qkv.lora_B.weight    [qkv_out, r]  (Megatron's qkv order)
    decoder.layers.0.mlp.linear_fc1.lora_B.weight               [2F, r]       (gate rows, then up)
    decoder.layers.2.mlp.router.lora_B.weight                   [E, r]
    decoder.layers.2.mlp.latent_down.lora_A.weight              [r, d]
    decoder.layers.2.mlp.shared_experts.linear_fc2.lora_A.weight
    decoder.layers.2.mlp.experts.5.linear_fc1.lora_A.weight     [r, l]        (global expert 5)
    decoder.layers.2.mlp.experts.5.linear_fc2.lora_B.weight     [l, r]

The stacked expert factors of a rank are split per *global* expert index, so the same file serves
any expert-parallel size; TP shards are joined along their partition dim (a gated fc1's B per
half, as Megatron's checkpoints do); pipeline stages contribute their own layers.

**Collectives.** ``lora_state_dict`` and ``save_adapter`` gather every rank's pieces to one rank
with one object gather over the world (each block is sent once: only the first data-parallel
replica sends, and replicated-over-TP blocks only from TP rank 0). Global rank 0 writes the files
into a temporary directory next to the target and moves it into place with ``os.replace``; an
existing adapter directory is swapped out only after the new one is complete, so a reader never
sees a half-written adapter. ``load_adapter`` reads on every rank just the slices that rank holds,
then agrees with the others (one all-reduce) that nothing was missing or left over.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping, Optional

import torch
from megatron.core import parallel_state

from megatron_slmoe.lora.config import LoRAConfig
from megatron_slmoe.config.schema import settings
from megatron_slmoe.lora.base import LoRAPiece
from megatron_slmoe.lora.inject import (
    ModelChunks,
    inject_lora,
    injected_config,
    lora_modules,
    unwrap_chunks,
)
from megatron_slmoe.utils.atomic import atomic_directory
from megatron_slmoe.utils.errors import InputError

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"

FORMAT_VERSION = 1
"""Version of the adapter directory format (adapter_config.json + adapter_model.safetensors)."""

TENSOR_NAMING = "megatron_slmoe.global.v1"
"""How tensors are named in adapter_model.safetensors (see the module doc)."""


class AdapterError(InputError, ValueError):
    """An adapter that cannot be read, or does not fit the model (one line)."""


# --- adapter_config.json -------------------------------------------------------------------------


def module_scales(lora_config: LoRAConfig, tensor_shapes: Mapping[str, Any]) -> dict[str, Any]:
    """Each adapted module's rank, alpha and scale s = alpha / rank, from the adapter's tensor
    shapes (B [out, r]: a shared-outer fc1's A holds gate and up, 2r rows); the routed experts of
    a layer are one entry (``experts.*.linear_fc1``) in either expert layout, their rank being
    their own (--expert-lora-rank / --moe-rank-scaling)."""
    scales: dict[str, Any] = {}
    for name, shape in tensor_shapes.items():
        if not name.endswith(".lora_B.weight"):
            continue
        module = _EXPERT_INDEX.sub(".experts.*.", name[:-len(".lora_B.weight")])
        module = _SHARED_EXPERT_FACTOR.sub(".experts.*.linear_fc", module)
        rank = int(tuple(shape)[-1])
        scales[module] = {"rank": rank, "alpha": float(lora_config.alpha),
                          "scaling": lora_config.scaling_for(rank)}
    return dict(sorted(scales.items()))


def adapter_config_json(lora_config: LoRAConfig, base_info: Mapping[str, Any] | None = None,
                        scales: Mapping[str, Any] | None = None) -> str:
    """The content of adapter_config.json: format version, tensor naming, the LoRA settings,
    ``base_info`` (identity of the base model: ``base_identity`` and where it was) and the
    modules' ``scales`` (``module_scales``), JSON-able."""
    document = {
        "format_version": FORMAT_VERSION,
        "tensor_naming": TENSOR_NAMING,
        "lora": lora_config.to_dict(),
        "base_model": dict(base_info or {}),
    }
    if scales is not None:
        document["module_scales"] = dict(scales)
    try:
        return json.dumps(document, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except (TypeError, ValueError) as err:
        raise ValueError(f"adapter base_info must be plain JSON values: {err}") from None


def lora_config_from_json(text: str) -> LoRAConfig:
    """The LoRAConfig of an adapter_config.json; one ValueError line for anything wrong."""
    section = _parse_document(text)["lora"]
    known = {f.name for f in settings(LoRAConfig)}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ValueError(f"adapter_config.json: unknown key lora.{unknown[0]} (known: "
                         f"{', '.join(sorted(known))})")
    missing = sorted(known - set(section) - _SETTINGS_ADDED_LATER)
    if missing:
        raise ValueError(f"adapter_config.json: lora.{missing[0]} is missing")
    try:
        return LoRAConfig(**section)
    except ValueError as err:
        raise ValueError(f"adapter_config.json: {err}") from None


_SETTINGS_ADDED_LATER = {"expert_rank", "moe_rank_scaling", "expert_layout"}
"""LoRA settings an adapter written before they existed does not record (their defaults hold)."""

_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")
_SHARED_EXPERT_FACTOR = re.compile(r"\.experts\.linear_fc")
"""A factor the experts of a layer share (shared-outer): ``experts.linear_fc2.lora_B.weight``."""


def read_base_info(text: str) -> dict[str, Any]:
    """The base-model identity recorded in an adapter_config.json."""
    return dict(_parse_document(text)["base_model"])


def _parse_document(text: str) -> dict[str, Any]:
    try:
        document = json.loads(text)
    except (json.JSONDecodeError, TypeError) as err:
        raise ValueError(f"adapter_config.json is not valid JSON: {err}") from None
    if not isinstance(document, dict):
        raise ValueError("adapter_config.json must hold a JSON object")
    version = document.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"adapter_config.json: format_version {version!r} is not supported "
                         f"(this version reads {FORMAT_VERSION})")
    naming = document.get("tensor_naming")
    if naming != TENSOR_NAMING:
        raise ValueError(f"adapter_config.json: tensor_naming {naming!r} is not supported "
                         f"(expected {TENSOR_NAMING!r})")
    unknown = sorted(set(document) - {"format_version", "tensor_naming", "lora", "base_model",
                                      "module_scales"})
    if unknown:
        raise ValueError(f"adapter_config.json: unknown key {unknown[0]!r}")
    if not isinstance(document.get("lora"), dict):
        raise ValueError("adapter_config.json: 'lora' must be an object of LoRA settings")
    if not isinstance(document.get("base_model", {}), dict):
        raise ValueError("adapter_config.json: 'base_model' must be an object")
    document.setdefault("base_model", {})
    return document


# --- where this rank stands ----------------------------------------------------------------------


def _dist() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _world() -> tuple[int, int]:
    if not _dist():
        return 0, 1
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def _is_primary(piece: LoRAPiece) -> bool:
    """Whether this rank sends the piece (exactly one rank does for every block)."""
    if not parallel_state.model_parallel_is_initialized():
        return True
    if piece.expert:
        return (parallel_state.get_expert_data_parallel_rank() == 0
                and parallel_state.get_expert_tensor_parallel_rank() == 0)
    if parallel_state.get_data_parallel_rank(with_context_parallel=True) != 0:
        return False
    return not piece.replicated_over_tp or parallel_state.get_tensor_model_parallel_rank() == 0


def _pieces(model_chunks: ModelChunks) -> list[LoRAPiece]:
    return [piece for module in lora_modules(model_chunks) for piece in module.lora_pieces()]


def _collective_device(model_chunks: ModelChunks) -> torch.device:
    for chunk in unwrap_chunks(model_chunks):
        for param in chunk.parameters():
            return param.device
    return torch.device("cpu")


# --- gathering -----------------------------------------------------------------------------------


def lora_state_dict(model_chunks: ModelChunks, dst: Optional[int] = 0
                    ) -> Optional[dict[str, torch.Tensor]]:
    """Every LoRA tensor of the model, unsharded and globally named (see the module doc).

    Collective over all ranks. Returns the dict on global rank ``dst`` and None elsewhere, or on
    every rank when ``dst`` is None. Tensors are CPU copies in the parameters' dtype.
    """
    rank, world = _world()
    mine = [(p.name, p.global_shape, p.index, p.local.detach().to("cpu", copy=True))
            for p in _pieces(model_chunks) if _is_primary(p)]
    if world == 1:
        gathered = [mine]
    elif dst is None:
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, mine)
    else:
        gathered = [None] * world if rank == dst else None
        torch.distributed.gather_object(mine, gathered, dst=dst)
    if dst is not None and rank != dst:
        return None
    return _assemble(piece for pieces in gathered for piece in pieces)


def _assemble(pieces) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for name, shape, index, block in pieces:
        if name not in tensors:
            tensors[name] = torch.empty(shape, dtype=block.dtype)
            covered[name] = torch.zeros(shape, dtype=torch.bool)
        elif tuple(tensors[name].shape) != tuple(shape) or tensors[name].dtype != block.dtype:
            raise RuntimeError(f"lora tensor {name}: ranks disagree on its shape or dtype "
                               f"({tuple(tensors[name].shape)} {tensors[name].dtype} vs "
                               f"{tuple(shape)} {block.dtype})")
        if covered[name][index].any():
            raise RuntimeError(f"lora tensor {name}: block {index} sent twice")
        tensors[name][index] = block
        covered[name][index] = True
    for name, mask in covered.items():
        if not bool(mask.all()):
            raise RuntimeError(f"lora tensor {name}: {int((~mask).sum())} elements held by no rank")
    return {name: tensors[name] for name in sorted(tensors)}


# --- saving --------------------------------------------------------------------------------------


def _check_same_config(model_config: LoRAConfig, other: LoRAConfig, what: str) -> None:
    for field in ("rank", "alpha", "targets", "expert_rank", "moe_rank_scaling", "expert_layout"):
        mine, theirs = getattr(model_config, field), getattr(other, field)
        if field == "targets":
            mine, theirs = sorted(mine), sorted(theirs)
        if mine != theirs:
            raise AdapterError(f"{what} has lora.{field} {theirs!r} but the model's adapters "
                               f"were injected with {mine!r}")


def save_adapter(model_chunks: ModelChunks, directory: str | os.PathLike, lora_config: LoRAConfig,
                 base_info: Optional[Mapping[str, Any]] = None) -> str:
    """Write ``adapter_model.safetensors`` and ``adapter_config.json`` into ``directory``.

    Collective over all ranks; global rank 0 writes, atomically (see the module doc). Every rank
    returns the directory's absolute path once it is in place, or raises the writer's error.
    """
    injected = injected_config(model_chunks)
    if injected is None:
        raise AdapterError("save_adapter: the model has no LoRA adapters (inject_lora first)")
    _check_same_config(injected, lora_config, "save_adapter's lora_config")
    directory = os.path.abspath(os.fspath(directory))
    tensors = lora_state_dict(model_chunks, dst=0)
    rank, world = _world()
    error = None
    if rank == 0:
        try:
            if not tensors:
                raise AdapterError("save_adapter: the model has no LoRA tensors")
            config_text = adapter_config_json(
                lora_config, base_info,
                module_scales(lora_config, {k: v.shape for k, v in tensors.items()}))
            _write_adapter(directory, tensors, config_text)
        except (OSError, ValueError, RuntimeError) as err:
            error = f"{type(err).__name__}: {err}"
    if world > 1:
        status = [error]
        torch.distributed.broadcast_object_list(status, src=0)
        error = status[0]
    if error is not None:
        raise AdapterError(f"save_adapter {directory}: {error}")
    return directory


def _write_adapter(directory: str, tensors: dict[str, torch.Tensor], config_text: str) -> None:
    from safetensors.torch import save_file

    if os.path.lexists(directory):
        if not os.path.isdir(directory):
            raise AdapterError(f"{directory} exists and is not a directory")
        if os.listdir(directory) and not os.path.exists(os.path.join(directory, ADAPTER_CONFIG)):
            raise AdapterError(f"{directory} is a non-empty directory that holds no adapter; "
                               f"refusing to replace it")
    with atomic_directory(directory, replace=True) as staging:
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  os.path.join(staging, ADAPTER_WEIGHTS),
                  metadata={"format": "pt", "format_version": str(FORMAT_VERSION),
                            "tensor_naming": TENSOR_NAMING})
        with open(os.path.join(staging, ADAPTER_CONFIG), "w", encoding="utf-8") as fh:
            fh.write(config_text)


# --- loading -------------------------------------------------------------------------------------


def read_adapter_config(directory: str | os.PathLike) -> tuple[LoRAConfig, dict[str, Any]]:
    """(LoRAConfig, base-model identity) of an adapter directory; one AdapterError line."""
    path = os.path.join(os.fspath(directory), ADAPTER_CONFIG)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise AdapterError(f"cannot read {path}: {reason}") from None
    try:
        return lora_config_from_json(text), read_base_info(text)
    except ValueError as err:
        raise AdapterError(f"{path}: {err}") from None


def base_identity(model_config=None, tokenizer=None) -> dict[str, Any]:
    """What an adapter records of the base it was trained on, and what a base is checked against
    when an adapter is loaded: the model's architecture (``ModelConfig.fingerprint``, whatever
    its config file or checkpoint directory is called; its name too, for messages) and the
    tokenizer's fingerprint."""
    identity: dict[str, Any] = {}
    if model_config is not None:
        identity.update(model_config=model_config.name, model_fingerprint=model_config.fingerprint)
    if tokenizer is not None:
        identity.update(tokenizer_sha256=tokenizer.fingerprint,
                        tokenizer_vocab_size=tokenizer.vocab_size)
    return identity


def check_base_identity(recorded: Mapping[str, Any], expected: Mapping[str, Any], where: str,
                        tokenizer_name: str = "this tokenizer") -> None:
    """Refuse an adapter (``where``) whose recorded base is another model or tokenizer than
    ``expected`` (a ``base_identity``); what either side does not record is not compared. The
    model is compared by architecture, never by its config's name alone (an HF checkpoint and
    the model file its import wrote are the same model under two names)."""
    if ("model_fingerprint" in recorded and "model_fingerprint" in expected
            and recorded["model_fingerprint"] != expected["model_fingerprint"]):
        raise AdapterError(f"{where} was trained on another model ({recorded.get('model_config')!r}) "
                           f"than {expected.get('model_config')!r}: their layers differ")
    if ("tokenizer_sha256" in recorded and "tokenizer_sha256" in expected
            and recorded["tokenizer_sha256"] != expected["tokenizer_sha256"]):
        raise AdapterError(f"{where} was trained with another tokenizer than {tokenizer_name}")


def load_adapter(model_chunks: ModelChunks, directory: str | os.PathLike,
                 base_info: Optional[Mapping[str, Any]] = None) -> LoRAConfig:
    """Load an adapter directory into the LoRA tensors of any parallel layout; returns its config.

    A model without adapters gets them first (``inject_lora`` with the adapter's config; do that
    before wrapping in DDP). Refuses, with one AdapterError line on every rank: a config whose
    rank/alpha/targets differ from the injected ones, a ``base_info`` entry that differs from the
    recorded one, a missing tensor or one of the wrong shape, tensors the model does not use.
    Collective over all ranks.
    """
    directory = os.fspath(directory)
    config, recorded = read_adapter_config(directory)
    check_base_identity(recorded, base_info or {}, directory)
    injected = injected_config(model_chunks)
    if injected is None:
        inject_lora(model_chunks, config)
    else:
        _check_same_config(injected, config, directory)
    weights = os.path.join(directory, ADAPTER_WEIGHTS)

    error, owned, names = None, 0, None
    try:
        error, owned, names = _read_pieces(weights, _pieces(model_chunks))
    except AdapterError as err:
        error = str(err)
    rank, world = _world()
    if world > 1:
        status = torch.tensor([1 if error else 0, owned], dtype=torch.int64,
                              device=_collective_device(model_chunks))
        torch.distributed.all_reduce(status)
        failed, owned = status.tolist()
        if failed and error is None:
            error = f"{weights}: does not fit the model on another rank (see its error)"
    if error is None and names is not None and owned != len(names):
        error = (f"{weights} holds {len(names)} tensors but this model's adapters use {owned} "
                 f"(different base model or targets)")
    if error is not None:
        raise AdapterError(error)
    return config


def _read_pieces(weights: str, pieces: list[LoRAPiece]):
    """Copy this rank's slices; (first error or None, names this rank owns, names in the file)."""
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(weights):
        raise AdapterError(f"{weights}: no such file")
    try:
        handle = safe_open(weights, framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise AdapterError(f"{weights} is not a readable safetensors file: {err}") from None
    with handle:
        names = set(handle.keys())
        owned = 0
        with torch.no_grad():
            for piece in pieces:
                if piece.name not in names:
                    return f"{weights} has no tensor {piece.name}", owned, names
                view = handle.get_slice(piece.name)
                shape = tuple(view.get_shape())
                if shape != tuple(piece.global_shape):
                    return (f"{weights}: {piece.name} has shape {list(shape)}, the model needs "
                            f"{list(piece.global_shape)}"), owned, names
                piece.local.copy_(view[piece.index])
                if _is_primary(piece) and all(s.start == 0 for s in piece.index):
                    owned += 1
    return None, owned, names


# --- merging -------------------------------------------------------------------------------------


def merge_lora(model_chunks: ModelChunks) -> list[str]:
    """Fold ``W += s * B A`` into every adapted base weight (per expert too), in place, and remove
    the adapters: the modules get their base classes back and the model's state dicts are those of
    the base model again. Base parameters stay frozen. Returns the merged modules' names. Local
    (no communication): each rank merges its own shards."""
    merged = []
    for module in lora_modules(model_chunks):
        module.merge_lora_()
        merged.append(module.lora_name)
        module.remove_lora()
    for chunk in unwrap_chunks(model_chunks):
        chunk.__dict__.pop("_lora_config", None)
        handle = chunk.__dict__.pop("_lora_input_grad_hook", None)
        if handle is not None:
            handle.remove()
    return merged


def lora_sharded_state_dict(model: torch.nn.Module, prefix: str = "",
                            metadata: Optional[dict] = None) -> dict:
    """The LoRA entries of one chunk's Megatron sharded state dict (for dist checkpoints of the
    adapter alone in any layout)."""
    (chunk,) = unwrap_chunks(model)
    sharded = chunk.sharded_state_dict(prefix=prefix, metadata=metadata)
    return {k: v for k, v in sharded.items()
            if ".lora_A." in k or ".lora_B." in k or "_lora_A" in k or "_lora_B" in k}


def describe_adapter(directory: str | os.PathLike) -> dict[str, Any]:
    """Config, base identity and tensor shapes of an adapter directory (reads no tensor data)."""
    from safetensors import safe_open

    config, base = read_adapter_config(directory)
    weights = os.path.join(os.fspath(directory), ADAPTER_WEIGHTS)
    with safe_open(weights, framework="pt", device="cpu") as handle:
        shapes = {name: list(handle.get_slice(name).get_shape()) for name in handle.keys()}
    return {"format_version": FORMAT_VERSION, "lora": config.to_dict(), "base_model": base,
            "tensors": shapes}
