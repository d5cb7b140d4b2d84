"""The run configuration of a fine-tuning job: one section per component, and the rules that span
sections.

Each component receives its own section (the LoRA injection ``LoRAConfig``, the routing monitor
``MonitorConfig``, the optimizer ``OptimizerConfig`` ...), never the whole tree. The tree is built by
``megatron_slmoe.config.cli`` from flags and ``--config`` YAML; ``--print-config`` shows it as
YAML and every run writes it to ``config.yaml`` in its output directory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.config.schema import Section, setting

MAX_LORA_RANK = 256
DEFAULT_LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass(frozen=True)
class ModelSection(Section):
    """The model, its starting weights, what is trained, and the precision."""

    section_name = "model"

    config: str = setting("tiny", flag="--model-config",
                          help="packaged model config name (tiny, small, flagship_2p8t) or a YAML "
                               "file of TransformerConfig fields")
    base_checkpoint: Optional[str] = setting(
        None, flag="--base-checkpoint",
        help="Megatron dist checkpoint with the base weights (default: random initialisation)")
    hf_checkpoint: Optional[str] = setting(
        None, flag="--hf-checkpoint",
        help="Hugging Face checkpoint directory (config.json, safetensors shards): the model is "
             "built from its config.json and each rank reads only its own slices of the weights; "
             "also the default --tokenizer (instead of --model-config and --base-checkpoint)")
    hf_shape_check: bool = setting(
        True, flag="--hf-shape-check",
        help="with --hf-checkpoint: check every tensor's presence and shape against config.json "
             "before starting (--no-hf-shape-check: only when a rank reads it)")
    hf_unmap_mib: int = setting(
        64, flag="--hf-unmap-mib",
        help="with --hf-checkpoint: MiB of shard file pages a rank keeps mapped while loading (its "
             "peak host memory is its shard, one source tensor and this window)")
    adapter_init: Optional[str] = setting(
        None, flag="--adapter-init",
        help="start from this adapter directory instead of fresh LoRA weights: one a run saved, "
             "or a PEFT adapter of the --hf-checkpoint base (its rank, alpha and targets are "
             "taken)")
    finetune_mode: Literal["lora", "full"] = setting(
        "lora", flag="--finetune-mode",
        help="'lora' trains adapters on a frozen base; 'full' trains every weight (how the "
             "demo's tiny base is made)")
    precision: Literal["auto", "bf16", "fp32"] = setting(
        "auto", flag="--precision", switches={"--bf16": "bf16", "--fp32": "fp32"},
        help="parameter and compute dtype; auto: bf16 on GPUs/NPUs, fp32 on CPU "
             "(--bf16 / --fp32 are shorthands)")

    def validate(self) -> None:
        self.check(bool(self.config), "config", "must name a model config")
        if self.finetune_mode == "full" and self.adapter_init:
            raise ConfigError("--adapter-init needs --finetune-mode lora")
        self.check_positive("hf_unmap_mib")
        if self.hf_checkpoint is not None:
            self.check(bool(self.hf_checkpoint), "hf_checkpoint", "must be a directory")
            self.check(not self.base_checkpoint, "hf_checkpoint",
                       "and --base-checkpoint are exclusive: the base weights come from one of them")
            self.check(self.config == type(self).config, "hf_checkpoint",
                       "and --model-config are exclusive: the model is the checkpoint's config.json")


@dataclass(frozen=True)
class ParallelConfig(Section):
    """How the model is split over ranks, and what is recomputed to save memory."""

    section_name = "parallel"

    tensor_model_parallel_size: int = setting(1, flag="--tensor-model-parallel-size",
                                              help="TP: ranks that split each layer's matrices")
    pipeline_model_parallel_size: int = setting(1, flag="--pipeline-model-parallel-size",
                                                help="PP: pipeline stages")
    expert_model_parallel_size: int = setting(1, flag="--expert-model-parallel-size",
                                              help="EP: ranks that split the routed experts")
    use_distributed_optimizer: bool = setting(
        False, flag="--use-distributed-optimizer",
        help="shard optimizer state over data-parallel ranks (Megatron's distributed optimizer)")
    distributed_timeout_minutes: int = setting(
        30, flag="--distributed-timeout-minutes",
        help="timeout of the process group and every parallel group")
    recompute_granularity: Optional[Literal["selective", "full"]] = setting(
        None, flag="--recompute-granularity", help="activation recomputation (default: none)")
    recompute_modules: Optional[list[str]] = setting(
        None, flag="--recompute-modules",
        help="with selective recomputation: which modules, e.g. moe core_attn")
    memory_check: Literal["refuse", "warn", "off"] = setting(
        "refuse", flag="--memory-check",
        help="before starting, price this layout with the memory planner (megatron_slmoe.plan) "
             "and refuse (or warn about) one predicted not to fit")
    device_memory_gb: Optional[float] = setting(
        None, flag="--device-memory-gb",
        help="memory of one accelerator for the memory check (default: the device's own; "
             "without an accelerator the check needs this)")

    def validate(self) -> None:
        self.check_positive("tensor_model_parallel_size", "pipeline_model_parallel_size",
                            "expert_model_parallel_size", "distributed_timeout_minutes",
                            "device_memory_gb")
        if self.recompute_modules and self.recompute_granularity != "selective":
            raise ConfigError("--recompute-modules needs --recompute-granularity selective")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // self.model_parallel_size


@dataclass(frozen=True)
class MoERunConfig(Section):
    """Run-time choices of the MoE layer; they override the model config's ``slmoe`` section."""

    section_name = "moe"

    token_dispatcher_type: Optional[str] = setting(
        None, flag="--moe-token-dispatcher-type",
        help="alltoall or allgather (default: the model config's)")
    hierarchical_alltoall: bool = setting(
        False, flag="--moe-hierarchical-alltoall",
        help="two-hop all-to-all for multi-node expert parallelism (inter-node, then intra-node)")
    node_size: Optional[int] = setting(
        None, flag="--moe-node-size",
        help="ranks per node for the hierarchical all-to-all (default: LOCAL_WORLD_SIZE)")
    overlap_chunks: Optional[int] = setting(
        None, flag="--moe-overlap-chunks",
        help="overlap the all-to-all (flat or hierarchical) with expert compute over this many "
             "token chunks, forward and backward (default: the model config's, 1 = no overlap)")
    routed_balance_coeff: float = setting(
        0.1, flag="--moe-routed-balance-coeff",
        help="with --finetune-mode lora: load-balancing loss on the routing actually used "
             "(frozen expert bias included), acting through the adapters before each router "
             "(0: off; see megatron_slmoe.moe.stability)")
    routing_kl_coeff: float = setting(
        0.0, flag="--moe-routing-kl-coeff",
        help="routing preservation with --finetune-mode lora: KL(base routing || routing) per "
             "token, the base routing from one more forward pass per step (0: off)")

    def validate(self) -> None:
        from megatron_slmoe.moe.dispatch import DISPATCHERS

        if self.token_dispatcher_type is not None and self.token_dispatcher_type not in DISPATCHERS:
            self.fail("token_dispatcher_type", f"must be one of {', '.join(sorted(DISPATCHERS))}, "
                                               f"got {self.token_dispatcher_type!r}")
        self.check_positive("node_size", "overlap_chunks")
        self.check_non_negative("routed_balance_coeff", "routing_kl_coeff")


