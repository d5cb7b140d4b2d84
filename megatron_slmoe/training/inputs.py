"""A run prepared before any process group forms: its inputs opened once on this rank and checked,
by the launcher (``--validate-only``, before torchrun) and by every run at start-up. The engine
receives the result (``PreparedRun``) and opens nothing again. Each problem is one ConfigError
line naming the flag and the file (or the URL).

Each check lives beside what it checks; this module only orders them and hands each its own
section:

- the places a run reads and writes, local and on object storage: ``storage.checks``;
- the data, the tokenizer, the sequence length: ``data.checks``;
- the base checkpoint and the need for one: ``runtime.bases``;
- the starting adapter: ``lora.checks`` (ours), ``runtime.checks`` (PEFT's);
- the LoRA targets, a tower's DeepStack layers, the PEFT export: ``runtime.checks``;
- the run already in ``--output-dir`` (resumed only unchanged): ``training.resume``;
- device memory and checkpoint space: ``plan.run_checks``, on the run as the planner sees it
  (``run_settings`` here).

The contents of stored checkpoints and adapters are not inspected here (that would mean
downloading them first); a stored instruction file is (into the node cache, where the run reads
it), and so are a stored image-text dataset's metadata and each split's first usable sample.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Optional

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.data.checks import (
    check_image_text,
    check_local_image_text,
    check_model_fits_data,
    check_text_data,
    open_tokenizer,
)
from megatron_slmoe.data.errors import DataError
from megatron_slmoe.data.tokenizer import Tokenizer
from megatron_slmoe.hf import HFModel
from megatron_slmoe.hf.tower_model import vision_census
from megatron_slmoe.model.model_file import ModelConfig
from megatron_slmoe.plan.check import LayoutCheck, check_layout
from megatron_slmoe.plan.run_checks import apply_memory_verdict, check_checkpoint_space
from megatron_slmoe.plan.settings import RunSettings
from megatron_slmoe.plan.vision import ReplicatedTower, VisionShape
from megatron_slmoe.runtime.bases import check_base_checkpoint, check_base_given
from megatron_slmoe.runtime.checks import (
    check_adapter_init,
    check_deepstack,
    check_export_layout,
    check_peft_export,
    check_peft_has_base,
    check_targets_adapt,
)
from megatron_slmoe.runtime.model import model_builder, open_model, resolve_precision
from megatron_slmoe.storage import Storage
from megatron_slmoe.storage.checks import (
    check_local_files_exist,
    check_local_inputs_exist,
    check_store_access,
    check_writable_dir,
    object_inputs,
)
from megatron_slmoe.training.config import RunConfig
from megatron_slmoe.training.resume import check_resume
from megatron_slmoe.training.tasks import build_task
from megatron_slmoe.training.tasks.image_text import image_input


@dataclass(frozen=True)
class PreparedRun:
    """A run ready to start: its settings and its inputs, each opened once on this rank."""

    run: RunConfig
    model_config: ModelConfig
    """The model file's, or the one the --hf-checkpoint's config.json describes."""
    hf: Optional[HFModel]
    """The opened --hf-checkpoint (None without one)."""
    tokenizer: Tokenizer
    """The run's tokenizer (the flag's, else the base's, else the shipped one)."""


def open_run(run: RunConfig, check_shapes: bool = False) -> PreparedRun:
    """The run's model and tokenizer, opened (what opening checks, and the tokenizer against the
    model's vocabulary): the start of ``prepare_run``, and all an engine given an unprepared run
    (tests, tools) opens."""
    model_config, hf = open_model(run.model, check_shapes=check_shapes)
    tokenizer = open_tokenizer(run.data, Storage(run.storage), model_config.vocab_size,
                               run.model.hf_checkpoint, run.model.base_checkpoint)
    return PreparedRun(run, model_config, hf, tokenizer)


def prepare_run(run: RunConfig, world_size: int, platform) -> PreparedRun:
    """Every check of the run, in this order: a run with a specific problem hears of that one
    first, and each input is opened once."""
    _check_paths(run)
    model, data = run.model, run.data
    check_store_access(run.storage, object_inputs(
        directories=(("--base-checkpoint", model.base_checkpoint),
                     ("--adapter-init", model.adapter_init)),
        files=(("--tokenizer", data.tokenizer),),
        datasets=(("--train-data", data.train_data), ("--valid-data", data.valid_data)),
        indexed=data.format == "pretrain"), run.output.output_url)
    # With --hf-checkpoint: config.json, the index and every shard's header, and (unless
    # --no-hf-shape-check) every tensor's shape against config.json.
    model_config, hf = open_model(model, check_shapes=model.hf_shape_check)
    if run.output.export_hf_layout == "per-expert":
        check_peft_export(hf, run.lora.targets, run.output.export_hf)
    check_model_fits_data(data, model_config)
    check_deepstack(hf, model_config, run.parallel, images=data.task == "image-text")
    if model.finetune_mode == "lora":
        check_targets_adapt(model_config, run.lora,
                            model_builder(build_task(run, hf).build_model, hf))
    storage = Storage(run.storage)
    tokenizer = open_tokenizer(data, storage, model_config.vocab_size, model.hf_checkpoint,
                               model.base_checkpoint)
    check_base_checkpoint(model.base_checkpoint, model_config, tokenizer)
    check_adapter_init(model, run.lora, model_config, tokenizer)
    if data.task == "image-text":
        try:
            images = image_input(run.vision, run.image_text, hf, tokenizer)
        except DataError as err:
            raise ConfigError(f"--task image-text: {err}") from None
        check_image_text(data, run.image_text.caption_prompt, storage, tokenizer, images)
    else:
        check_text_data(data, storage)
    check_resume(run, platform)
    check_checkpoint_space(run.output.output_dir, model_config,
                           run_settings(run, 1, resolve_precision(model, platform)),
                           full=model.finetune_mode == "full", keep_last=run.output.keep_last,
                           save_base=bool(run.output.save_base))
    if run.parallel.memory_check != "off":
        apply_memory_verdict(memory_check(run, world_size, platform, model_config, hf),
                             run.parallel.memory_check)
    check_base_given(model)  # last: a run with a specific problem hears of that one first
    return PreparedRun(run, model_config, hf, tokenizer)


