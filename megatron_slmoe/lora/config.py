"""The LoRA section; it travels with an adapter in its adapter_config.json. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_slmoe.config.schema import Section, setting


MAX_LORA_RANK = 256
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

    @property
    def scaling(self) -> float:
        """s = alpha / rank."""
        return float(self.alpha) / self.rank
