"""Checks of a run made before any process group forms: by the launcher (``--validate-only``,
before torchrun) and by every run at start-up. Each problem is one ConfigError line naming the
flag and the file (or the URL).

What is checked: the files the run names exist; the model config (or the --hf-checkpoint); the
tokenizer against the model's vocabulary, the base checkpoint's and the starting adapter's
tokenizer; the sequence length against the model; the base checkpoint (present, complete: its manifest's sizes, its model
config); the starting adapter (readable, same LoRA rank/alpha/targets, same base model); the data
files (not empty, not mostly malformed); the output directory (a run there is resumed only with
the settings it was started with; a finished one is reported, not redone); the memory planner's
verdict on the layout.

Settings may name local paths or ``s3://`` / ``msc://`` URLs: local paths must exist; URLs are
checked against the store (readable inputs, a writable ``--output-url``) once per node, by its
local rank 0, so that a wrong credential, a missing bucket or key, or an unreachable endpoint
stops the run here instead of in the middle of start-up. The contents of stored checkpoints,
adapters and data files are not inspected here (that would mean downloading them first), except
a stored image-text dataset's metadata and each split's first usable sample (into the node cache,
where the run reads them).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Optional

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.training.config import RunConfig, RunFinished
from megatron_slmoe.storage.urls import is_object_url

log = logging.getLogger(__name__)


def check_inputs(run: RunConfig, world_size: int, platform) -> None:
    from megatron_slmoe.runtime.model import open_model

    _check_paths(run)
    _check_object_storage(run)
    # With --hf-checkpoint: config.json, the index and every shard's header, and (unless
    # --no-hf-shape-check) every tensor's shape against config.json.
    model_config, hf = open_model(run.model, check_shapes=run.model.hf_shape_check)
    _check_model_fits_run(run, model_config)
    _check_deepstack(run, model_config, hf)
    tokenizer = _check_tokenizer(run, model_config)
    _check_base_checkpoint(run, model_config, tokenizer)
    _check_adapter_init(run, model_config, tokenizer)
    _check_data(run, tokenizer, hf)
    _check_output_dir(run, platform)
    _check_output_space(run, model_config, platform)
    _check_memory(run, world_size, platform, model_config, hf)
    _check_base_model(run)  # last: a run with a specific problem hears of that one first


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_writable_dir(flag: str, path: Optional[str]) -> None:
    """A directory a run will make or write into: not a file, under a writable directory."""
    if not path or is_object_url(path):
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a file, not a directory")
    existing = _nearest_existing(path)
    if not os.path.isdir(existing):
        raise ConfigError(f"{flag} {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: {existing} is not writable")


def _check_paths(run: RunConfig) -> None:
    for flag, path in (("--output-dir", run.output.output_dir), ("--save-base", run.output.save_base),
                       ("--export-hf", run.output.export_hf)):
        check_writable_dir(flag, path)

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
    if export and model.hf_checkpoint and run.output.export_hf_layout == "per-expert":
        _check_peft_export(run)
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


def _check_peft_export(run: RunConfig) -> None:
    """What the end of the run will export must be exportable: found now, not after training."""
    from megatron_slmoe.hf import HFCheckpointError, open_hf_checkpoint
    from megatron_slmoe.hf.peft_export import per_expert_export_problem

    try:
        hf = open_hf_checkpoint(run.model.hf_checkpoint, check_shapes=False)
    except HFCheckpointError:
        return  # the checkpoint's own check names its problem
    problem = per_expert_export_problem(hf, run.lora.targets)
    if problem:
        raise ConfigError(f"--export-hf {run.output.export_hf}: {problem}")


def _check_base_model(run: RunConfig) -> None:
    """LoRA adapts a trained model: on random weights it trains adapters for nothing."""
    model = run.model
    if model.finetune_mode == "lora" and not (model.base_checkpoint or model.hf_checkpoint):
        raise ConfigError(
            "LoRA needs a trained base model: name one with --base-checkpoint DIR (a Megatron dist "
            "checkpoint, e.g. from --finetune-mode full --save-base DIR) or --hf-checkpoint DIR, run "
            "`bash scripts/pretrain_lora.sh` with no flags for the demo (it pretrains a tiny base "
            "first), or train every weight from scratch with --finetune-mode full")


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
        # An object-storage dataset is checked the same way once on the node (_check_data).
        if path and not is_object_url(path) and not os.path.isdir(os.path.join(path, ".nv-meta")):
            raise ConfigError(f"{flag} {path}: not an energon dataset folder (prepare one with "
                              f"tools/prepare_image_text.py)")
    if vision.checkpoint:
        from megatron_slmoe.model.hf_vision import HFImportError, check_hf_vision_checkpoint

        try:
            check_hf_vision_checkpoint(vision.checkpoint, vision)
        except HFImportError as err:
            raise ConfigError(f"--vision-checkpoint {vision.checkpoint}: {err}") from None


def _check_image_text_data(run: RunConfig, tokenizer, hf) -> None:
    """Each split opens, its shards are whole, and it has a usable sample (the first good record
    in split order; a dataset of bad records is refused, not trained on as skips)."""
    from megatron_slmoe.data.errors import DataError
    from megatron_slmoe.data.image_text import ImageTextDataset
    from megatron_slmoe.training.tasks.image_text import image_input

    data = run.data
    try:
        images = image_input(run.vision, run.image_text, hf, tokenizer)
    except DataError as err:
        raise ConfigError(f"--task image-text: {err}") from None
    if not data.train_data:
        return  # the shapes task, made by the run itself
    from megatron_slmoe.storage.errors import StorageError
    from megatron_slmoe.storage.session import Storage
    from megatron_slmoe.training.tasks.image_text import node_view

    storage = Storage(run.storage)
    views = {}  # one view of a prefix that is both the training and the held-out data
    try:
        for flag, path, split in (("--train-data", data.train_data, "train"),
                                  ("--valid-data", data.valid_data or data.train_data, "val")):
            if path not in views:  # on object storage: the metadata now
                try:
                    views[path] = node_view(storage, path)
                except StorageError as err:
                    raise ConfigError(f"{flag}: {err}") from None
                except DataError as err:
                    raise ConfigError(f"{flag} {err}") from None
            local, stored = views[path]
            try:  # the first usable sample's shard: a download the run needs anyway
                ImageTextDataset(local, tokenizer, data.seq_length, split=split, images=images,
                                 caption_prompt=run.image_text.caption_prompt, max_warnings=0,
                                 stored=stored)
            except (DataError, StorageError) as err:
                raise ConfigError(f"{flag}: {err}") from None
    finally:
        for _, stored in views.values():
            if stored is not None:
                stored.close()


def _check_model_fits_run(run: RunConfig, model_config) -> None:
    """The model config against what the run asks of it."""
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


def _check_deepstack(run: RunConfig, model_config, hf) -> None:
    """A tower whose DeepStack features go into the first decoder layers (Qwen3-VL): those
    layers on the first pipeline stage, where the tower is; and, with images, no full
    recompute, which would recompute the layers without the features
    (``model.tower_language``)."""
    layers = hf.family.deepstack_layers(hf.family.hf_config(hf.checkpoint.config_path)) if (
        hf is not None and hf.family.multimodal) else 0
    if not layers:
        return
    parallel = run.parallel
    if parallel.recompute_granularity == "full" and run.data.task == "image-text":
        raise ConfigError(f"--recompute-granularity full: {hf.checkpoint.config_path}'s tower "
                          f"adds DeepStack features to the first {layers} decoder layers, which "
                          f"a full recompute would recompute without them; use selective")
    first_stage = model_config.transformer["num_layers"] // parallel.pipeline_model_parallel_size
    if first_stage < layers:
        raise ConfigError(f"--pipeline-model-parallel-size {parallel.pipeline_model_parallel_size}"
                          f": the first stage would hold {first_stage} decoder layers; "
                          f"{hf.checkpoint.config_path}'s tower adds DeepStack features to the "
                          f"first {layers}")


def _check_tokenizer(run: RunConfig, model_config):
    """The run's tokenizer (``data.tokenizer.tokenizer_source``, through the node cache if it is
    an object), checked against the sequence length and vocabulary of the model."""
    from megatron_slmoe.data.errors import DataError
    from megatron_slmoe.data.tokenizer import load_tokenizer, tokenizer_source
    from megatron_slmoe.storage import Storage, StorageError

    data = run.data
    try:
        source = tokenizer_source(data.tokenizer, run.model.hf_checkpoint,
                                  run.model.base_checkpoint)
        tokenizer = load_tokenizer(Storage(run.storage).local_file(source))
    except (DataError, StorageError) as err:
        flag = "--tokenizer" if data.tokenizer or not run.model.hf_checkpoint else \
            "--hf-checkpoint (its tokenizer; or pass --tokenizer)"
        raise ConfigError(f"{flag}: {err}") from None
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ConfigError(f"--tokenizer {data.tokenizer or tokenizer.path} has "
                          f"{tokenizer.vocab_size} tokens, more than the model's vocab_size "
                          f"{model_config.vocab_size}")
    return tokenizer


def _check_base_checkpoint(run: RunConfig, model_config, tokenizer) -> None:
    """Present and complete (the manifest's sizes, else the dist checkpoint's own files), made
    from this model config, trained with this tokenizer."""
    from megatron_slmoe.data.tokenizer import BASE_TOKENIZER
    from megatron_slmoe.runtime.bases import check_base_model
    from megatron_slmoe.training.checkpointing import verify

    path = run.model.base_checkpoint
    if not path or is_object_url(path):
        return
    flag = f"--base-checkpoint {path}"
    if not os.path.isdir(path):
        raise ConfigError(f"{flag} is not a directory")
    names = os.listdir(path)
    if not names:
        raise ConfigError(f"{flag} is an empty directory")
    if "MANIFEST.json" in names:
        problem = verify(path, checksums=False)
        if problem:
            raise ConfigError(f"{flag} is damaged: {problem} (an incomplete copy?)")
    else:  # written by another tool: at least Megatron's own files, none of them empty
        for required in ("metadata.json", ".metadata"):
            if required not in names:
                raise ConfigError(f"{flag} has no {required}: not a Megatron dist checkpoint, or "
                                  f"its save did not finish")
        for name in sorted(names):
            if name.endswith(".distcp") and os.path.getsize(os.path.join(path, name)) == 0:
                raise ConfigError(f"{flag}: {name} is empty (an incomplete copy?)")
    check_base_model(path, model_config, flag)
    recorded = os.path.join(path, BASE_TOKENIZER)
    if os.path.isfile(recorded):
        _check_same_tokenizer(tokenizer, recorded, f"the tokenizer {flag} was trained with "
                                                   f"({recorded})")


def _check_same_tokenizer(tokenizer, recorded_path: str, what: str) -> None:
    from megatron_slmoe.data.errors import DataError
    from megatron_slmoe.data.tokenizer import load_tokenizer

    try:
        recorded = load_tokenizer(recorded_path)
    except DataError as err:
        raise ConfigError(f"{what}: {err}") from None
    if recorded.fingerprint != tokenizer.fingerprint:
        raise ConfigError(f"--tokenizer {tokenizer.path} is not {what}: pass --tokenizer "
                          f"{recorded_path}")


def _check_adapter_init(run: RunConfig, model_config, tokenizer) -> None:
    """Readable, with the run's LoRA rank, alpha and targets, for this model and tokenizer."""
    from megatron_slmoe.hf.peft_import import is_peft_adapter
    from megatron_slmoe.lora.adapter import (
        ADAPTER_WEIGHTS,
        AdapterError,
        base_identity,
        check_base_identity,
        read_adapter_config,
    )

    path = run.model.adapter_init
    if not path or is_object_url(path):
        return
    if run.model.hf_checkpoint and is_peft_adapter(path):  # converted at start-up
        from megatron_slmoe.hf import HFCheckpointError
        from megatron_slmoe.hf.peft_import import read_peft_config

        try:
            read_peft_config(path)  # what it is (plain LoRA); its tensors when it is converted
        except HFCheckpointError as err:
            raise ConfigError(f"--adapter-init {path}: {err}") from None
        return
    flag = f"--adapter-init {path}"
    try:
        lora, base = read_adapter_config(path)
    except AdapterError as err:
        raise ConfigError(f"{flag}: {err}") from None
    for field in ("rank", "alpha", "targets"):
        theirs, ours = getattr(lora, field), getattr(run.lora, field)
        if (sorted(theirs) if field == "targets" else theirs) != (
                sorted(ours) if field == "targets" else ours):
            shown = " ".join(ours) if field == "targets" else ours
            raise ConfigError(f"{flag} has lora.{field} {theirs!r}, but "
                              f"{run.lora.flag(field)} is {shown}")
    try:
        check_base_identity(base, base_identity(model_config, tokenizer), flag,
                            tokenizer_name=f"--tokenizer {tokenizer.path}")
    except AdapterError as err:
        raise ConfigError(str(err)) from None
    weights = os.path.join(path, ADAPTER_WEIGHTS)
    try:
        from safetensors import safe_open

        with safe_open(weights, framework="pt", device="cpu") as handle:
            handle.keys()
    except Exception as err:  # noqa: BLE001  (safetensors raises several types)
        reason = " ".join(str(err).split())[:160]
        raise ConfigError(f"{flag}: {weights} is not a readable safetensors file "
                          f"({reason})") from None


