"""LoRA settings and the ``adapter_config.json`` that travels with an adapter.

``LoRAConfig`` is the one small dataclass of LoRA settings (Megatron-style flags in brackets):

* ``rank`` r (``--lora-rank``), 1..256;
* ``alpha`` (``--lora-alpha``): the LoRA branch is scaled by ``s = alpha / r``;
* ``dropout`` (``--lora-dropout``), 0 <= p < 1: dropout on the LoRA input only, in training;
* ``targets`` (``--lora-target-modules``): which projections get an adapter, from :data:`TARGETS`;
* ``init_seed`` (``--lora-init-seed``): LoRA A is drawn from a generator seeded by this and the
  tensor's global name, so the initial adapter is the same whatever the parallel layout.

Every invalid value is one ValueError line naming the field. ``to_json`` writes the content of
``adapter_config.json`` (format version, LoRA settings, the identity of the base model the caller
passes); ``from_json`` / :func:`read_base_info` read it back, refusing what they do not know.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

FORMAT_VERSION = 1
"""Version of the adapter directory format (adapter_config.json + adapter_model.safetensors)."""

TENSOR_NAMING = "megatron_slmoe.global.v1"
"""How tensors are named in adapter_model.safetensors (see megatron_slmoe.lora.adapter)."""

TARGETS: tuple[str, ...] = (
    "linear_qkv",      # attention QKV projection (ColumnParallelLinear)
    "linear_proj",     # attention output projection (RowParallelLinear)
    "linear_fc1",      # dense MLP fc1 and, in MoE layers, each routed expert's fc1 (gate|up)
    "linear_fc2",      # dense MLP fc2 and each routed expert's fc2
    "shared_experts",  # the shared expert's linear_fc1 and linear_fc2
    "router",          # the router's gating linear (full width, router dtype)
    "latent",          # latent_down (d -> l) and latent_up (l -> d)
    "vision_attention",  # multimodal: the vision tower's attention linear_qkv and linear_proj
    "projector",       # multimodal: the vision projector's linears (fc1/fc2, or the affine one)
)
"""The LoRA target names, in the order messages list them."""

MAX_RANK = 256

_FLAGS = {"rank": "--lora-rank", "alpha": "--lora-alpha", "dropout": "--lora-dropout",
          "targets": "--lora-target-modules", "init_seed": "--lora-init-seed"}


def _field(name: str) -> str:
    return f"lora.{name} ({_FLAGS[name]})"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class LoRAConfig:
    rank: int = 8
    """r: the inner dimension of every adapter, 1..256."""
    alpha: float = 16.0
    """The LoRA branch is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout probability on the LoRA input (training only), 0 <= p < 1."""
    targets: list[str] = field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    """Names from TARGETS."""
    init_seed: int = 0
    """Seed of the layout-independent initialisation of LoRA A."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field; one ValueError line naming the first bad field."""
        if not _is_int(self.rank) or not 1 <= self.rank <= MAX_RANK:
            raise ValueError(f"{_field('rank')} must be an integer in 1..{MAX_RANK}, "
                             f"got {self.rank!r}")
        if not _is_number(self.alpha) or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"{_field('alpha')} must be a positive finite number, "
                             f"got {self.alpha!r}")
        if not _is_number(self.dropout) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{_field('dropout')} must be a number with 0 <= p < 1, "
                             f"got {self.dropout!r}")
        if isinstance(self.targets, str) or not isinstance(self.targets, (list, tuple)):
            raise ValueError(f"{_field('targets')} must be a list of names from "
                             f"{', '.join(TARGETS)}, got {self.targets!r}")
        if not self.targets:
            raise ValueError(f"{_field('targets')} must name at least one of {', '.join(TARGETS)}")
        seen = set()
        for target in self.targets:
            if target not in TARGETS:
                raise ValueError(f"{_field('targets')}: unknown target {target!r}; the targets "
                                 f"are {', '.join(TARGETS)}")
            if target in seen:
                raise ValueError(f"{_field('targets')}: {target!r} is given twice")
            seen.add(target)
        self.targets = list(self.targets)
        if not _is_int(self.init_seed) or self.init_seed < 0:
            raise ValueError(f"{_field('init_seed')} must be a non-negative integer, "
                             f"got {self.init_seed!r}")

    @property
    def scaling(self) -> float:
        """s = alpha / rank."""
        return float(self.alpha) / self.rank

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, base_info: Mapping[str, Any] | None = None) -> str:
        """The content of adapter_config.json: format version, tensor naming, these settings and
        ``base_info`` (identity of the base model, e.g. {"model_config": "tiny"}), JSON-able."""
        document = {
            "format_version": FORMAT_VERSION,
            "tensor_naming": TENSOR_NAMING,
            "lora": self.to_dict(),
            "base_model": dict(base_info or {}),
        }
        try:
            return json.dumps(document, indent=2, sort_keys=True, allow_nan=False) + "\n"
        except (TypeError, ValueError) as err:
            raise ValueError(f"adapter base_info must be plain JSON values: {err}") from None

    @classmethod
    def from_json(cls, text: str) -> "LoRAConfig":
        """The LoRAConfig of an adapter_config.json; one ValueError line for anything wrong."""
        document = _parse_document(text)
        section = document["lora"]
        known = {"rank", "alpha", "dropout", "targets", "init_seed"}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ValueError(f"adapter_config.json: unknown key lora.{unknown[0]} (known: "
                             f"{', '.join(sorted(known))})")
        missing = sorted(known - set(section))
        if missing:
            raise ValueError(f"adapter_config.json: lora.{missing[0]} is missing")
        try:
            return cls(**section)
        except ValueError as err:
            raise ValueError(f"adapter_config.json: {err}") from None


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
    unknown = sorted(set(document) - {"format_version", "tensor_naming", "lora", "base_model"})
    if unknown:
        raise ValueError(f"adapter_config.json: unknown key {unknown[0]!r}")
    if not isinstance(document.get("lora"), dict):
        raise ValueError("adapter_config.json: 'lora' must be an object of LoRA settings")
    if not isinstance(document.get("base_model", {}), dict):
        raise ValueError("adapter_config.json: 'base_model' must be an object")
    document.setdefault("base_model", {})
    return document
