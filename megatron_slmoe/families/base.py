"""A model family: how a Hugging Face ``config.json`` becomes our ModelConfig, and the mapping
table between the Megatron model built from it and the HF tensors.

Each family module (``qwen3_moe``, ``deepseek_v3``, ``nemotron_h``, ``slmoe``) defines one
:class:`Family`; ``megatron_slmoe.families`` registers them by the ``architectures`` names of
``config.json``. The rules shared by several families (GQA attention, dense and MoE MLPs, the
embedding and output layer) are functions here, so a family states only what is its own.
"""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Any, Callable, Mapping, Optional

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.families.errors import HFCheckpointError
from megatron_slmoe.families.kinds import (
    Direct,
    GroupedQKV,
    MappingTable,
    PerExpert,
    Rule,
    Stack,
)
from megatron_slmoe.families.layouts import Layouts
from megatron_slmoe.families.vision import ImageModel
# The one import of ModelConfig in hf/.
from megatron_slmoe.model.model_file import ModelConfig
from megatron_slmoe.model.validation import validate_moe_config

# HF activation names -> our model files' activation_func names.
HF_ACTIVATIONS = {"silu": "silu", "relu2": "squared_relu"}


class ConfigReader:
    """Typed reads of config.json; a missing or mistyped field is one error line naming it."""

    def __init__(self, config: dict, path: str) -> None:
        self.config, self.path = config, path

    def fail(self, message: str) -> HFCheckpointError:
        return HFCheckpointError(f"{self.path}: {message}")

    # Names one field has had in config.json files (transformers 5 writes some anew).
    ALIASES = {"num_experts": ("num_local_experts",), "n_routed_experts": ("num_local_experts",)}

    def get(self, name: str, default: Any = None) -> Any:
        for key in (name, *self.ALIASES.get(name, ())):
            if self.config.get(key) is not None:
                return self.config[key]
        return default

    def int(self, name: str, default: Optional[int] = None, minimum: int = 1) -> int:
        value = self.get(name, default)
        if value is None:
            raise self.fail(f"{name} is missing")
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.fail(f"{name} must be an integer >= {minimum}, got {value!r}")
        return value

    def number(self, name: str, default: Optional[float] = None) -> float:
        value = self.get(name, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self.fail(f"{name} must be a number, got {value!r}")
        return float(value)

    def bool(self, name: str, default: Optional[bool] = None) -> bool:
        value = self.get(name, default)
        if not isinstance(value, bool):
            raise self.fail(f"{name} must be true or false, got {value!r}")
        return value

    def activation(self, name: str, default: str) -> str:
        value = self.get(name, default)
        if value not in HF_ACTIVATIONS:
            raise self.fail(f"{name} {value!r} is not supported (supported: "
                            f"{', '.join(HF_ACTIVATIONS)})")
        return HF_ACTIVATIONS[value]

    def require(self, condition: bool, message: str) -> None:
        if not condition:
            raise self.fail(message)

    def gpt_fields(self, rotary_base: Optional[float]) -> dict:
        """The GPTModel arguments every family reads alike (``rotary_base`` None: no rotary
        position embedding)."""
        return dict(vocab_size=self.int("vocab_size"),
                    max_sequence_length=self.int("max_position_embeddings"),
                    position_embedding_type="none" if rotary_base is None else "rope",
                    **({} if rotary_base is None else {"rotary_base": int(rotary_base)}),
                    share_embeddings_and_output_weights=self.bool("tie_word_embeddings", False))

    def rope(self) -> dict:
        """The rotary settings, from transformers 5's ``rope_parameters`` or the older
        ``rope_theta`` / ``rope_scaling`` fields."""
        rope = dict(self.get("rope_scaling", {}) or {})
        rope.update(self.get("rope_parameters", {}) or {})
        rope.setdefault("rope_theta", self.get("rope_theta", 10000.0))
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        return rope


class Family:
    """What is true of one checkpoint family, every capability declared here with the default
    of a text model: a family module (``families/<name>/``) fills in its names, its config
    reading and its table, and overrides what it has. Generic code asks these; it never
    probes a family or names one."""

    name: str = ""
    architectures: tuple[str, ...] = ()
    layouts: Layouts = Layouts()
    multimodal: bool = False
    """Whether the checkpoint holds a vision tower and projector beside the language model
    (then the family is a :class:`MultimodalFamily`)."""
    image_token: str = ""
    """A multimodal family's placeholder token: one per image token in the ids."""
    image_text: str = ""
    """How a multimodal family writes one image in a conversation (``image_token`` once, which
    is then repeated to the image's tokens)."""
    video_token: str = ""
    """A family that takes videos: its video placeholder token (config.json's
    ``video_token_id``), one per video token in the ids; empty: no video input. A family whose
    videos share the image placeholder (``image_token``) writes them as media items of the image
    stream (its ``video_patches`` object ``shares_image_placeholder``)."""
    video_settings: str = "video_preprocessor_config.json"
    """The checkpoint's file that holds the video processor's settings."""
    merged_experts_fused: bool = False
    """Merged checkpoints hold the routed experts as transformers 5 does in memory (fused 3D
    tensors), where transformers reads no other layout but the published one; else one tensor
    per expert, as ``save_pretrained`` writes by default."""

    def transformer_fields(self, c: ConfigReader) -> tuple[dict, dict]:
        """(TransformerConfig fields, GPTModel fields) of the model ``config.json`` describes."""
        raise NotImplementedError

    def table(self, model_config: ModelConfig) -> MappingTable:
        """The mapping table of a model built from ``model_config``."""
        raise NotImplementedError

    def config_class(self):
        """transformers' config class of the family."""
        raise NotImplementedError

    def hf_model_class(self):
        """transformers' auto class that builds the family's model from its config."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM

    def hf_meta_model(self, config_path: str, tensors: Mapping):
        """The model as transformers holds it in memory, on the meta device: the exports read
        its weight names, shapes and module types from it. ``tensors``: the checkpoint's
        catalogue (key -> info with ``shape``), for a family that has no transformers class and
        describes its model by its checkpoint (:func:`stored_layout_model`)."""
        import torch

        with torch.device("meta"):
            return self.hf_model_class().from_config(self.hf_config(config_path))

    def peft_model_type(self, config_path: str) -> Optional[str]:
        """The model type PEFT knows the family's model by (it keys its conversions of
        per-expert adapters by it); None: a model PEFT has no entry for."""
        return self.hf_config(config_path).model_type

    def vision_module(self, hf_config, device: str = "cpu") -> Optional[ImageModel]:
        """The vision module a multimodal family reads by its own names (None: a language
        model), built on ``device``."""
        return None

    def deepstack_layers(self, hf_config) -> int:
        """How many of the first decoder layers take DeepStack features from the tower."""
        return 0

    def has_vision(self, config: dict) -> bool:
        """Whether a checkpoint of the family (its ``config.json``) holds a vision side: a
        multimodal family's do, unless the family also ships text-only checkpoints."""
        return self.multimodal

    def check_tensors(self, model_config: ModelConfig, tensors: Mapping, read: Callable) -> bool:
        """The family's own checks of a checkpoint's stored tensors (``tensors``: key -> info
        with ``shape``; ``read(key)``: a whole tensor), one HFCheckpointError line each. True:
        they stand in for holding every tensor to transformers' model of the family (a family
        transformers has no class for); False: the loader does that too."""
        return False

    def image_patches(self, processor_path: str):
        """How images become the tower's patches, from the checkpoint's
        ``preprocessor_config.json`` (a ``data.native_resolution`` patch config, or an object
        with its ``patches(image)``, ``tokens_per_merge`` and ``empty()``; see
        ``data.image_inputs`` for the optional ``image_text(width, height)`` and
        ``decodes_transparency``); None: the family takes no images."""
        return None

    def video_patches(self, processor_path: str):
        """How clips become the tower's patches and their text, from the checkpoint's
        ``video_settings`` file: an object with ``patches(clip)`` ->
        (pixel_values_videos, grid, timestamps), ``text(grid, timestamps)`` (how the prompt
        writes the clip, ``video_token`` once per merged patch), ``tokens_per_merge`` and
        ``empty()``; or, where it ``shares_image_placeholder``, ``patches(clip)`` ->
        (pixel_values, the grids of the clip's media items, their start times) and
        ``text(start times)`` (the placeholder once per item); None: the family takes no
        videos."""
        return None

    def rope_positions(self, hf_config) -> Optional[Callable]:
        """positions(input_ids, image_grid_thw[, video_grid_thw]) -> the language model's
        rotary positions of a batch, computed on every pipeline stage; None: the plain text
        positions."""
        return None

    def mrope_section(self, hf_config) -> Optional[list]:
        """The interleaved M-RoPE's sections (temporal, height, width frequencies) that replace
        the language model's 1D rotary embedding; None: it keeps the 1D one."""
        return None

    def hf_config(self, path: str):
        """The transformers config of ``config.json`` (for the shape check on the meta device),
        without its quantization settings: the weights are dequantised on read."""
        config = self.config_class().from_json_file(path)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        return config

    def model_config(self, config: dict, path: str) -> ModelConfig:
        reader = ConfigReader(config, path)
        transformer, gpt = self.transformer_fields(reader)
        try:
            validate_moe_config(transformer)
        except ConfigError as err:
            raise reader.fail(f"gives an invalid MoE model: {err}") from None
        name = os.path.basename(os.path.dirname(os.path.abspath(path))) or self.name
        return ModelConfig(name=name, source=path, transformer=types.MappingProxyType(transformer),
                           **gpt)


