"""Checks of a run made before any process group forms: by the launcher (``--validate-only``,
before torchrun) and by every run at start-up. Each problem is one ConfigError line naming the
flag and the file (or the URL).

Settings may name local paths or ``s3://`` / ``msc://`` URLs: local paths must exist; URLs are
checked against the store (readable inputs, a writable ``--output-url``) once per node, by its
local rank 0, so that a wrong credential, a missing bucket or key, or an unreachable endpoint
stops the run here instead of in the middle of start-up."""

from __future__ import annotations

import logging
import os

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.config.run import RunConfig

log = logging.getLogger(__name__)


def check_inputs(run: RunConfig, world_size: int, platform) -> None:
    from megatron_slmoe.training.model_setup import open_model

    _check_paths(run)
    _check_object_storage(run)
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
    from megatron_slmoe.storage.urls import is_object_url

    model, data = run.model, run.data
    for flag, path in (("--base-checkpoint", model.base_checkpoint),
                       ("--adapter-init", model.adapter_init), ("--tokenizer", data.tokenizer)):
        if path and not is_object_url(path) and not os.path.exists(path):
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
    if data.task == "image-text":
        _check_image_text_paths(run)
    elif data.format == "instruction":
        for flag, path in (("--train-data", data.train_data), ("--valid-data", data.valid_data)):
            if path and not is_object_url(path) and not os.path.isfile(path):
                raise ConfigError(f"{flag} {path}: no such file")


def object_inputs(run: RunConfig) -> list[tuple[str, str]]:
    """(flag, URL) of every object or prefix the run reads from object storage."""
    from megatron_slmoe.storage.session import indexed_dataset_files
    from megatron_slmoe.storage.urls import is_object_url, parse_url

    model, data = run.model, run.data
    found = [(flag, str(parse_url(url).as_prefix())) for flag, url in (
        ("--base-checkpoint", model.base_checkpoint), ("--adapter-init", model.adapter_init))
        if is_object_url(url)]  # directories: every object under the prefix
    if is_object_url(data.tokenizer):
        found.append(("--tokenizer", data.tokenizer))
    for flag, url in (("--train-data", data.train_data), ("--valid-data", data.valid_data)):
        if not is_object_url(url):
            continue
        if data.format == "pretrain" and not url.endswith("/"):  # a dataset prefix: two objects
            found += [(flag, name) for name in indexed_dataset_files(url)]
        else:
            found.append((flag, url))
    return found


def _check_object_storage(run: RunConfig) -> None:
    """Every URL of the run usable (see the module doc); the other ranks of a node rely on its
    local rank 0, whose failure stops the job before the process group has formed."""
    from megatron_slmoe.storage.errors import StorageError
    from megatron_slmoe.storage.preflight import check_readable, check_writable, preflight_store
    from megatron_slmoe.storage.urls import parse_url

    inputs = object_inputs(run)
    if not (inputs or run.output.output_url) or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return
    store = preflight_store(run.storage)
    checks = [(flag, url, check_readable) for flag, url in inputs]
    if run.output.output_url:
        checks.append(("--output-url", run.output.output_url, check_writable))
    for flag, url, check in checks:
        try:
            check(store, parse_url(url))
        except StorageError as err:
            raise ConfigError(f"{flag}: {err}") from None


def _check_image_text_paths(run: RunConfig) -> None:
    data, vision = run.data, run.vision
    for flag, path in (("--train-data", data.train_data), ("--valid-data", data.valid_data)):
        if path and not os.path.isdir(os.path.join(path, ".nv-meta")):
            raise ConfigError(f"{flag} {path}: not an energon dataset folder (prepare one with "
                              f"tools/prepare_image_text.py)")
    if vision.checkpoint:
        from megatron_slmoe.model.hf_vision import HFImportError, check_hf_vision_checkpoint

        try:
            check_hf_vision_checkpoint(vision.checkpoint, vision)
        except HFImportError as err:
            raise ConfigError(f"--vision-checkpoint {vision.checkpoint}: {err}") from None


def _check_data(run: RunConfig, model_config) -> None:
    """The tokenizer (through the node cache if it is an object) and the sequence length against
    the model."""
    from megatron_slmoe.data.errors import DataError
    from megatron_slmoe.data.tokenizer import load_tokenizer
    from megatron_slmoe.storage import Storage, StorageError

    data = run.data
    if data.seq_length > model_config.max_sequence_length:
        raise ConfigError(f"--seq-length {data.seq_length} exceeds the model's "
                          f"max_sequence_length {model_config.max_sequence_length} "
                          f"({model_config.source})")
    try:
        tokenizer = load_tokenizer(Storage(run.storage).local_file(tokenizer_path(run)))
    except (DataError, StorageError) as err:
        flag = "--tokenizer" if data.tokenizer or not run.model.hf_checkpoint else \
            "--hf-checkpoint (its tokenizer; or pass --tokenizer)"
        raise ConfigError(f"{flag}: {err}") from None
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ConfigError(f"--tokenizer {data.tokenizer or tokenizer.path} has "
                          f"{tokenizer.vocab_size} tokens, more than the model's vocab_size "
                          f"{model_config.vocab_size}")


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