@dataclass(frozen=True)
class LoRAConfig(Section):
    """LoRA settings; they travel with an adapter in its adapter_config.json."""

    section_name = "lora"

    rank: int = setting(8, flag="--lora-rank", help=f"r, the inner dimension of every adapter "
                                                    f"(1..{MAX_LORA_RANK})")
    alpha: float = setting(16.0, flag="--lora-alpha",
                           help="the LoRA branch is scaled by alpha / rank")
    dropout: float = setting(0.0, flag="--lora-dropout",
                             help="dropout on the LoRA input in training, 0 <= p < 1")
    targets: list[str] = setting(default_factory=lambda: list(DEFAULT_LORA_TARGETS),
                                 flag="--lora-target-modules",
                                 help="modules that get an adapter (see megatron_slmoe.lora.targets)")
    init_seed: int = setting(0, flag="--lora-init-seed",
                             help="seed of the initial LoRA A, drawn per global tensor name so "
                                  "every parallel layout starts from the same adapter")

    def validate(self) -> None:
        from megatron_slmoe.lora.targets import TARGETS

        self.check(1 <= self.rank <= MAX_LORA_RANK, "rank",
                   f"must be an integer in 1..{MAX_LORA_RANK}, got {self.rank}")
        self.check(self.alpha > 0 and self.alpha != float("inf"), "alpha",
                   f"must be a positive finite number, got {self.alpha}")
        self.check(0.0 <= self.dropout < 1.0, "dropout",
                   f"must be a number with 0 <= p < 1, got {self.dropout}")
        self.check(bool(self.targets), "targets", f"must name at least one of {', '.join(TARGETS)}")
        for target in self.targets:
            self.check(target in TARGETS, "targets",
                       f"names an unknown target {target!r}; the targets are {', '.join(TARGETS)}")
        self.check(len(set(self.targets)) == len(self.targets), "targets",
                   f"names a target twice: {' '.join(self.targets)}")
        self.check(self.init_seed >= 0, "init_seed", f"must be >= 0, got {self.init_seed}")

    @property
    def scaling(self) -> float:
        """s = alpha / rank."""
        return float(self.alpha) / self.rank


