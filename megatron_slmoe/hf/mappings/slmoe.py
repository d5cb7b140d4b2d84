"""Placeholder, replaced below."""
from megatron_slmoe.hf.mappings.family import Family


class StableLatentMoeFamily(Family):
    name = "stable_latent_moe"
    architectures = ("StableLatentMoeForCausalLM",)