def _check_data(run: RunConfig, tokenizer, hf) -> None:
    data = run.data
    if data.task == "image-text":
        _check_image_text_data(run, tokenizer, hf)
        return
    if data.format == "pretrain":
        if data.train_data and not is_object_url(data.train_data):
            _check_indexed(data.train_data)
        return
    for flag, path in (("--train-data", data.train_data), ("--valid-data", data.valid_data)):
        if path and not is_object_url(path):
            _check_instruction_file(flag, path, data.max_malformed_fraction)


def _check_indexed(prefix: str) -> None:
    from megatron_slmoe.data.errors import DataError
    from megatron_slmoe.data.pretrain import load_indexed_dataset

    try:
        dataset = load_indexed_dataset(prefix)
    except DataError as err:
        raise ConfigError(f"--train-data {prefix}: {err}") from None
    if len(dataset) == 0:
        raise ConfigError(f"--train-data {prefix}: the indexed dataset holds no documents")


def _check_instruction_file(flag: str, path: str, max_malformed: float) -> None:
    """Not empty, some well-formed records, and at most the allowed share of malformed ones."""
    from megatron_slmoe.data.instruction import (
        InstructionStats,
        malformed_problem,
        read_instruction_jsonl,
    )

    stats = InstructionStats()
    with _first_warning("megatron_slmoe.data.instruction") as first:
        read_instruction_jsonl(path, stats, max_warnings=1)
    problem = malformed_problem(stats, max_malformed)
    if problem:
        example = f"; the first: {first[0]}" if first and stats.records else ""
        raise ConfigError(f"{flag} {path}{':' if stats.records else ''} {problem}{example}")


