"""Put LoRA adapters into a built Megatron model (all pipeline chunks of this rank), in place.

``inject_lora(model_chunks, lora_config)`` finds the modules each target names, turns them into
their LoRA subclasses (``megatron_slmoe.lora.targets``), freezes every other parameter and returns
the global names of the adapted modules. Call it after loading the base weights and before wrapping
the chunks in DistributedDataParallel (DDP allocates gradient buffers for the parameters that
require grad at construction).

Which modules each target names: ``megatron_slmoe.lora.targets``.

**Which targets must match.** Pipeline stages hold different layers, so a target may be absent
from one stage and present in another (a dense first stage has no router). A target is an error
only when it matches nothing in the *whole model*: each rank counts its matches per target over its
chunks, the counts are summed over the pipeline-parallel group (one small all-reduce; every rank
of a stage has the same modules), and every rank then raises the same ``LoRATargetError``, so no
rank is left waiting in a collective. ``inject_lora`` is therefore collective over the pipeline
group when pipeline parallelism is on.

**Recomputation.** With a frozen embedding the first layer's input does not require grad, and
Megatron's (reentrant) activation checkpointing would then return outputs without a graph, so the
LoRA parameters inside would get no gradient. When the config recomputes activations, the
embedding's output is therefore marked as requiring grad (the usual PEFT remedy).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator, Union

import torch
from megatron.core import parallel_state
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_slmoe.lora.config import LoRAConfig
from megatron_slmoe.lora.base import is_lora_module
from megatron_slmoe.lora.targets import (
    TARGETS,
    LoRATargetError,
    adapt,
    expert_rank,
    kind_of,
    regions,
)

ModelChunks = Union[torch.nn.Module, Iterable[torch.nn.Module]]


def unwrap_chunks(model_chunks: ModelChunks, allow_ddp: bool = True) -> list[torch.nn.Module]:
    """The model chunks without their Float16Module / DDP wrappers."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    if not chunks:
        raise ValueError("no model chunks given")
    unwrapped = []
    for chunk in chunks:
        while isinstance(chunk, (DistributedDataParallel, Float16Module)):
            if isinstance(chunk, DistributedDataParallel) and not allow_ddp:
                raise ValueError("inject LoRA before wrapping the model in "
                                 "DistributedDataParallel (its gradient buffers are fixed then)")
            chunk = chunk.module
        unwrapped.append(chunk)
    return unwrapped


def _global_prefixes(chunk: torch.nn.Module) -> list[tuple[str, str]]:
    """(local path of each transformer layer, its path with the global layer index)."""
    out = []
    for name, module in chunk.named_modules():
        if isinstance(module, TransformerLayer) and name:
            head = name.rsplit(".", 1)[0] if "." in name else ""
            glob = f"{head}.{module.layer_number - 1}" if head else str(module.layer_number - 1)
            out.append((name, glob))
    out.sort(key=lambda item: len(item[0]), reverse=True)
    return out


def global_module_name(local_name: str, prefixes: list[tuple[str, str]]) -> str:
    for local, glob in prefixes:
        if local_name == local or local_name.startswith(local + "."):
            return glob + local_name[len(local):]
    return local_name


def _candidates(chunks: list[torch.nn.Module]):
    """Every (chunk index, parent, attr, child, local name, module kind) that LoRA could adapt."""
    found = []
    for index, chunk in enumerate(chunks):
        where = regions(chunk)
        for parent_name, parent in chunk.named_modules():
            for attr, child in parent.named_children():
                kind = kind_of(parent, attr, child, where)
                if kind is not None:
                    name = f"{parent_name}.{attr}" if parent_name else attr
                    found.append((index, parent, attr, child, name, kind))
    return found