class MultimodalFamily(Family):
    """A family whose checkpoints hold a vision tower and projector (an ``ImageModel``) in front
    of the language model: it names its placeholder token and image text and gives its vision
    module and image patches."""

    multimodal = True
    tied_by_default: bool = False
    """Whether the output layer is the embedding when the top-level ``tie_word_embeddings`` is
    absent (transformers ties by the top-level config, not the text config's)."""

    def model_config(self, config: dict, path: str) -> ModelConfig:
        """The language model's, read from ``text_config``; tied by the top-level config."""
        top = ConfigReader(config, path)
        text = top.get("text_config")
        top.require(isinstance(text, dict), f"text_config is missing (a {self.name} config "
                                            f"holds its language model's settings there)")
        top.require(isinstance(top.get("vision_config"), dict), "vision_config is missing")
        language = super().model_config(text, f"{path} text_config")
        return dataclasses.replace(language, source=path,
                                   share_embeddings_and_output_weights=top.bool(
                                       "tie_word_embeddings", self.tied_by_default))

    def vision_module(self, hf_config, device: str = "cpu") -> ImageModel:
        raise NotImplementedError

    def image_patches(self, processor_path: str):
        raise NotImplementedError


def stored_layout_model(tensors: Mapping):
    """A module tree of a checkpoint's own tensors on the meta device, for a family without a
    transformers class: ``a.b.weight`` becomes module ``a.b``'s parameter, a module whose only
    tensor is a 2-D ``weight`` is a bias-free ``torch.nn.Linear`` (what PEFT adapts), a packed
    weight appears once under its logical name and shape (``info.packed`` / ``info.scale``: the
    stored pair it stands for)."""
    import torch

    stored_pairs = {key for info in tensors.values()
                    for key in (getattr(info, "packed", None), getattr(info, "scale", None)) if key}
    by_module: dict[str, dict[str, tuple]] = {}
    for key, info in tensors.items():
        if key not in stored_pairs:
            module, _, name = key.rpartition(".")
            by_module.setdefault(module, {})[name] = tuple(info.shape)
    root = torch.nn.Module()

    def module_at(path: str) -> torch.nn.Module:
        node = root
        for part in path.split(".") if path else ():
            if part not in node._modules:
                node.add_module(part, torch.nn.Module())
            node = node._modules[part]
        return node

    for path in sorted(by_module, key=lambda p: p.count(".")):
        params = by_module[path]
        if path and set(params) == {"weight"} and len(params["weight"]) == 2:
            parent, _, leaf = path.rpartition(".")
            out_features, in_features = params["weight"]
            module_at(parent).add_module(leaf, torch.nn.Linear(in_features, out_features,
                                                               bias=False, device="meta"))
            continue
        node = module_at(path)
        for name, shape in params.items():
            node.register_parameter(name, torch.nn.Parameter(torch.empty(shape, device="meta"),
                                                             requires_grad=False))
    return root