@contextlib.contextmanager
def _first_warning(logger_name: str):
    """Collect a logger's warnings instead of printing them (the first names the problem)."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger(logger_name)
    handler, propagate = Collect(level=logging.WARNING), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


# Settings a run must keep to be resumed: what it trains, on which data, with which optimizer.
# The layout (parallel sizes), intervals, --train-iters (a larger one extends the schedule) and
# the output options may change.
RESUME_MUST_MATCH = (
    ("model", ("config", "base_checkpoint", "finetune_mode", "precision")),
    ("lora", ("rank", "alpha", "targets", "dropout")),
    ("data", ("format", "train_data", "valid_data", "tokenizer", "seq_length")),
    ("optimizer", ("lr", "min_lr", "lr_warmup_iters", "lr_decay_style", "weight_decay",
                   "adam_beta1", "adam_beta2", "clip_grad")),
    ("schedule", ("global_batch_size", "seed")),
)
_PATHS = {"base_checkpoint", "train_data", "valid_data", "tokenizer"}


CHECKPOINT_BYTES_PER_TRAINABLE = 4 + 8
"""A checkpoint holds each trainable parameter in fp32 and Adam's two fp32 moments."""


def _check_output_space(run: RunConfig, model_config, platform) -> None:
    """The file system of --output-dir has room for the checkpoints the run keeps (and the
    --save-base it writes): a full disk is found now, not in the middle of a save."""
    import shutil

    from megatron_slmoe.plan.devices import generic_device
    from megatron_slmoe.plan.memory import estimate_memory
    from megatron_slmoe.plan.model_shape import ModelShape
    from megatron_slmoe.plan.settings import RunSettings
    from megatron_slmoe.runtime.model import resolve_precision

    out = run.output.output_dir or "runs"
    shape = ModelShape.from_config(model_config)
    whole = RunSettings.from_run_config(run, 1, resolve_precision(run.model, platform)).replace(
        tp=1, pp=1, ep=1, dp=1, vision=None)
    if run.model.finetune_mode == "full":
        trainable = shape_params(shape)
    else:
        trainable = estimate_memory(shape, whole, generic_device(2**50)).stages[0].trainable_params
    needed = trainable * CHECKPOINT_BYTES_PER_TRAINABLE * (run.output.keep_last + 1)
    if run.output.save_base:
        needed += shape_params(shape) * 4
    free = shutil.disk_usage(_nearest_existing(out)).free
    if needed > free:
        raise ConfigError(
            f"--output-dir {out}: its file system has {free / 2**30:.2f} GiB free; the run's "
            f"checkpoints need about {needed / 2**30:.2f} GiB ({trainable:,} trainable parameters, "
            f"--keep-last {run.output.keep_last}{' and --save-base' if run.output.save_base else ''}"
            f"): free space, lower --keep-last, or write elsewhere")


