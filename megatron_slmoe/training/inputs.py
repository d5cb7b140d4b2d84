"""Checks of a run made before any process group forms: by the launcher (``--validate-only``,
before torchrun) and by every run at start-up. Each problem is one ConfigError line naming the
flag and the file."""

from __future__ import annotations

import logging
import os

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.config.run import RunConfig

log = logging.getLogger(__name__)


def check_inputs(run: RunConfig, world_size: int, platform) -> None:
    from megatron_slmoe.training.model_setup import open_model

    _check_paths(run)
    _check_base_model(run)
    # With --hf-checkpoint: config.json, the index and every shard's header, and (unless
    # --no-hf-shape-check) every tensor's shape against config.json.
    model_config, _ = open_model(run.model, check_shapes=run.model.hf_shape_check)
    _check_data(run, model_config)
    _check_memory(run, world_size, platform, model_config)


def tokenizer_path(run: RunConfig) -> str:
    """The run's tokenizer: --tokenizer, else the --hf-checkpoint directory's, else the shipped
    one."""
    from megatron_slmoe.data.assets import asset_path

    return run.data.tokenizer or run.model.hf_checkpoint or asset_path("tokenizer.json")


def _check_paths(run: RunConfig) -> None:
    model, data = run.model, run.data
    for flag, path in (("--base-checkpoint", model.base_checkpoint),
                       ("--adapter-init", model.adapter_init), ("--tokenizer", data.tokenizer)):
        if path and not os.path.exists(path):
            raise ConfigError(f"{flag} {path}: no such file or directory")
    if model.hf_checkpoint and not os.path.isdir(model.hf_checkpoint):
        raise ConfigError(f"--hf-checkpoint {model.hf_checkpoint}: no such directory")
    export = run.output.export_hf
    if export and os.path.lexists(export) and (not os.path.isdir(export) or os.listdir(export)):
        raise ConfigError(f"--export-hf {export} exists and is not an empty directory (the "
                          f"adapter is written there at the end of the run)")
    if model.adapter_init and not model.hf_checkpoint:
        from megatron_slmoe.hf.peft_import import is_peft_adapter

        if is_peft_adapter(model.adapter_init):
            raise ConfigError(f"--adapter-init {model.adapter_init} is a PEFT adapter; it needs "
                              f"--hf-checkpoint (the HF base it was trained on)")
    if data.format == "instruction":
        for flag, path in (("--train-data", data.train_data), ("--valid-data", data.valid_data)):
            if path and not os.path.isfile(path):
                raise ConfigError(f"{flag} {path}: no such file")


def _check_base_model(run: RunConfig) -> None:
    """LoRA adapts a trained model: on random weights it trains adapters for nothing."""
    model = run.model
    if model.finetune_mode == "lora" and not (model.base_checkpoint or model.hf_checkpoint):
        raise ConfigError(
            "LoRA needs a trained base model: name one with --base-checkpoint DIR (a Megatron dist "
            "checkpoint, e.g. from --finetune-mode full --save-base DIR) or --hf-checkpoint DIR, run "
            "`bash scripts/pretrain_lora.sh` with no flags for the demo (it pretrains a tiny base "
            "first), or train every weight from scratch with --finetune-mode full")


def _check_data(run: RunConfig, model_config) -> None:
    """The tokenizer and the sequence length against the model."""
    from megatron_slmoe.data.errors import DataError
    from megatron_slmoe.data.tokenizer import load_tokenizer

    data = run.data
    if data.format == "instruction" and model_config.transformer.get("masked_softmax_fusion"):
        # Megatron's fused causal softmax (GPU, 16-bit) takes no mask: packed examples would see
        # each other again.
        raise ConfigError(f"{model_config.source}: masked_softmax_fusion: true would drop the "
                          f"attention mask that keeps packed instruction examples apart; set it "
                          f"to false")
    if data.seq_length > model_config.max_sequence_length:
        raise ConfigError(f"--seq-length {data.seq_length} exceeds the model's "
                          f"max_sequence_length {model_config.max_sequence_length} "
                          f"({model_config.source})")
    try:
        tokenizer = load_tokenizer(tokenizer_path(run))
    except DataError as err:
        flag = "--tokenizer" if data.tokenizer or not run.model.hf_checkpoint else \
            "--hf-checkpoint (its tokenizer; or pass --tokenizer)"
        raise ConfigError(f"{flag}: {err}") from None
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ConfigError(f"--tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens, more "
                          f"than the model's vocab_size {model_config.vocab_size}")


def memory_check(run: RunConfig, world_size: int, platform, model_config):
    """The memory planner's verdict on this run's layout (a ``plan.check.LayoutCheck``), or None
    when there is no device memory to plan against (CPU without --device-memory-gb)."""
    from megatron_slmoe.plan.check import check_layout
    from megatron_slmoe.plan.settings import RunSettings
    from megatron_slmoe.training.model_setup import resolve_precision

    memory = (run.parallel.device_memory_gb * 2**30 if run.parallel.device_memory_gb
              else platform.device_memory_bytes())
    if memory is None:
        return None
    settings = RunSettings.from_run_config(
        run, world_size, resolve_precision(run.model, platform),
        devices_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    return check_layout(model_config, settings, int(memory))


def _check_memory(run: RunConfig, world_size: int, platform, model_config) -> None:
    if run.parallel.memory_check == "off":
        return
    check = memory_check(run, world_size, platform, model_config)
    if check is None or check.fits:
        return
    if run.parallel.memory_check == "refuse":
        raise ConfigError(f"{check.message} (run anyway: --memory-check warn)")
    log.warning("memory check: %s", check.message)
