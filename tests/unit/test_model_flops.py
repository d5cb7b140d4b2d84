"""Model FLOPs per training token (plan.flops, the numerator of MFU) against a count by hand for
Qwen3-30B-A3B's layer, as Megatron-LM counts them: 2 per multiply-add, 3x forward for trained
weights, 2x for frozen ones, 3x for core attention and the adapters."""

import pytest

from megatron_slmoe.plan.flops import token_flops
from megatron_slmoe.plan.model_shape import ModelShape

H, HEADS, KV, HEAD_DIM, E, K, F, V, L, S = 2048, 32, 4, 128, 128, 8, 768, 151936, 2, 1024


@pytest.fixture(scope="module")
def shape():
    from megatron_slmoe.model.model_file import ModelConfig

    transformer = dict(num_layers=L, hidden_size=H, num_attention_heads=HEADS,
                       num_query_groups=KV, kv_channels=HEAD_DIM, ffn_hidden_size=6144,
                       num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=F,
                       gated_linear_unit=True, normalization="RMSNorm", qk_layernorm=True,
                       add_bias_linear=False)
    return ModelShape.from_config(ModelConfig(name="qwen3-like", source="test",
                                              transformer=transformer, vocab_size=V,
                                              max_sequence_length=4096))


def test_forward_matrices_and_attention_by_hand(shape):
    flops = token_flops(shape, S, full_finetune=True)
    attention = H * (HEADS + 2 * KV) * HEAD_DIM + HEADS * HEAD_DIM * H
    experts = K * 3 * H * F
    router = E * H
    assert flops.matrices == 2 * (L * (attention + experts + router) + V * H)
    assert flops.core_attention == L * 2 * 2 * HEADS * HEAD_DIM * S / 2
    assert flops.training == 3 * (flops.matrices + flops.core_attention)  # full: all trained


def test_lora_counts_frozen_weights_twice_and_adapters_three_times(shape):
    r = 16
    flops = token_flops(shape, S, r, ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
    q, kv = HEADS * HEAD_DIM, KV * HEAD_DIM
    # Megatron's fused QKV is one linear (one A [r, H], one B [q + 2kv, r]); proj: A [r, q] B [H, r]
    attention_lora = r * (H + q + 2 * kv) + r * (q + H)
    expert_lora = K * r * ((H + 2 * F) + (F + H))  # the token's top-k experts only
    assert flops.lora == 2 * L * (attention_lora + expert_lora)
    assert flops.training == 2 * flops.matrices + 3 * flops.core_attention + 3 * flops.lora
