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
        help="Megatron dist checkpoint with the base weights, a directory or an s3:// / msc:// "
             "prefix (default: random initialisation)")
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
        help="start from this adapter (a directory or an s3:// / msc:// prefix) instead of fresh "
             "LoRA weights: one a run saved, "
             "or a PEFT adapter of the --hf-checkpoint base (its rank, alpha and targets are taken)")
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
        check_locations(self, "base_checkpoint", "adapter_init")
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

    task: Literal["text", "image-text"] = setting(
        "text", flag="--task",
        help="image-text: the multimodal model (a vision tower and projector before this language "
             "model, see the vision and image_text sections) on energon image-text datasets "
             "(default data: the synthetic shapes task; captions with --data-format pretrain)")
    format: Literal["instruction", "pretrain"] = setting(
        "instruction", flag="--data-format",
        help="instruction JSON lines, or a Megatron indexed dataset for pretraining")
    train_data: Optional[str] = setting(
        None, flag="--train-data",
        help="instruction JSONL, an indexed dataset prefix, or an energon dataset folder for "
             "--task image-text (default: the shipped demo data); instruction and pretraining "
             "data may be an s3:// / msc:// URL, where one ending in '/' means every *.jsonl (or "
             "every *.idx/*.bin pair) under it, in key order")
    valid_data: Optional[str] = setting(
        None, flag="--valid-data",
        help="held-out data, a path or URL as --train-data (needed with instruction --train-data: "
             "the shipped demo set is no measure of your task; pretraining data holds out 5%% of "
             "its documents instead)")
    tokenizer: Optional[str] = setting(
        None, flag="--tokenizer",
        help="tokenizer.json (a path or an s3:// / msc:// URL), or a Hugging Face checkpoint "
             "directory (tokenizer.json with the special tokens and chat template of "
             "tokenizer_config.json) (default: the --hf-checkpoint's, else the shipped one)")
    seq_length: int = setting(128, flag="--seq-length", help="tokens per sample")
    max_malformed_fraction: float = setting(
        0.1, flag="--max-malformed-fraction",
        help="stop when more than this share of an instruction file's records is malformed "
             "(they are skipped and counted up to it)")

    def validate(self) -> None:
        self.check_positive("seq_length")
        check_locations(self, "train_data", "valid_data", "tokenizer")
        self.check(0.0 <= self.max_malformed_fraction < 1.0, "max_malformed_fraction",
                   f"must be in [0, 1), got {self.max_malformed_fraction}")


CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGE_TOKEN = "<image>"
"""Where an image goes in the text of an image-text sample."""


