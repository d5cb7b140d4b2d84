"""Import a Hugging Face CLIP or SigLIP vision tower into the multimodal model's CLIPViTModel.

The name tables (Hugging Face <-> Megatron, one conversion kind per tensor) are in
``vision_mappings``, beside this module (``model/`` stands below ``hf/``, which holds the language
model families' tables).

* :func:`vision_config_from_hf` turns a transformers ``CLIPVisionConfig`` / ``SiglipVisionConfig``
  (or the ``vision_config`` of a full CLIP/SigLIP config) into a :class:`VisionConfig`;
* :func:`load_hf_vision_tower` reads the vision tensors of a checkpoint folder
  (``*.safetensors``, lazily, only the tower's) and copies this rank's tensor-parallel shard of
  each into ``model.vision_model``; every tower weight must be found, and nothing is left over.

Conversions: q/k/v projections are fused into Megatron's ``linear_qkv`` in its per-head layout
(for each head: its q rows, its k rows, its v rows), the class embedding gains its [1, 1, h] shape,
everything else is copied as is. Weights, not the projector: the projector of a LLaVA checkpoint is
not part of a CLIP/SigLIP tower.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Callable, Dict, List, Mapping, Tuple

import torch

from megatron_slmoe.model.multimodal import VisionConfig
from megatron_slmoe.model.vision_mappings import HF_ACTIVATIONS, HF_PREFIXES, VISION_MAPPINGS
from megatron_slmoe.utils.errors import InputError



class HFImportError(InputError, ValueError):
    """A checkpoint or config that cannot become the vision tower; the message is one line."""


def vision_config_from_hf(hf_config, **overrides) -> VisionConfig:
    """The VisionConfig of a transformers CLIP/SigLIP (vision) config; ``overrides`` set the
    fields Hugging Face has no say in (projector, image token, class-token dropping)."""
    hf = getattr(hf_config, "vision_config", None) or hf_config
    model_type = str(getattr(hf, "model_type", ""))
    kind = "siglip" if "siglip" in model_type else "clip" if "clip" in model_type else None
    if kind is None:
        raise HFImportError(f"vision model type {model_type!r} is neither CLIP nor SigLIP")
    activation = HF_ACTIVATIONS.get(getattr(hf, "hidden_act", None))
    if activation is None:
        raise HFImportError(f"vision activation {hf.hidden_act!r} is not supported "
                            f"(supported: {', '.join(HF_ACTIVATIONS)})")
    values = dict(model_type=kind, img_h=hf.image_size, img_w=hf.image_size,
                  patch_dim=hf.patch_size, num_layers=hf.num_hidden_layers,
                  hidden_size=hf.hidden_size, num_attention_heads=hf.num_attention_heads,
                  ffn_hidden_size=hf.intermediate_size, activation=activation,
                  layernorm_epsilon=hf.layer_norm_eps,
                  drop_class_token=kind == "clip")
    values.update(overrides)
    try:
        return VisionConfig(**values)
    except ValueError as err:
        raise HFImportError(str(err)) from None


def _expand(pattern: str, layers: int) -> List[Tuple[str, ...]]:
    """Concrete names of a pattern: one tuple per layer (the q/k/v alternatives in order)."""
    names = []
    for layer in range(layers) if "*" in pattern else [None]:
        name = pattern.replace("*", str(layer)) if layer is not None else pattern
        match = re.search(r"\{([^}]*)\}", name)
        if match:
            names.append(tuple(name[:match.start()] + alt + name[match.end():]
                               for alt in match.group(1).split(",")))
        else:
            names.append((name,))
    return names


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Megatron's per-head layout: for each head its q, k and v rows (bias: entries)."""
    head = q.shape[0] // heads
    parts = [t.reshape(heads, head, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(3 * q.shape[0], *q.shape[1:])


_CONVERT: Dict[str, Callable] = {
    "copy": lambda tensors, vision: tensors[0],
    "class_token": lambda tensors, vision: tensors[0].reshape(1, 1, -1),
    "qkv": lambda tensors, vision: _fuse_qkv(*tensors, vision.num_attention_heads),
}


class _SafetensorsFolder:
    """Lazy reads of named tensors from the ``*.safetensors`` files of a folder."""

    def __init__(self, folder: str):
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        if not files:
            raise HFImportError(f"{folder}: no *.safetensors files")
        self._handles = [safe_open(f, framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def keys(self):
        return self._where.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)


def _prefix(names, mappings) -> str:
    first = mappings[-1][0].replace("*", "0").replace("{q,k,v}", "q")
    for prefix in HF_PREFIXES:
        if prefix + first in names:
            return prefix
    raise HFImportError(f"no vision tower tensors found (looked for {first!r} under "
                        f"{', '.join(repr(p) for p in HF_PREFIXES if p)} or at the top level)")


def megatron_vision_tensors(hf_tensors: Mapping[str, torch.Tensor], vision: VisionConfig
                            ) -> Dict[str, torch.Tensor]:
    """Full (unsharded) tensors of the tower named as in CLIPViTModel, from Hugging Face names."""
    mappings = VISION_MAPPINGS[vision.model_type]
    prefix = _prefix(set(hf_tensors.keys()), mappings)
    out = {}
    for hf_pattern, megatron_pattern, kind in mappings:
        sources = _expand(hf_pattern, vision.num_layers)
        targets = _expand(megatron_pattern, vision.num_layers)
        for names, (target,) in zip(sources, targets):
            missing = [prefix + n for n in names if prefix + n not in hf_tensors]
            if missing:
                raise HFImportError(f"checkpoint lacks {missing[0]!r}")
            tensors = [hf_tensors[prefix + n] for n in names]
            out[target] = _CONVERT[kind](tensors, vision)
    return out


def _tp_shard(param: torch.nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state

    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    rank = parallel_state.get_tensor_model_parallel_rank()
    size = parallel_state.get_tensor_model_parallel_world_size()
    return full.chunk(size, dim=dim)[rank]


def load_hf_vision_tower(model, checkpoint, vision: VisionConfig) -> List[str]:
    """Copy a Hugging Face CLIP/SigLIP tower (a folder of safetensors, or a state dict) into
    ``model.vision_model`` (a LLaVAModel's, or a CLIPViTModel itself) built with ``vision``,
    this rank's tensor-parallel shards. Returns the Megatron names filled; every tower parameter
    must be found with its shape. A pipeline stage without the tower fills nothing."""
    tower = getattr(model, "vision_model", model)
    if tower is None:
        return []
    source = _SafetensorsFolder(checkpoint) if isinstance(checkpoint, str) else checkpoint
    full = megatron_vision_tensors(source, vision)
    params = dict(tower.named_parameters())
    missing = sorted(set(params) - set(full))
    if missing:
        raise HFImportError(f"the checkpoint has no tensor for vision_model.{missing[0]}")
    with torch.no_grad():
        for name, param in params.items():
            shard = _tp_shard(param, full[name])
            if tuple(shard.shape) != tuple(param.shape):
                raise HFImportError(f"vision_model.{name}: checkpoint shape "
                                    f"{tuple(full[name].shape)} does not fit {tuple(param.shape)}")
            param.copy_(shard.to(param.dtype))
    return sorted(params)


def read_hf_vision_config(folder: str, **overrides) -> VisionConfig:
    """The VisionConfig of a checkpoint folder's ``config.json`` (through transformers)."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise HFImportError(f"{folder}: no config.json")
    return vision_config_from_hf(AutoConfig.from_pretrained(folder), **overrides)


# The architecture a Hugging Face tower fixes; the rest (projector, image token) is the run's.
_ARCHITECTURE = ("model_type", "img_h", "img_w", "patch_dim", "num_layers", "hidden_size",
                 "num_attention_heads", "ffn_hidden_size", "activation", "layernorm_epsilon")


def check_hf_vision_checkpoint(folder: str, vision: VisionConfig) -> None:
    """HFImportError (one line naming the setting) unless the folder holds a CLIP/SigLIP tower
    of the architecture ``vision`` describes."""
    if not glob.glob(os.path.join(folder, "*.safetensors")):
        raise HFImportError("no *.safetensors files")
    found = read_hf_vision_config(folder)
    for name in _ARCHITECTURE:
        ours, theirs = getattr(vision, name), getattr(found, name)
        if ours != theirs:
            raise HFImportError(f"the checkpoint's tower has {name} {theirs!r}, the run "
                                f"{VisionConfig.flag(name)} {ours!r}")
