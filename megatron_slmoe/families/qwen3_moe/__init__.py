"""Qwen3-MoE: its config reading and tensor table (``family``)."""
