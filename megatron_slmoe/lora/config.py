"""The LoRA section; it travels with an adapter in its adapter_config.json. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_slmoe.config.schema import Section, setting


MAX_LORA_RANK = 256
EXPERT_LAYOUTS = ("per-expert", "shared-outer")
"""How LoRA on the routed experts is factored (megatron_slmoe.lora.experts): every expert its
own A and B, or one A per gate/up input and one B on the down output shared by the experts of a
layer with per-expert factors inside (SGLang's experts_shared_outer_loras)."""
DEFAULT_LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
TARGET_NAMES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "shared_experts", "router",
                "latent", "vision_attention", "projector")
"""The LoRA target names, in the order messages list them (megatron_slmoe.lora.targets maps each
to the modules it adapts)."""


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
    expert_rank: int = setting(0, flag="--expert-lora-rank",
                               help="r of the routed experts' adapters (0: --lora-rank, or "
                                    "--lora-rank // top-k with --moe-rank-scaling); alpha is "
                                    "kept, so their scale is alpha / this rank")
    moe_rank_scaling: bool = setting(False, flag="--moe-rank-scaling",
                                     help="give the routed experts rank --lora-rank // top-k "
                                          "(NeMo AutoModel's moe_rank_scaling; alpha kept)")
    expert_layout: str = setting("per-expert", flag="--expert-lora-layout",
                                 help="the routed experts' adapter: per-expert (each expert its "
                                      "own A and B) or shared-outer (one A on the gate/up input "
                                      "and one B on the down output shared by a layer's experts, "
                                      "per-expert factors inside; SGLang's "
                                      "experts_shared_outer_loras)")

    def validate(self) -> None:
        self.check(1 <= self.rank <= MAX_LORA_RANK, "rank",
                   f"must be an integer in 1..{MAX_LORA_RANK}, got {self.rank}")
        self.check(self.alpha > 0 and self.alpha != float("inf"), "alpha",
                   f"must be a positive finite number, got {self.alpha}")
        self.check(0.0 <= self.dropout < 1.0, "dropout",
                   f"must be a number with 0 <= p < 1, got {self.dropout}")
        self.check(bool(self.targets), "targets",
                   f"must name at least one of {', '.join(TARGET_NAMES)}")
        for target in self.targets:
            self.check(target in TARGET_NAMES, "targets",
                       f"names an unknown target {target!r}; the targets are "
                       f"{', '.join(TARGET_NAMES)}")
        self.check(len(set(self.targets)) == len(self.targets), "targets",
                   f"names a target twice: {' '.join(self.targets)}")
        self.check(self.init_seed >= 0, "init_seed", f"must be >= 0, got {self.init_seed}")
        self.check(0 <= self.expert_rank <= MAX_LORA_RANK, "expert_rank",
                   f"must be an integer in 1..{MAX_LORA_RANK} (0: the dense rank), got "
                   f"{self.expert_rank}")
        self.check(not (self.expert_rank and self.moe_rank_scaling), "expert_rank",
                   "and --moe-rank-scaling both set the experts' rank; give one")
        self.check(self.expert_layout in EXPERT_LAYOUTS, "expert_layout",
                   f"must be one of {', '.join(EXPERT_LAYOUTS)}, got {self.expert_layout!r}")

    def expert_rank_for(self, top_k: int) -> int:
        """The routed experts' rank in a model routing each token to ``top_k`` experts; one
        ValueError line when --moe-rank-scaling cannot give a whole rank of at least 1."""
        if self.expert_rank:
            return self.expert_rank
        if not self.moe_rank_scaling:
            return self.rank
        if self.rank < top_k:
            raise ValueError(f"--moe-rank-scaling: --lora-rank {self.rank} // top-k {top_k} is "
                             f"below 1; raise --lora-rank to at least {top_k} or give "
                             f"--expert-lora-rank")
        if self.rank % top_k:
            raise ValueError(f"--moe-rank-scaling: --lora-rank {self.rank} does not divide by "
                             f"the top-k {top_k}; take a multiple of {top_k} or give "
                             f"--expert-lora-rank")
        return self.rank // top_k

    def scaling_for(self, rank: int) -> float:
        """A module's s = alpha / its rank (alpha is one for all modules)."""
        return float(self.alpha) / rank

    @property
    def scaling(self) -> float:
        """s = alpha / rank."""
        return float(self.alpha) / self.rank