def shape_params(shape) -> int:
    from megatron_slmoe.plan.model_shape import census

    return census(shape)["total_params"]


def _check_output_dir(run: RunConfig, platform) -> None:
    """A run already in --output-dir is resumed: with the settings it was started with, and not
    redone once finished."""
    from megatron_slmoe.training.checkpointing import verify

    out = run.output.output_dir
    root = os.path.join(out or "", "checkpoints")
    if not out or not run.output.resume or not os.path.isdir(root):
        return
    iterations = sorted(int(n[len("iter_"):]) for n in os.listdir(root)
                        if n.startswith("iter_") and n[len("iter_"):].isdigit())
    if not iterations:
        return
    earlier_path = os.path.join(out, "config.yaml")
    if os.path.isfile(earlier_path):
        _check_same_settings(run, earlier_path, platform)
    trained = next((i for i in reversed(iterations)
                    if verify(os.path.join(root, f"iter_{i:07d}"), checksums=False) is None), 0)
    if trained > run.schedule.train_iters:
        raise ConfigError(f"--train-iters {run.schedule.train_iters} is below the {trained} steps "
                          f"the run in {out} has trained (resume it with at least {trained})")
    if trained == run.schedule.train_iters and _summary_steps(out) == trained:
        raise RunFinished(f"the run in {out} has finished all {trained} steps (summary.json); "
                          f"nothing to do: a larger --train-iters continues it, another "
                          f"--output-dir starts a new one")