# --- rules shared by the families --------------------------------------------------------------


def embedding_rules(embed: str, head: str, final_norm: str, tied: bool) -> list[Rule]:
    rules = [Rule("embedding.word_embeddings.weight", Direct(embed)),
             Rule("decoder.final_layernorm.weight", Direct(final_norm))]
    # Tied: the last pipeline stage still holds an output weight, a copy of the embedding.
    rules.append(Rule("output_layer.weight", Direct(embed if tied else head)))
    return rules


def layernorm_rules(input_norm: str, pre_mlp_norm: str) -> list[Rule]:
    """A layer's two norms. Megatron's sharded state dict names them as TE fuses them where the
    layer has a fused neighbour (``linear_qkv.layer_norm_weight``, dense
    ``linear_fc1.layer_norm_weight``; TE and local checkpoints share the names) and by module
    otherwise (MLA, MoE layers)."""
    meg = "decoder.layers.{layer}"
    return [Rule(f"{meg}.input_layernorm.weight", Direct(input_norm)),
            Rule(f"{meg}.self_attention.linear_qkv.layer_norm_weight", Direct(input_norm)),
            Rule(f"{meg}.pre_mlp_layernorm.weight", Direct(pre_mlp_norm)),
            Rule(f"{meg}.mlp.linear_fc1.layer_norm_weight", Direct(pre_mlp_norm))]


