"""Start-up checks of how a run's model is made, before any process group forms: the starting
adapter, the LoRA targets, a tower's DeepStack layers against the layout, and what the run will
export (its layout; a PEFT adapter of an ``--hf-checkpoint``). Each takes the opened model (``runtime.model.open_model``),
never opens it again; each problem is one ConfigError line naming the flag."""

from __future__ import annotations

from typing import Optional

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.hf import HFCheckpointError, HFModel
from megatron_slmoe.hf.export_layouts import export_layout
from megatron_slmoe.hf.peft_export import per_expert_export_problem
from megatron_slmoe.hf.peft_import import is_peft_adapter, read_peft_config
from megatron_slmoe.lora.checks import check_adapter_init as check_our_adapter
from megatron_slmoe.lora.config import LoRAConfig
from megatron_slmoe.lora.targets import LoRATargetError
from megatron_slmoe.model.config import ModelSection
from megatron_slmoe.model.model_file import ModelConfig
from megatron_slmoe.parallel.config import ParallelConfig
from megatron_slmoe.runtime.model import check_lora_targets
from megatron_slmoe.storage.urls import is_object_url


def check_peft_has_base(model: ModelSection) -> None:
    """A PEFT ``--adapter-init`` is converted against its HF base: it needs ``--hf-checkpoint``."""
    if model.adapter_init and not model.hf_checkpoint and is_peft_adapter(model.adapter_init):
        raise ConfigError(f"--adapter-init {model.adapter_init} is a PEFT adapter; it needs "
                          f"--hf-checkpoint (the HF base it was trained on)")


def check_adapter_init(model: ModelSection, lora: LoRAConfig, model_config: ModelConfig,
                       tokenizer) -> None:
    """The starting adapter: a PEFT one (converted at start-up) is plain LoRA; ours passes
    ``lora.checks.check_adapter_init``. A stored one is read when the run starts."""
    path = model.adapter_init
    if not path or is_object_url(path):
        return
    if model.hf_checkpoint and is_peft_adapter(path):
        try:
            read_peft_config(path)  # what it is (plain LoRA); its tensors when it is converted
        except HFCheckpointError as err:
            raise ConfigError(f"--adapter-init {path}: {err}") from None
        return
    check_our_adapter(path, lora, model_config, tokenizer)


def check_export_layout(layout: str, lora: LoRAConfig, export_hf: str) -> None:
    """The --export-hf layout must be one the trained expert layout gives (and this version
    writes)."""
    try:
        export_layout(layout, lora.expert_layout)
    except HFCheckpointError as err:
        raise ConfigError(f"--export-hf {export_hf}: {err}") from None


def check_peft_export(hf: Optional[HFModel], targets, export_hf: Optional[str]) -> None:
    """What the end of the run will export as a per-expert PEFT adapter of ``hf`` must be
    exportable: found now, not after training."""
    if hf is None or not export_hf:
        return
    problem = per_expert_export_problem(hf, targets)
    if problem:
        raise ConfigError(f"--export-hf {export_hf}: {problem}")


def check_deepstack(hf: Optional[HFModel], model_config: ModelConfig, parallel: ParallelConfig,
                    images: bool) -> None:
    """A tower whose DeepStack features go into the first decoder layers (Qwen3-VL): those
    layers on the first pipeline stage, where the tower is; and, with ``images``, no full
    recompute, which would recompute the layers without the features
    (``model.tower_language``)."""
    layers = hf.family.deepstack_layers(hf.family.hf_config(hf.checkpoint.config_path)) if (
        hf is not None and hf.multimodal) else 0
    if not layers:
        return
    if parallel.recompute_granularity == "full" and images:
        raise ConfigError(f"--recompute-granularity full: {hf.checkpoint.config_path}'s tower "
                          f"adds DeepStack features to the first {layers} decoder layers, which "
                          f"a full recompute would recompute without them; use selective")
    first_stage = model_config.transformer["num_layers"] // parallel.pipeline_model_parallel_size
    if first_stage < layers:
        raise ConfigError(f"--pipeline-model-parallel-size {parallel.pipeline_model_parallel_size}"
                          f": the first stage would hold {first_stage} decoder layers; "
                          f"{hf.checkpoint.config_path}'s tower adds DeepStack features to the "
                          f"first {layers}")


def check_targets_adapt(model_config: ModelConfig, lora: LoRAConfig, build) -> None:
    """Every --lora-target-modules name adapts something in the model ``build`` makes (found on
    the meta device now, not on every rank of every restart; see ``check_lora_targets``)."""
    try:
        check_lora_targets(model_config, lora, build)
    except LoRATargetError as err:
        raise ConfigError(f"--lora-target-modules {' '.join(lora.targets)}: {err}") from None