def _summary_steps(out: str):
    """The steps summary.json reports (written when a run finishes), or None."""
    import json

    try:
        with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
            return json.load(f).get("steps")
    except (OSError, ValueError, AttributeError):
        return None


def _check_same_settings(run: RunConfig, earlier_path: str, platform) -> None:
    from megatron_slmoe.data.tokenizer import tokenizer_source
    from megatron_slmoe.runtime.model import resolve_precision
    from megatron_slmoe.training.cli import build_run_config, read_yaml

    try:
        earlier = build_run_config(read_yaml(earlier_path))
    except ConfigError as err:
        raise ConfigError(f"{earlier_path}, the configuration of the run this would resume, is "
                          f"unreadable: {err}") from None
    for section, names in RESUME_MUST_MATCH:
        for name in names:
            ours, theirs = (getattr(getattr(c, section), name) for c in (run, earlier))
            if name == "precision":
                ours, theirs = (resolve_precision(c.model, platform) for c in (run, earlier))
            elif name == "tokenizer":  # as resolved: the flag, else the base's, ...
                ours, theirs = (os.path.abspath(tokenizer_source(
                    c.data.tokenizer, c.model.hf_checkpoint, c.model.base_checkpoint))
                    for c in (run, earlier))
            elif name in _PATHS:
                ours, theirs = (os.path.abspath(p) if p else p for p in (ours, theirs))
            elif name == "targets":
                ours, theirs = sorted(ours), sorted(theirs)
            if ours != theirs:
                flag = getattr(run, section).flag(name)
                raise ConfigError(
                    f"{flag} {_shown(ours)} differs from {_shown(theirs)} in {earlier_path}, the "
                    f"run this would resume (resume it unchanged, or start over there with "
                    f"--no-resume, or use another --output-dir)")


