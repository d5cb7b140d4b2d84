"""Qwen3-VL-MoE: the family (``family``), its tower with DeepStack mergers and its 3D rotary
positions (``vision``)."""