@dataclass(frozen=True)
class DataConfig(Section):
    """Training and held-out data, and the tokenizer."""

    section_name = "data"

    format: Literal["instruction", "pretrain"] = setting(
        "instruction", flag="--data-format",
        help="instruction JSON lines, or a Megatron indexed dataset for pretraining")
    train_data: Optional[str] = setting(
        None, flag="--train-data",
        help="instruction JSONL, or an indexed dataset prefix (default: the shipped demo data)")
    valid_data: Optional[str] = setting(None, flag="--valid-data", help="held-out data")
    tokenizer: Optional[str] = setting(
        None, flag="--tokenizer",
        help="tokenizer.json, or a Hugging Face checkpoint directory (tokenizer.json with the "
             "special tokens and chat template of tokenizer_config.json) (default: the "
             "--hf-checkpoint's, else the shipped one)")
    seq_length: int = setting(128, flag="--seq-length", help="tokens per sample")

    def validate(self) -> None:
        self.check_positive("seq_length")


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

    @property
    def train_samples(self) -> int:
        return self.train_iters * self.global_batch_size


@dataclass(frozen=True)
class MonitorConfig(Section):
    """The routing monitor's collapse detectors (see megatron_slmoe.moe.monitor)."""

    section_name = "monitor"

    window: int = setting(50, flag="--moe-monitor-window",
                          help="steps over which an expert without tokens counts as dead")
    starved_fraction: float = setting(
        0.1, flag="--moe-starved-fraction",
        help="an expert starves below this fraction of the fair share 1/E")
    starved_patience: int = setting(
        20, flag="--moe-starved-patience",
        help="checks in a row of starving before a warning (one check per step once steps "
             "route --moe-monitor-min-tokens tokens)")
    dominant_fraction: float = setting(
        0.5, flag="--moe-dominant-fraction",
        help="an expert dominates above this share of a step's assignments (1.0: off)")
    warmup_steps: int = setting(
        10, flag="--moe-monitor-warmup",
        help="steps before the collapse detectors judge (routing that is still settling, e.g. "
             "from a random initialisation, is not a collapse)")
    min_routed_tokens: int = setting(
        1024, flag="--moe-monitor-min-tokens",
        help="a check judges the steps since the previous one once they routed at least this "
             "many tokens (small steps are pooled, so no share is judged on a handful of tokens)")
    action: Literal["warn", "stop"] = setting(
        "warn", flag="--collapse-action", help="on routing collapse: warn, or stop the run")
    jsonl_path: Optional[str] = setting(
        None, flag="--moe-routing-jsonl",
        help="also append every step's routing record (all layers, all fields) to this file")
    drift_interval: int = setting(
        10, flag="--moe-drift-interval",
        help="with --finetune-mode lora: every N steps, each layer's routing drift from the base "
             "model's on a fixed held-out probe batch (KL, top-k overlap, load change; 0: off)")

    def validate(self) -> None:
        self.check_positive("window", "starved_patience")
        self.check_non_negative("warmup_steps", "min_routed_tokens", "drift_interval")
        self.check(0.0 <= self.starved_fraction < 1.0, "starved_fraction",
                   f"must be in [0, 1), got {self.starved_fraction}")
        # > 1/E is checked when the monitor attaches to a model and E is known.
        self.check(0.0 < self.dominant_fraction <= 1.0, "dominant_fraction",
                   f"must be in (0, 1], got {self.dominant_fraction}")
        self.check(self.jsonl_path is None or bool(self.jsonl_path), "jsonl_path",
                   "must be a non-empty path")