@dataclass(frozen=True)
class VisionConfig(Section):
    """The vision tower and projector of --task image-text (the defaults: the CPU demo's)."""

    section_name = "vision"

    model_type: Literal["clip", "siglip"] = setting(
        "clip", flag="--vision-model-type",
        help="clip (class token, ln_pre) or siglip (no class token, ln_post)")
    img_h: int = setting(32, flag="--img-h",
                         help="image (tile) height in pixels; a multiple of --patch-dim")
    img_w: int = setting(32, flag="--img-w",
                         help="image (tile) width in pixels; a multiple of --patch-dim")
    patch_dim: int = setting(16, flag="--patch-dim",
                             help="side of the square patches the tower embeds")
    num_layers: int = setting(2, flag="--vision-num-layers", help="ViT transformer layers")
    hidden_size: int = setting(64, flag="--vision-hidden-size", help="ViT width")
    num_attention_heads: int = setting(4, flag="--vision-num-attention-heads",
                                       help="ViT attention heads (divisible by TP)")
    ffn_hidden_size: int = setting(128, flag="--vision-ffn-hidden-size",
                                   help="ViT MLP width (divisible by TP)")
    activation: Literal["quick_gelu", "gelu", "gelu_tanh"] = setting(
        "quick_gelu", flag="--vision-activation",
        help="ViT MLP activation: quick_gelu (OpenAI CLIP), gelu, gelu_tanh (SigLIP)")
    layernorm_epsilon: float = setting(1e-5, flag="--vision-layernorm-epsilon",
                                       help="epsilon of the ViT LayerNorms")
    drop_class_token: bool = setting(
        True, flag="--vision-drop-class-token",
        help="drop the class token before the projector (LLaVA's choice; clip only)")
    projector_type: Literal["mlp", "affine"] = setting(
        "mlp", flag="--vision-projection-type",
        help="mlp (fc1 -> GELU -> fc2) or affine (one linear)")
    projector_ffn_hidden_size: int = setting(
        128, flag="--vision-projection-ffn-hidden-size",
        help="inner width of the mlp projector (divisible by TP)")
    image_token_index: int = setting(
        -200, flag="--image-token-index",
        help="token id that marks where an image goes (negative: outside every vocabulary)")
    checkpoint: Optional[str] = setting(
        None, flag="--vision-checkpoint",
        help="Hugging Face CLIP/SigLIP folder (config.json + safetensors) whose vision tower "
             "weights replace the model's (after --base-checkpoint, if any); its architecture "
             "must match this section")

    def validate(self) -> None:
        self.check_positive("img_h", "img_w", "patch_dim", "num_layers", "hidden_size",
                            "num_attention_heads", "ffn_hidden_size",
                            "projector_ffn_hidden_size", "layernorm_epsilon")
        for name in ("img_h", "img_w"):
            self.check(getattr(self, name) % self.patch_dim == 0, name,
                       f"must be a multiple of --patch-dim {self.patch_dim}, got "
                       f"{getattr(self, name)}")
        self.check(self.hidden_size % self.num_attention_heads == 0, "num_attention_heads",
                   f"must divide --vision-hidden-size {self.hidden_size}, got "
                   f"{self.num_attention_heads}")
        self.check(not (self.model_type == "siglip" and self.drop_class_token), "drop_class_token",
                   "must be off for siglip (it has no class token): --no-vision-drop-class-token")
        self.check(self.image_token_index < 0, "image_token_index",
                   f"must be negative (outside every vocabulary), got {self.image_token_index}")
        self.check(self.checkpoint is None or bool(self.checkpoint), "checkpoint",
                   "must be a non-empty path")

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        """The tower and projector split heads and MLP columns over the TP ranks."""
        for name in ("num_attention_heads", "ffn_hidden_size", "projector_ffn_hidden_size"):
            self.check(getattr(self, name) % tensor_parallel == 0, name,
                       f"must be divisible by --tensor-model-parallel-size {tensor_parallel}, "
                       f"got {getattr(self, name)}")

    @property
    def class_token_len(self) -> int:
        return 1 if self.model_type == "clip" else 0

    @property
    def num_image_embeddings(self) -> int:
        """Language-model positions one image tile occupies."""
        patches = (self.img_h // self.patch_dim) * (self.img_w // self.patch_dim)
        return patches + (0 if self.drop_class_token else self.class_token_len)


@dataclass(frozen=True)
class ImageTextConfig(Section):
    """Images and evaluation of --task image-text."""

    section_name = "image_text"

    max_tiles: int = setting(1, flag="--max-num-tiles",
                             help="tiles per image (1: the whole image resized; more: tiled by "
                                  "aspect ratio)")
    thumbnail: bool = setting(False, flag="--use-thumbnail",
                              help="with tiling, add the whole image as one more tile")
    image_mean: list[float] = setting(default_factory=lambda: list(CLIP_MEAN),
                                      flag="--image-mean",
                                      help="per-channel normalisation mean (3 numbers)")
    image_std: list[float] = setting(default_factory=lambda: list(CLIP_STD), flag="--image-std",
                                     help="per-channel normalisation standard deviation")
    train_vision_tower: bool = setting(
        False, flag="--train-vision-tower",
        help="with --finetune-mode full, train the vision tower too (by default it stays as "
             "built or loaded, as in LLaVA's recipes; the projector and language model train)")
    caption_prompt: str = setting(f"{IMAGE_TOKEN}\nDescribe the image.", flag="--caption-prompt",
                                  help="the user turn of captioning samples")
    eval_answers: int = setting(
        128, flag="--eval-answers",
        help="held-out prompts answered by greedy generation for the exact-match answer "
             "accuracy before and after training (0: none)")
    max_answer_tokens: int = setting(8, flag="--max-answer-tokens",
                                     help="most tokens generated per answer")

    def validate(self) -> None:
        self.check_positive("max_tiles", "max_answer_tokens")
        self.check_non_negative("eval_answers")
        self.check(not self.thumbnail or self.max_tiles > 1, "thumbnail",
                   "needs --max-num-tiles > 1")
        for name in ("image_mean", "image_std"):
            self.check(len(getattr(self, name)) == 3, name,
                       f"must be 3 numbers (R G B), got {getattr(self, name)}")
        self.check(min(self.image_std) > 0, "image_std",
                   f"must be positive, got {self.image_std}")
        self.check(IMAGE_TOKEN in self.caption_prompt, "caption_prompt",
                   f"must contain {IMAGE_TOKEN}, got {self.caption_prompt!r}")


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
    export_hf_layout: Literal["per-expert", "fused"] = setting(
        "per-expert", flag="--export-hf-layout",
        help="routed experts in the --export-hf adapter: per-expert modules (vLLM) or PEFT "
             "target_parameters on transformers 5's fused 3D expert tensors")
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
class StorageConfig(Section):
    """Object storage (s3:// and msc:// URLs) and the node-local cache. Credentials are not
    settings: they come from the environment or a profile file (see megatron_slmoe.storage)."""

    section_name = "storage"

    cache_dir: Optional[str] = setting(
        None, flag="--cache-dir",
        help="node-local directory (NVMe) of the object cache, shared by the ranks of a node "
             "(default: $SLMOE_CACHE_DIR, else a directory under /tmp)")
    cache_max_gb: float = setting(
        200.0, flag="--cache-max-gb",
        help="size bound of the cache; the least recently used objects are evicted beyond it")
    cache_revalidate_seconds: float = setting(
        60.0, flag="--cache-revalidate-seconds",
        help="a cached object whose ETag and size were checked against the store this recently "
             "is used without asking again (0: check on every open)")
    prefetch_shards: int = setting(
        2, flag="--prefetch-shards",
        help="data shards downloaded in the background ahead of the reader")
    retry_timeout_seconds: float = setting(
        1800.0, flag="--storage-retry-timeout",
        help="how long one storage operation retries transient errors (endpoint down, HTTP 5xx, "
             "timeouts) before the run fails; a run stalls meanwhile")
    retry_backoff_seconds: float = setting(
        0.5, flag="--storage-retry-backoff",
        help="first retry delay; it doubles up to 30 s")
    preflight_timeout_seconds: float = setting(
        20.0, flag="--storage-preflight-timeout",
        help="how long the start-up check of every object-storage URL retries before it refuses "
             "the run")

    def validate(self) -> None:
        check_locations(self, "cache_dir", local_only=True)
        self.check(self.cache_dir is None or bool(self.cache_dir), "cache_dir",
                   "must be a non-empty path")
        self.check_positive("cache_max_gb", "retry_timeout_seconds", "retry_backoff_seconds",
                            "preflight_timeout_seconds")
        self.check_non_negative("cache_revalidate_seconds", "prefetch_shards")


def check_locations(section: Section, *names: str, local_only: bool = False,
                    url_only: bool = False) -> None:
    """Fields that name a local path or an ``s3://`` / ``msc://`` URL: a URL must be well formed
    and carry no credentials (they come from the environment or a profile, never from a setting,
    so none reaches config.yaml); ``local_only`` / ``url_only`` fields take just one kind."""
    from megatron_slmoe.storage.urls import SCHEMES, is_object_url, parse_url

    for name in names:
        value = getattr(section, name)
        if value is None:
            continue
        if is_object_url(value):
            section.check(not local_only, name, f"{value} must be a local path")
            try:
                parse_url(value)
            except ValueError as err:
                section.fail(name, str(err))
        else:
            section.check(not url_only, name, f"{value}: expected an "
                                              f"{' or '.join(s + '://' for s in SCHEMES)} URL")


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
    if run.data.task == "image-text":
        if run.model.hf_checkpoint:
            raise ConfigError("--hf-checkpoint loads a language model; with --task image-text "
                              "start from --base-checkpoint (the tower: --vision-checkpoint)")
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