def _match_counts(candidates, chunks) -> dict[str, int]:
    counts = dict.fromkeys(TARGETS, 0)
    for *_, kind in candidates:
        for target in kind.targets:
            counts[target] += 1
    if (torch.distributed.is_available() and torch.distributed.is_initialized()
            and parallel_state.model_parallel_is_initialized()
            and parallel_state.get_pipeline_model_parallel_world_size() > 1):
        device = next((p.device for c in chunks for p in c.parameters()), torch.device("cpu"))
        tensor = torch.tensor([counts[t] for t in TARGETS], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(tensor, group=parallel_state.get_pipeline_model_parallel_group())
        counts = dict(zip(TARGETS, tensor.tolist()))
    return counts


def _check_expert_ranks(candidates, lora_config: LoRAConfig, chunks=()) -> None:
    """The routed experts' rank can be had (--moe-rank-scaling against the model's top-k), and a
    shared-outer expert layout has routed experts to adapt somewhere in the model."""
    wanted = set(lora_config.targets)
    adapted = 0
    for _, _, _, child, _, kind in candidates:
        if kind.name == "routed_experts" and wanted.intersection(kind.targets):
            expert_rank(child, lora_config)
            adapted += 1
    if lora_config.expert_layout == "shared-outer" and _summed_over_stages(adapted, chunks) == 0:
        raise LoRATargetError(
            "--expert-lora-layout shared-outer: no routed experts are adapted (the model has "
            "none, or neither linear_fc1 nor linear_fc2 is a target); use per-expert")


def _summed_over_stages(count: int, chunks) -> int:
    """``count`` summed over the pipeline stages (every rank of a stage has the same modules)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()
            and parallel_state.model_parallel_is_initialized()
            and parallel_state.get_pipeline_model_parallel_world_size() > 1):
        return count
    device = next((p.device for c in chunks for p in c.parameters()), torch.device("cpu"))
    tensor = torch.tensor([count], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(tensor, group=parallel_state.get_pipeline_model_parallel_group())
    return int(tensor.item())


def _check_targets(lora_config: LoRAConfig, counts: dict[str, int]) -> None:
    targetable = [t for t in TARGETS if counts.get(t, 0) > 0]
    for target in lora_config.targets:
        if counts.get(target, 0) == 0:
            raise LoRATargetError(
                f"lora target {target!r} matches nothing; targetable: "
                f"{', '.join(targetable) if targetable else '(nothing in this model)'}")


def check_targets(model_chunks: ModelChunks, lora_config: LoRAConfig) -> None:
    """Raise LoRATargetError for a target of ``lora_config`` that matches nothing in these
    chunks, taken as the whole model (the start-up check, on a model built on the meta
    device)."""
    chunks = unwrap_chunks(model_chunks, allow_ddp=False)
    candidates = _candidates(chunks)
    _check_targets(lora_config, _match_counts(candidates, chunks))
    _check_expert_ranks(candidates, lora_config, chunks)


def _keep_input_grad(chunk: torch.nn.Module) -> None:
    # A multimodal model's text embedding is its language model's.
    embedding = getattr(chunk, "embedding", None) or getattr(
        getattr(chunk, "language_model", None), "embedding", None)
    config = getattr(chunk, "config", None)
    if embedding is None or getattr(config, "recompute_granularity", None) is None:
        return
    if getattr(chunk, "_lora_input_grad_hook", None) is not None:
        return

    def hook(_module, _inputs, output):
        if isinstance(output, torch.Tensor) and not output.requires_grad:
            output.requires_grad_(True)
        return output

    chunk._lora_input_grad_hook = embedding.register_forward_hook(hook)


def inject_lora(model_chunks: ModelChunks, lora_config: LoRAConfig) -> list[str]:
    """Adapt the targets of ``lora_config`` in every chunk, in place; freeze the rest.

    Returns the global names of the adapted modules (layer indices are global, so names agree
    across pipeline layouts), in model order. Raises LoRATargetError for a target that matches
    nothing in the whole model (collective over the pipeline group, see the module doc).
    """
    chunks = unwrap_chunks(model_chunks, allow_ddp=False)
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if is_lora_module(module):
                raise ValueError(f"the model already has LoRA adapters ({name}); "
                                 "merge_lora or remove them before injecting again")
    candidates = _candidates(chunks)
    _check_targets(lora_config, _match_counts(candidates, chunks))
    _check_expert_ranks(candidates, lora_config, chunks)  # before any module is changed
    wanted = set(lora_config.targets)
    adapted: list[str] = []
    for index, parent, attr, child, local_name, kind in candidates:
        if not wanted.intersection(kind.targets):
            continue
        name = global_module_name(local_name, _global_prefixes(chunks[index]))
        setattr(parent, attr, adapt(kind, child, parent, attr, lora_config, name, wanted))
        adapted.append(name)
    lora_ids = {id(p) for chunk in chunks for m in chunk.modules() if is_lora_module(m)
                for p in m.lora_parameters()}
    for chunk in chunks:
        for param in chunk.parameters():
            if id(param) not in lora_ids:
                param.requires_grad_(False)
        # expert_bias of the router is a buffer: its updates follow the SLMoE config, not LoRA.
        chunk._lora_config = lora_config
        _keep_input_grad(chunk)
    return adapted


def lora_modules(model_chunks: ModelChunks) -> list[torch.nn.Module]:
    """This rank's LoRA modules, in model order over the chunks."""
    return [m for chunk in unwrap_chunks(model_chunks) for m in chunk.modules()
            if is_lora_module(m)]


@contextmanager
def adapters_disabled(model_chunks: ModelChunks) -> Iterator[None]:
    """The base model for the duration: every adapter's scaling is 0, so each LoRA branch adds
    exactly zero (the routing-stability terms compare the routing against the base this way)."""
    modules = lora_modules(model_chunks)
    scalings = [module.lora_scaling for module in modules]
    for module in modules:
        module.lora_scaling = 0.0
    try:
        yield
    finally:
        for module, scaling in zip(modules, scalings):
            module.lora_scaling = scaling


def injected_config(model_chunks: ModelChunks) -> LoRAConfig | None:
    """The LoRAConfig ``inject_lora`` used on these chunks (None when not injected)."""
    for chunk in unwrap_chunks(model_chunks):
        config = getattr(chunk, "_lora_config", None)
        if config is not None:
            return config
    return None
