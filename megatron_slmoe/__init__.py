"""megatron_slmoe: LoRA fine-tuning of Stable Latent MoE models on Megatron-Core.

Importing the package applies the adaptor for the detected platform (see ``megatron_slmoe.platform``).
"""

from megatron_slmoe.platform import apply_adaptor as _apply_adaptor

__version__ = "0.1.0"

PLATFORM = _apply_adaptor()
