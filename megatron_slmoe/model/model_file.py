"""Model configurations: YAML files of Megatron-Core TransformerConfig fields, read and checked.

A model file is a mapping with up to three sections::

    model:            # TransformerConfig fields, spelled as Megatron spells them, plus the
      num_layers: 4   # GPTModel arguments in GPT_FIELDS (vocab_size, max_sequence_length, ...)
      ...
    slmoe:            # SLMoEConfig fields (optional section)
      freeze_router: false
    blocks:           # BlocksConfig fields (optional section): layer blocks that
      attention_residual_block: 12   # TransformerConfig has no field for

Only model fields belong in a file: run settings (parallel sizes, dtypes, initialisation, the
fields of Megatron's ModelParallelConfig) are passed as overrides to
``ModelConfig.transformer_config``. The packaged files live in ``megatron_slmoe/model/configs/``;
``load_model_config("tiny")`` finds ``configs/tiny.yaml``. Building the model: ``model.build``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import importlib.resources
import json
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional

import torch
import torch.nn.functional as F
import yaml
from megatron.core.activations import squared_relu
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.config.types import coerce, describe, matches
from megatron_slmoe.config.yaml_file import describe_yaml_error, load_unique
from megatron_slmoe.model.validation import flag, make_transformer_config, validate_moe_config
from megatron_slmoe.moe.config import EXPERT_TENSOR_PARALLEL_SIZE, SLMoEConfig
from megatron_slmoe.moe.dispatch import DISPATCHERS
from megatron_slmoe.ops.activations import SiTUGLU

_REQUIRED = object()

# GPTModel arguments a model file may set: name -> (type, default).
GPT_FIELDS: dict[str, tuple[Any, Any]] = {
    "vocab_size": (int, _REQUIRED),
    "max_sequence_length": (int, _REQUIRED),
    "position_embedding_type": (Literal["learned_absolute", "rope", "mrope", "yarn", "none"],
                                "rope"),
    "share_embeddings_and_output_weights": (bool, False),
    "rotary_percent": (float, 1.0),
    "rotary_base": (int, 10000),
}

# Defaults of ours where Megatron's do not suit a Stable Latent MoE model; a file or an override
# may still set them.
_DEFAULTS: dict[str, Any] = {
    "add_bias_linear": False,
    # Megatron's default is the TP size; our experts stay whole (see moe.config).
    "expert_tensor_parallel_size": EXPERT_TENSOR_PARALLEL_SIZE,
    "moe_grouped_gemm": False,
}

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# ``activation_func`` by name in a model file. Non-gated squared-ReLU experts are chosen as in
# Megatron-Core: ``gated_linear_unit: false`` with ``activation_func: squared_relu``.
ACTIVATIONS: dict[str, Any] = {"silu": F.silu, "squared_relu": squared_relu, "gelu": F.gelu,
                               "situ_glu": SiTUGLU}  # its betas: the blocks section


@dataclass(frozen=True)
class BlocksConfig:
    """Layer blocks beyond what Megatron-Core's TransformerConfig fields describe (a model
    file's ``blocks`` section; applied to the decoder spec by ``model.layer_blocks``). Each at
    its default: Megatron-Core's own block."""

    attention_residual_block: Optional[int] = None
    """Block Attention Residuals with this block size (``model.attention_residuals``): the
    residual stream is a running sum and a bank of block vectors, mixed before each sublayer."""
    kda_layers: tuple[int, ...] = ()
    """The layers (0-based) whose attention is Kimi Delta Attention (``model.kda_attention``);
    the others are the TransformerConfig's attention."""
    kda_num_heads: Optional[int] = None
    kda_head_dim: Optional[int] = None
    kda_conv_kernel_size: int = 4
    kda_gate_lower_bound: float = -5.0
    gated_nope_mla: bool = False
    """Multi-latent attention layers without rotation and with a sigmoid output gate
    (``model.gated_nope_mla``)."""
    mla_lora_norm_eps: float = 1e-6
    """The eps of gated NoPE MLA's q/kv LoRA norms."""
    situ_beta: float = 4.0
    """SiTU-GLU's betas, where ``activation_func`` is ``situ_glu`` (``ops.activations``)."""
    situ_linear_beta: float = 25.0

    def __post_init__(self) -> None:
        block = self.attention_residual_block
        if block is not None and (not isinstance(block, int) or isinstance(block, bool)
                                  or block < 1):
            raise ValueError(f"blocks.attention_residual_block must be an integer >= 1, "
                             f"got {block!r}")
        object.__setattr__(self, "kda_layers", tuple(self.kda_layers))
        if self.kda_layers and not (self.kda_num_heads and self.kda_head_dim):
            raise ValueError("blocks.kda_layers needs blocks.kda_num_heads and "
                             "blocks.kda_head_dim")
        if len(set(self.kda_layers)) != len(self.kda_layers) or any(
                not isinstance(i, int) or i < 0 for i in self.kda_layers):
            raise ValueError(f"blocks.kda_layers must be distinct layer indices >= 0, got "
                             f"{list(self.kda_layers)}")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    """The file's stem (``tiny``)."""
    source: str
    """Where it was read from."""
    transformer: Mapping[str, Any]
    """TransformerConfig fields of the model (read-only)."""
    vocab_size: int
    max_sequence_length: int
    position_embedding_type: str = "rope"
    share_embeddings_and_output_weights: bool = False
    rotary_percent: float = 1.0
    rotary_base: int = 10000
    slmoe: SLMoEConfig = field(default_factory=SLMoEConfig)
    blocks: BlocksConfig = field(default_factory=BlocksConfig)

    def transformer_config(self, **overrides: Any) -> TransformerConfig:
        """The validated TransformerConfig of this model with run settings applied (parallel
        sizes, ``bf16``/``fp16``/``params_dtype``, ``perform_initialization``, ...). Also fills
        what a YAML file cannot say: SiLU for gated linear units, the params dtype of bf16/fp16,
        the pipeline dtype under pipeline parallelism."""
        unknown = sorted(set(overrides) - set(_transformer_hints()))
        if unknown:
            raise ConfigError(f"{flag(unknown[0])}: {unknown[0]!r} is not a TransformerConfig "
                              f"field")
        fields = {**_DEFAULTS, **copy.deepcopy(dict(self.transformer)), **overrides}
        if fields.get("activation_func") == "situ_glu":
            fields["activation_func"] = SiTUGLU(self.blocks.situ_beta,
                                                self.blocks.situ_linear_beta)
        elif isinstance(fields.get("activation_func"), str):
            fields["activation_func"] = ACTIVATIONS[fields["activation_func"]]
        if fields.get("gated_linear_unit") and "activation_func" not in fields:
            fields["activation_func"] = F.silu
        if fields.get("multi_latent_attention"):
            # MLA applies its own rotary embedding, configured on the TransformerConfig.
            fields.setdefault("rotary_base", self.rotary_base)
            fields.setdefault("rotary_percent", self.rotary_percent)

        for name, dtype in _DTYPES.items():
            if fields.get(name) and "params_dtype" not in fields:
                fields["params_dtype"] = dtype
        if fields.get("pipeline_model_parallel_size", 1) > 1 and "pipeline_dtype" not in fields:
            fields["pipeline_dtype"] = fields.get("params_dtype", torch.float32)
        validate_moe_config(
            fields,
            tensor_parallel=fields.get("tensor_model_parallel_size", 1),
            expert_parallel=fields.get("expert_model_parallel_size", 1),
            expert_tensor_parallel=fields["expert_tensor_parallel_size"],
            pipeline_parallel=fields.get("pipeline_model_parallel_size", 1),
        )
        config = make_transformer_config(fields)
        if self.vocab_size % config.tensor_model_parallel_size:
            raise ConfigError(f"--tensor-model-parallel-size {config.tensor_model_parallel_size} "
                              f"does not divide the model's vocab_size {self.vocab_size} "
                              f"(Megatron shards the embedding by vocabulary rows)")
        return config

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the architecture: the TransformerConfig fields and the GPT fields that shape
        the layers (not the name or file, the maximum sequence length or the run's MoE
        settings). A model file written by an import has its checkpoint's fingerprint."""
        arch = {"transformer": dict(self.transformer), "vocab_size": self.vocab_size,
                "position_embedding_type": self.position_embedding_type,
                "share_embeddings_and_output_weights": self.share_embeddings_and_output_weights,
                "rotary_percent": float(self.rotary_percent),
                "rotary_base": float(self.rotary_base)}
        if self.blocks != BlocksConfig():
            arch["blocks"] = dataclasses.asdict(self.blocks)
        text = json.dumps(arch, sort_keys=True, default=_plain_value)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def gpt_kwargs(self) -> dict[str, Any]:
        """The GPTModel keyword arguments this file sets."""
        return {name: getattr(self, name) for name in GPT_FIELDS}


