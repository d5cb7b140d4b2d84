"""Text generation with Megatron-Core's GPTModel and its KV cache, in any parallel layout
(``generator``), and answering a set of prompts across data-parallel replicas (``answers``)."""

from megatron_slmoe.inference.generator import TextGenerator
from megatron_slmoe.inference.sampling import SamplingConfig

__all__ = ["SamplingConfig", "TextGenerator"]