def _check_paths(run: RunConfig) -> None:
    """What the run names exists where it is local, and what it writes can be written."""
    output = run.output
    for flag, path in (("--output-dir", output.output_dir), ("--save-base", output.save_base),
                       ("--export-hf", output.export_hf)):
        check_writable_dir(flag, path)
    model, data = run.model, run.data
    check_local_inputs_exist((("--base-checkpoint", model.base_checkpoint),
                              ("--adapter-init", model.adapter_init),
                              ("--tokenizer", data.tokenizer)))
    if model.hf_checkpoint and not os.path.isdir(model.hf_checkpoint):
        raise ConfigError(f"--hf-checkpoint {model.hf_checkpoint}: no such directory")
    export = run.output.export_hf
    if export and os.path.lexists(export) and (not os.path.isdir(export) or os.listdir(export)):
        raise ConfigError(f"--export-hf {export} exists and is not an empty directory (the "
                          f"adapter is written there at the end of the run)")
    if export:
        check_export_layout(output.export_hf_layout, run.lora, export)
    check_peft_has_base(model)
    if data.task == "image-text":
        check_local_image_text(data, run.vision)
    elif data.format == "instruction":
        check_local_files_exist((("--train-data", data.train_data),
                                 ("--valid-data", data.valid_data)))


# -- the run as the memory planner sees it ---------------------------------------------------------


def hf_tower(run: RunConfig, hf) -> Optional[ReplicatedTower]:
    """The opened --hf-checkpoint's own vision module as the memory planner prices it, or None
    when it has none. The planner prices LoRA runs: a full fine-tune's trained tower
    (--train-vision-tower) is priced as a frozen one."""
    targets = run.lora.targets if run.model.finetune_mode == "lora" else ()
    census = vision_census(hf, targets, run.lora.rank)
    if census is None:
        return None
    return ReplicatedTower(**asdict(census), attention_adapted="vision_attention" in targets,
                           projector_adapted="projector" in targets,
                           images=run.data.task == "image-text")


def memory_check(run: RunConfig, world_size: int, platform, model_config,
                 hf=None) -> Optional[LayoutCheck]:
    """The memory planner's verdict on this run's layout, or None when there is no device memory
    to plan against (CPU without --device-memory-gb); ``hf``: the opened --hf-checkpoint, whose
    own vision module is priced too."""
    memory = (run.parallel.device_memory_gb * 2**30 if run.parallel.device_memory_gb
              else platform.device_memory_bytes())
    if memory is None:
        return None
    settings = run_settings(
        run, world_size, resolve_precision(run.model, platform),
        devices_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
        hf_tower=hf_tower(run, hf))
    return check_layout(model_config, settings, int(memory))


def run_settings(run: RunConfig, world_size: int, dtype: str,
                 devices_per_node: Optional[int] = None,
                 hf_tower: Optional[ReplicatedTower] = None) -> RunSettings:
    """The planner's settings of this fine-tuning run; ``hf_tower``: the --hf-checkpoint's own
    vision module, when it has one."""
    parallel = run.parallel
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    granularity = parallel.recompute_granularity or "none"
    modules = tuple(parallel.recompute_modules or ("core_attn",))
    return RunSettings(
        tp=tp, pp=pp, ep=parallel.expert_model_parallel_size, dp=world_size // (tp * pp),
        distributed_optimizer=parallel.use_distributed_optimizer, recompute=granularity,
        recompute_modules=modules if granularity == "selective" else ("core_attn",),
        micro_batch_size=run.schedule.micro_batch_size, seq_length=run.data.seq_length,
        global_batch_size=run.schedule.global_batch_size, dtype=dtype,
        lora_rank=run.lora.rank, lora_targets=tuple(run.lora.targets),
        expert_lora_rank=run.lora.expert_rank, moe_rank_scaling=run.lora.moe_rank_scaling,
        expert_lora_layout=run.lora.expert_layout,
        hierarchical_alltoall=run.moe.hierarchical_alltoall,
        devices_per_node=devices_per_node or world_size,
        vision=hf_tower if run.model.hf_checkpoint else (
            VisionShape.from_config(run.vision, run.image_text)
            if run.data.task == "image-text" else None))