def _plain_value(value: Any) -> Any:
    """JSON for the values a model file holds besides JSON's own: tuples and callables by
    name (a dtype, an activation function)."""
    return getattr(value, "__name__", None) or str(value)


# --- reading a file --------------------------------------------------------------------------


def packaged_configs() -> list[str]:
    """Names of the model configs shipped with the package."""
    folder = importlib.resources.files("megatron_slmoe.model") / "configs"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def _resolve(path_or_name: str | os.PathLike) -> tuple[str, str, str]:
    """(name, where, text) of a file path or a packaged config name; ``where`` names the file
    in messages."""
    text_path = os.fspath(path_or_name)
    is_path = (os.sep in text_path or text_path.endswith((".yaml", ".yml"))
               or os.path.exists(text_path))
    if not is_path:
        resource = importlib.resources.files("megatron_slmoe.model") / "configs" / f"{text_path}.yaml"
        if not resource.is_file():
            raise ConfigError(f"no model config named {text_path!r}: not a file, and the packaged "
                              f"configs are {', '.join(packaged_configs())}")
        return text_path, f"megatron_slmoe/model/configs/{text_path}.yaml", resource.read_text(
            encoding="utf-8")
    try:
        with open(text_path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise ConfigError(f"cannot read model config {text_path}: {reason}") from None
    stem = os.path.basename(text_path).rsplit(".", 1)[0]
    return stem, text_path, text


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return load_unique(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: invalid YAML{describe_yaml_error(err)}") from None


@functools.lru_cache(maxsize=None)
def _transformer_hints() -> dict[str, Any]:
    # MLATransformerConfig: TransformerConfig's fields plus the multi-latent attention widths.
    hints = typing.get_type_hints(MLATransformerConfig)
    # Megatron types it int but reads None as "q is not compressed" (linear_q_proj), as
    # DeepSeek-V2-Lite has it.
    hints["q_lora_rank"] = Optional[int]
    return hints


@functools.lru_cache(maxsize=None)
def _run_settings() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(ModelParallelConfig))


def _check_value(name: str, value: Any, hint: Any, where: str) -> Any:
    fits = matches(value, hint)
    if fits is None:
        raise ConfigError(f"{where}: model.{name} cannot be set in a model file "
                          f"(its type {describe(hint)} has no YAML form)")
    if not fits:
        raise ConfigError(f"{where}: model.{name} ({flag(name)}) must be {describe(hint)}, "
                          f"got {value!r}")
    return coerce(value, hint)


def _model_section(section: Any, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: 'model' must be a mapping of field names to values")
    hints = _transformer_hints()
    transformer, gpt = {}, {}
    for name, value in section.items():
        if name in GPT_FIELDS:
            gpt[name] = _check_value(name, value, GPT_FIELDS[name][0], where)
        elif name == "activation_func":
            if value not in ACTIVATIONS:
                raise ConfigError(f"{where}: model.activation_func must be one of "
                                  f"{', '.join(ACTIVATIONS)}, got {value!r}")
            transformer[name] = value
        elif name in _run_settings():
            raise ConfigError(f"{where}: model.{name} is a run setting, not a model field: pass "
                              f"{flag(name)} at launch (ModelConfig.transformer_config override)")
        elif name in hints:
            transformer[name] = _check_value(name, value, hints[name], where)
        else:
            raise ConfigError(f"{where}: unknown key model.{name} (neither a TransformerConfig "
                              f"field nor a GPTModel argument)")
    for name, (_, default) in GPT_FIELDS.items():
        if name not in gpt:
            if default is _REQUIRED:
                raise ConfigError(f"{where}: model.{name} is missing ({flag(name)})")
            gpt[name] = default
    return transformer, gpt


def _dataclass_section(section: Any, cls, key: str, where: str) -> dict[str, Any]:
    """The fields of section ``key`` (a mapping of ``cls`` fields), each checked by its type."""
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: '{key}' must be a mapping of {cls.__name__} fields")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for name, value in section.items():
        if name not in known:
            raise ConfigError(f"{where}: unknown key {key}.{name} ({cls.__name__} fields: "
                              f"{', '.join(sorted(known))})")
        if not matches(value, hints[name]):
            raise ConfigError(f"{where}: {key}.{name} must be {describe(hints[name])}, "
                              f"got {value!r}")
    return section


def _blocks_section(section: Any, where: str) -> BlocksConfig:
    try:
        return BlocksConfig(**_dataclass_section(section, BlocksConfig, "blocks", where))
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None


def _slmoe_section(section: Any, where: str) -> SLMoEConfig:
    if section is None:
        return SLMoEConfig()
    _dataclass_section(section, SLMoEConfig, "slmoe", where)
    dispatcher = section.get("dispatcher", SLMoEConfig.dispatcher)
    if dispatcher not in DISPATCHERS:
        raise ConfigError(f"{where}: slmoe.dispatcher {dispatcher!r} is not one of "
                          f"{', '.join(sorted(DISPATCHERS))}")
    return SLMoEConfig(**section)


def load_model_config(path_or_name: str | os.PathLike) -> ModelConfig:
    """Read and validate a model file (a path, or the name of a packaged config such as
    ``tiny``). Every problem is one ConfigError line naming the file."""
    name, where, text = _resolve(path_or_name)
    data = _parse_yaml(text, where)
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a model config is a mapping with 'model' and 'slmoe' "
                          f"sections")
    for key in data:
        if key not in ("model", "slmoe", "blocks"):
            raise ConfigError(f"{where}: unknown key {key!r} (the sections are 'model', "
                              f"'slmoe' and 'blocks')")
    if "model" not in data:
        raise ConfigError(f"{where}: the 'model' section is missing")
    transformer, gpt = _model_section(data["model"], where)
    slmoe = _slmoe_section(data.get("slmoe"), where)
    blocks = _blocks_section(data.get("blocks"), where)
    try:
        validate_moe_config(transformer)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    return ModelConfig(name=name, source=where, transformer=types.MappingProxyType(transformer),
                       slmoe=slmoe, blocks=blocks, **gpt)


def dump_model_config(model_config: ModelConfig) -> str:
    """The model file of ``model_config``: YAML that :func:`load_model_config` reads back into the
    same configuration (how a converted checkpoint records the model it holds)."""
    model = {**dict(model_config.transformer), **model_config.gpt_kwargs()}
    for name, value in model.items():
        if isinstance(value, tuple):
            model[name] = list(value)
        elif not isinstance(value, (bool, int, float, str, list, type(None))):
            raise ConfigError(f"model.{name} = {value!r} has no YAML form")
    slmoe = {f.name: getattr(model_config.slmoe, f.name)
             for f in dataclasses.fields(SLMoEConfig)
             if getattr(model_config.slmoe, f.name) != f.default}
    blocks = {f.name: list(value) if isinstance(value, tuple) else value
              for f in dataclasses.fields(BlocksConfig)
              if (value := getattr(model_config.blocks, f.name)) != f.default}
    data = {"model": model, **({"slmoe": slmoe} if slmoe else {}),
            **({"blocks": blocks} if blocks else {})}
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100)