@dataclass(frozen=True)
class OutputConfig(Section):
    """Where the run writes, and how it resumes."""

    section_name = "output"

    output_dir: Optional[str] = setting(
        None, flag="--output-dir",
        help="everything the run writes (default: runs/<time>); a rerun resumes from it")
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
    export_hf_layout: Literal["per-expert", "fused"] = setting(
        "per-expert", flag="--export-hf-layout",
        help="routed experts in the --export-hf adapter: per-expert modules (vLLM) or PEFT "
             "target_parameters on transformers 5's fused 3D expert tensors")

    def validate(self) -> None:
        self.check_positive("keep_last")


@dataclass(frozen=True)
class RunConfig:
    """The whole run configuration: the sections in the order ``--print-config`` shows them."""

    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    moe: MoERunConfig = field(default_factory=MoERunConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

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


def validate_run(run: RunConfig, world_size: int) -> None:
    """The rules that span sections (each section has checked its own fields already)."""
    parallel, schedule = run.parallel, run.schedule
    tp, pp, ep = (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                  parallel.expert_model_parallel_size)
    if world_size % (tp * pp):
        raise ConfigError(f"world size {world_size} is not divisible by "
                          f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}")
    dp = world_size // (tp * pp)
    if (dp * tp) % ep:
        raise ConfigError(f"--expert-model-parallel-size {ep} must divide the {dp * tp} ranks "
                          f"of a pipeline stage (world {world_size} / PP {pp})")
    if schedule.global_batch_size % (schedule.micro_batch_size * dp):
        raise ConfigError(f"--global-batch-size {schedule.global_batch_size} is not a multiple of "
                          f"--micro-batch-size {schedule.micro_batch_size} x data-parallel size {dp}")
    if run.optimizer.lr_warmup_iters >= schedule.train_iters:
        raise ConfigError(f"--lr-warmup-iters {run.optimizer.lr_warmup_iters} must be below "
                          f"--train-iters {schedule.train_iters}")
    if run.output.export_hf and not (run.model.hf_checkpoint and run.model.finetune_mode == "lora"):
        raise ConfigError("--export-hf needs --hf-checkpoint and --finetune-mode lora")
    if run.output.save_base and run.model.finetune_mode != "full":
        raise ConfigError("--save-base needs --finetune-mode full")
    if run.moe.routing_kl_coeff > 0 and run.model.finetune_mode != "lora":
        raise ConfigError("--moe-routing-kl-coeff needs --finetune-mode lora (it keeps routing "
                          "near the frozen base model's)")