def _shown(value) -> str:
    if value is None:
        return "(unset)"
    return " ".join(value) if isinstance(value, list) else str(value)


def hf_tower(run: RunConfig, hf):
    """The opened --hf-checkpoint's own vision module as the memory planner prices it (a
    ``plan.vision.ReplicatedTower``), or None when it has none. The planner prices LoRA runs:
    a full fine-tune's trained tower (--train-vision-tower) is priced as a frozen one."""
    from dataclasses import asdict

    from megatron_slmoe.hf.tower_model import vision_census
    from megatron_slmoe.plan.vision import ReplicatedTower

    targets = run.lora.targets if run.model.finetune_mode == "lora" else ()
    census = vision_census(hf, targets, run.lora.rank)
    if census is None:
        return None
    return ReplicatedTower(**asdict(census), attention_adapted="vision_attention" in targets,
                           projector_adapted="projector" in targets,
                           images=run.data.task == "image-text")


def memory_check(run: RunConfig, world_size: int, platform, model_config, hf=None):
    """The memory planner's verdict on this run's layout (a ``plan.check.LayoutCheck``), or None
    when there is no device memory to plan against (CPU without --device-memory-gb); ``hf``: the
    opened --hf-checkpoint, whose own vision module is priced too."""
    from megatron_slmoe.plan.check import check_layout
    from megatron_slmoe.plan.settings import RunSettings
    from megatron_slmoe.runtime.model import resolve_precision

    memory = (run.parallel.device_memory_gb * 2**30 if run.parallel.device_memory_gb
              else platform.device_memory_bytes())
    if memory is None:
        return None
    settings = RunSettings.from_run_config(
        run, world_size, resolve_precision(run.model, platform),
        devices_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
        hf_tower=hf_tower(run, hf))
    return check_layout(model_config, settings, int(memory))


def _check_memory(run: RunConfig, world_size: int, platform, model_config, hf) -> None:
    if run.parallel.memory_check == "off":
        return
    check = memory_check(run, world_size, platform, model_config, hf)
    if check is None or check.fits:
        return
    if run.parallel.memory_check == "refuse":
        raise ConfigError(f"{check.message} (run anyway: --memory-check warn)")
    log.warning("memory check: %s", check.message)
