"""Interleaved M-RoPE (model/mrope.py) against transformers' Qwen3-VL-MoE text rotary: the same
cos/sin for random 3D positions; with equal positions on the three axes, Megatron-Core's 1D
RotaryEmbedding."""

import torch

from megatron_slmoe.model.mrope import InterleavedMRoPE


def _qwen3_vl_rotary(head_dim: int, sections, theta: float):
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
        Qwen3VLMoeTextRotaryEmbedding,
    )

    config = Qwen3VLMoeTextConfig(
        hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": theta,
                         "mrope_section": list(sections), "mrope_interleaved": True})
    return Qwen3VLMoeTextRotaryEmbedding(config)


def test_equals_transformers_qwen3_vl_rotary():
    head_dim, sections, theta = 16, [2, 3, 3], 5000.0
    theirs = _qwen3_vl_rotary(head_dim, sections, theta)
    ours = InterleavedMRoPE(head_dim, rotary_base=theta)
    positions = torch.randint(0, 50, (3, 2, 7))
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions)  # [b, s, dim]
    emb = ours(positions, sections)  # [s, b, 1, dim]
    assert emb.shape == (7, 2, 1, head_dim)
    torch.testing.assert_close(emb.squeeze(2).transpose(0, 1).cos(), cos, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(emb.squeeze(2).transpose(0, 1).sin(), sin, rtol=1e-6, atol=1e-6)


def test_equal_positions_are_1d_rope():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    ours = InterleavedMRoPE(16, rotary_base=10000.0)
    one_d = RotaryEmbedding(16, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)
    positions = torch.arange(9)[None].expand(2, -1)
    assert torch.equal(ours(positions, [2, 3, 3])[:, :1], one_d(9))
