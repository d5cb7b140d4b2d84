"""The run configuration of a fine-tuning job: the training loop's own sections (optimizer,
schedule, output, health), the tree that composes every component's section, and the rules that
span sections.

Each component receives its own section, never the whole tree. The tree is built by
``megatron_slmoe.training.cli`` from flags and ``--config`` YAML; ``--print-config`` shows it as
YAML and every run writes it to ``config.yaml`` in its output directory. Torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.config.schema import Section, setting
from megatron_slmoe.data.config import DataConfig, ImageTextConfig
from megatron_slmoe.lora.config import LoRAConfig
from megatron_slmoe.model.config import ModelSection, VisionConfig
from megatron_slmoe.moe.config import MoERunConfig, MonitorConfig
from megatron_slmoe.parallel.config import ParallelConfig
from megatron_slmoe.parallel.layout import batch_split_problem, data_parallel_size
from megatron_slmoe.storage.config import StorageConfig, check_locations


MAX_SEED = 2**31 - 1
"""Seeds are in 0..2^31-1 (torch, Megatron's per-rank offsets and numpy all take them)."""


class RunFinished(Exception):
    """The run in --output-dir has trained all its steps: nothing to do (not an error; the
    entry point exits 0, or 3 under --validate-only so that a launcher starts nothing)."""


@dataclass(frozen=True)
class OptimizerConfig(Section):
    """Adam and the learning-rate schedule (Megatron-Core's optimizer and scheduler)."""

    section_name = "optimizer"

    lr: float = setting(2e-3, flag="--lr", help="peak learning rate")
    min_lr: float = setting(0.0, flag="--min-lr", help="learning rate at the end of the decay")
    lr_warmup_iters: int = setting(10, flag="--lr-warmup-iters", help="linear warm-up steps")
    lr_decay_style: Literal["cosine", "linear", "constant"] = setting(
        "cosine", flag="--lr-decay-style", help="decay from lr to min-lr over the run")
    weight_decay: float = setting(0.0, flag="--weight-decay", help="AdamW weight decay")
    adam_beta1: float = setting(0.9, flag="--adam-beta1", help="Adam beta1")
    adam_beta2: float = setting(0.999, flag="--adam-beta2", help="Adam beta2")
    clip_grad: float = setting(1.0, flag="--clip-grad", help="gradient-norm clipping (0: off)")

    def validate(self) -> None:
        self.check(self.lr > 0, "lr", f"must be positive, got {self.lr}")
        self.check(0 <= self.min_lr <= self.lr, "min_lr",
                   f"{self.min_lr} must be in [0, --lr {self.lr}]")
        self.check_non_negative("lr_warmup_iters", "weight_decay", "clip_grad")
        for name in ("adam_beta1", "adam_beta2"):
            self.check(0 <= getattr(self, name) < 1, name,
                       f"must be in [0, 1), got {getattr(self, name)}")


@dataclass(frozen=True)
class ScheduleConfig(Section):
    """Batch sizes, run length, and how often to evaluate, log and checkpoint."""

    section_name = "schedule"

    micro_batch_size: int = setting(4, flag="--micro-batch-size",
                                    help="samples per forward pass on one data-parallel rank")
    global_batch_size: int = setting(16, flag="--global-batch-size",
                                     help="samples per optimizer step over all ranks")
    train_iters: int = setting(200, flag="--train-iters", help="optimizer steps of the run")
    eval_interval: int = setting(50, flag="--eval-interval",
                                 help="held-out evaluation every this many steps")
    eval_iters: int = setting(4, flag="--eval-iters",
                              help="global batches of held-out data per evaluation")
    eval_accuracy_samples: int = setting(
        200, flag="--eval-accuracy-samples",
        help="at each evaluation, this many held-out conversations are answered by greedy "
             "generation and scored by exact match (instruction data; 0: off)")
    log_interval: int = setting(10, flag="--log-interval", help="progress line every N steps")
    save_interval: int = setting(50, flag="--save-interval", help="checkpoint every N steps")
    seed: int = setting(1234, flag="--seed", help="seed of initialisation, data order, dropout")

    def validate(self) -> None:
        self.check_positive("micro_batch_size", "global_batch_size", "train_iters",
                            "eval_interval", "eval_iters", "log_interval", "save_interval")
        self.check_non_negative("eval_accuracy_samples")
        self.check(0 <= self.seed <= MAX_SEED, "seed", f"must be in 0..{MAX_SEED}, got {self.seed}")

    @property
    def train_samples(self) -> int:
        return self.train_iters * self.global_batch_size


@dataclass(frozen=True)
class OutputConfig(Section):
    """Where the run writes, and how it resumes."""

    section_name = "output"

    output_dir: Optional[str] = setting(
        None, flag="--output-dir",
        help="everything the run writes (default: runs/<time>); a rerun resumes from it")
    output_url: Optional[str] = setting(
        None, flag="--output-url",
        help="s3:// or msc:// prefix that also receives the run's checkpoints, adapter, config, "
             "metrics and summary (--output-dir stays the local staging area); a resumed run "
             "fetches the newest stored checkpoint when it is newer than the local ones")
    tensorboard: bool = setting(True, flag="--tensorboard",
                                help="write TensorBoard events (--no-tensorboard: off)")
    keep_last: int = setting(2, flag="--keep-last", help="full checkpoints to keep")
    resume: bool = setting(True, flag="--resume",
                           help="resume from the newest intact checkpoint in the output "
                                "directory (--no-resume: start fresh)")
    save_base: Optional[str] = setting(
        None, flag="--save-base",
        help="with --finetune-mode full: also write the trained model here as a Megatron dist "
             "checkpoint (a base for LoRA runs)")
    plots: bool = setting(True, flag="--plots",
                          help="write PNG pictures of the run into <output dir>/plots at the end "
                               "(--no-plots: off; tools/plot_run.py makes them any time)")
    export_hf: Optional[str] = setting(
        None, flag="--export-hf",
        help="with --hf-checkpoint: at the end also write the adapter here as a PEFT adapter of "
             "the HF base (slmoe-convert-hf export; a new or empty directory)")
    export_hf_layout: Literal["per-expert", "fused", "shared-outer",
                              "shared-outer-expanded"] = setting(
        "per-expert", flag="--export-hf-layout",
        help="the --export-hf adapter's layout, named by what reads it: per-expert (vLLM), fused "
             "(PEFT target_parameters on transformers 5's 3D experts), shared-outer (SGLang "
             "--experts-shared-outer-loras), shared-outer-expanded (vLLM/PEFT); "
             "megatron_slmoe.hf.export_layouts")
    async_save: bool = setting(
        True, flag="--async-save",
        help="write checkpoints in the background while training continues (Megatron-Core's "
             "asynchronous dist-checkpoint save; --no-async-save: the loop waits for each)")
    use_persistent_ckpt_worker: bool = setting(
        False, flag="--use-persistent-ckpt-worker",
        help="with --async-save: one long-lived writer process per rank (started at set-up; "
             "worth it where forking the trainer per save is slow), instead of a fork per save")

    def validate(self) -> None:
        self.check_positive("keep_last")
        check_locations(self, "output_dir", "save_base", local_only=True)
        check_locations(self, "output_url", url_only=True)
        if self.use_persistent_ckpt_worker and not self.async_save:
            self.fail("use_persistent_ckpt_worker", "needs --async-save")


@dataclass(frozen=True)
class HealthConfig(Section):
    """Noticing a rank that hangs or lags behind the others."""

    section_name = "health"

    heartbeat_timeout: float = setting(
        300.0, flag="--heartbeat-timeout",
        help="seconds a rank may go without finishing a step (or without a heartbeat) before the "
             "job is stopped, naming it; must cover the slowest step with its evaluation and "
             "checkpoint; torchrun's restart budget then restarts the job (0: off)")
    straggler_threshold: float = setting(
        1.5, flag="--straggler-threshold",
        help="at each progress line, name a rank whose compute time per step (the step minus "
             "its wait for the others at the gradient reduction) is this many times the other "
             "ranks' median, over most steps of the interval (0: off)")

    def validate(self) -> None:
        self.check_non_negative("heartbeat_timeout")
        self.check(self.straggler_threshold == 0 or self.straggler_threshold > 1,
                   "straggler_threshold", f"must be 0 (off) or above 1, got "
                                          f"{self.straggler_threshold}")


@dataclass(frozen=True)
class RunConfig:
    """The whole run configuration: the sections in the order ``--print-config`` shows them."""

    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    moe: MoERunConfig = field(default_factory=MoERunConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    data: DataConfig = field(default_factory=DataConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    image_text: ImageTextConfig = field(default_factory=ImageTextConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    @classmethod
    def sections(cls) -> dict[str, type[Section]]:
        """Section name -> section class, in order."""
        return {f.name: f.default_factory for f in dataclasses.fields(cls)}  # type: ignore[misc]

    def to_dict(self) -> dict[str, dict]:
        return {name: getattr(self, name).to_dict() for name in self.sections()}

    def replace(self, section: str, **changes) -> "RunConfig":
        """A copy with fields of one section changed (checked again)."""
        return dataclasses.replace(
            self, **{section: dataclasses.replace(getattr(self, section), **changes)})


def _changed_flags(section, names: Optional[tuple] = None) -> list[str]:
    """The flags of ``section``'s settings (those named, or all) set away from their defaults."""
    changed = []
    for field in dataclasses.fields(section):
        if "flag" not in field.metadata or (names is not None and field.name not in names):
            continue
        default = (field.default_factory() if field.default_factory is not dataclasses.MISSING
                   else field.default)
        if getattr(section, field.name) != default:
            changed.append(field.metadata["flag"])
    return changed


def validate_run(run: RunConfig, world_size: int) -> None:
    """The rules that span sections (each section has checked its own fields already)."""
    parallel, schedule = run.parallel, run.schedule
    tp, pp, ep = (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                  parallel.expert_model_parallel_size)
    dp = data_parallel_size(world_size, tp, pp, ep)
    batch_problem = batch_split_problem(schedule.global_batch_size, dp, schedule.micro_batch_size)
    if batch_problem:
        raise ConfigError(batch_problem)
    if run.optimizer.lr_warmup_iters >= schedule.train_iters:
        raise ConfigError(f"--lr-warmup-iters {run.optimizer.lr_warmup_iters} must be below "
                          f"--train-iters {schedule.train_iters}")
    if run.output.export_hf and not (run.model.hf_checkpoint and run.model.finetune_mode == "lora"):
        raise ConfigError("--export-hf needs --hf-checkpoint and --finetune-mode lora")
    if run.output.save_base and run.model.finetune_mode != "full":
        raise ConfigError("--save-base needs --finetune-mode full")
    if run.data.task == "image-text":
        if run.model.hf_checkpoint:
            # The checkpoint brings its tower and its processor's settings: ours do not apply.
            ours = _changed_flags(run.vision) + _changed_flags(
                run.image_text, ("max_tiles", "thumbnail", "image_mean", "image_std"))
            if ours:
                raise ConfigError(f"{ours[0]} is a setting of our own multimodal model; a "
                                  f"multimodal --hf-checkpoint brings its own tower and image "
                                  f"settings (preprocessor_config.json)")
        else:
            run.vision.check_tensor_parallel(tp)
        if run.data.seq_length % tp:
            raise ConfigError(f"--seq-length {run.data.seq_length} must be divisible by "
                              f"--tensor-model-parallel-size {tp} (the image-text sequence is "
                              f"split over the tensor-parallel ranks)")
    if run.image_text.train_vision_tower and run.model.finetune_mode != "full":
        raise ConfigError("--train-vision-tower needs --finetune-mode full (LoRA adapts the "
                          "tower with --lora-target-modules vision_attention)")
    collective_timeout_s = parallel.distributed_timeout_minutes * 60
    if run.health.heartbeat_timeout >= collective_timeout_s:
        raise ConfigError(f"--heartbeat-timeout {run.health.heartbeat_timeout:g} s must be below "
                          f"--distributed-timeout-minutes {parallel.distributed_timeout_minutes} "
                          f"({collective_timeout_s} s): a stuck rank is to be named before the "
                          f"collectives time out")
    if (run.data.task == "text" and run.data.format == "instruction"
            and run.data.train_data is not None
            and run.data.valid_data is None):
        raise ConfigError(f"--train-data {run.data.train_data} needs --valid-data: without it the "
                          f"held-out loss would be measured on the shipped demo set, not on "
                          f"data like yours")
    if run.moe.routing_kl_coeff > 0 and run.model.finetune_mode != "lora":
        raise ConfigError("--moe-routing-kl-coeff needs --finetune-mode lora (it keeps routing "
                          "near the frozen base model's)")