def gqa_attention_rules(attn: str, heads: int, groups: int, head_dim: int,
                        qk_norm: Optional[tuple[str, str]]) -> list[Rule]:
    """Megatron's self attention (linear_qkv, linear_proj, optional q/k layernorm) from HF's
    q/k/v/o projections under the prefix ``attn`` (a template)."""
    meg = "decoder.layers.{layer}.self_attention"
    rules = [
        Rule(f"{meg}.linear_qkv.weight", GroupedQKV(f"{attn}.q_proj.weight", f"{attn}.k_proj.weight",
                                                    f"{attn}.v_proj.weight", heads, groups, head_dim)),
        Rule(f"{meg}.linear_proj.weight", Direct(f"{attn}.o_proj.weight")),
    ]
    if qk_norm:
        rules += [Rule(f"{meg}.q_layernorm.weight", Direct(f"{attn}.{qk_norm[0]}.weight")),
                  Rule(f"{meg}.k_layernorm.weight", Direct(f"{attn}.{qk_norm[1]}.weight"))]
    return rules


def mlp_rules(meg: str, hf: str, gated: bool) -> list[Rule]:
    """A Megatron MLP (``linear_fc1``, ``linear_fc2``) from HF's gate/up/down projections."""
    fc1 = Stack(f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight") if gated else \
        Direct(f"{hf}.up_proj.weight")
    return [Rule(f"{meg}.linear_fc1.weight", fc1),
            Rule(f"{meg}.linear_fc2.weight", Direct(f"{hf}.down_proj.weight"))]


def expert_rules(meg: str, experts: str, gated: bool) -> list[Rule]:
    """Our stacked experts (``fc1_weight`` ``[E, 2F or F, d]``, ``fc2_weight``) from HF's
    per-expert projections ``{experts}.{expert}.gate_proj.weight`` ..."""
    each = experts + ".{expert}"
    fc1 = Stack(f"{each}.gate_proj.weight", f"{each}.up_proj.weight") if gated else \
        Direct(f"{each}.up_proj.weight")
    return [Rule(f"{meg}.experts.fc1_weight", PerExpert(fc1)),
            Rule(f"{meg}.experts.fc2_weight", PerExpert(Direct(f"{each}.down_proj.weight")))]


def layer_freq(moe_layers: list[bool]) -> list[int]:
    return [1 if moe else 0 for moe in moe_layers]
