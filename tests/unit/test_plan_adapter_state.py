"""The planner's price of LoRA on the routed experts by layout and rank (issue 42 item 3): Kimi K3's
counts against hand counts from its tensor table (/work/shared/KIMI_K3.md), Kimi-K2.5 and
DeepSeek-V3 at ranks 2-32, and the count and state bytes measured on a built Megatron model with
an Adam step."""

import pytest
import torch

from megatron_slmoe.plan.adapter_state import (
    ExpertDims,
    adapter_state_bytes,
    expert_adapter_count,
    rank_table,
)
from megatron_slmoe.plan.model_shape import load_shape
from tests.helpers import hf_models

# Published configs: MoE layers, routed experts, hidden size, moe_intermediate_size.
DEEPSEEK_V3 = ExpertDims(61 - 3, 256, 7168, 2048)
KIMI_K25 = ExpertDims(61 - 1, 384, 7168, 2048)


def test_kimi_k3_at_rank_8():
    dims = ExpertDims.of(load_shape("kimi-k3"))
    experts, latent, ffn = 92 * 896, 3584, 3072  # 93 layers, the first dense; the tensor table
    assert dims.moe_layers * dims.experts == experts == 82_432
    # PEFT / vLLM per-expert modules w1, w3, w2 at rank 8: (3584 + 3072) * 8 * 3 each.
    peft = expert_adapter_count(dims, 8, "per-expert", separate_gate_up=True)
    assert peft.total == experts * 19_968 * 8 and round(peft.total / 1e9, 1) == 13.2
    # As held here: fc1 one LoRA on [gate; up] (one A), fc2 one LoRA.
    ours = expert_adapter_count(dims, 8, "per-expert")
    assert ours.total == experts * 8 * ((latent + 2 * ffn) + (ffn + latent))
    # Shared-outer (SGLang / miles): per expert the gate's and up's B [f, r] and the down's A
    # [r, f]; per layer the gate's and up's A [r, l] and the down's B [l, r].
    shared = expert_adapter_count(dims, 8, "shared-outer")
    assert shared.total == experts * 3 * ffn * 8 + 92 * 3 * latent * 8
    assert round(shared.total / 1e9, 1) == 6.1
    # Per EP rank over 64: 1/64 of the experts' own factors, every shared factor.
    assert shared.per_ep_rank(64) == 92 * (896 // 64 * 3 * ffn * 8 + 3 * latent * 8)


@pytest.mark.parametrize("dims", [DEEPSEEK_V3, KIMI_K25], ids=["deepseek-v3", "kimi-k2.5"])
def test_other_models_at_ranks_2_to_32(dims):
    rows = rank_table(dims, ranks=(2, 4, 8, 16, 32), ep=8)
    by = {(row["layout"], row["rank"]): row for row in rows}
    experts = dims.moe_layers * dims.experts
    for rank in (2, 4, 8, 16, 32):
        per_expert, shared = by["per-expert", rank], by["shared-outer", rank]
        assert per_expert["trainable_params"] == experts * rank * (2 * 7168 + 3 * 2048)
        assert shared["trainable_params"] == (experts * 3 * 2048 * rank
                                              + dims.moe_layers * 3 * 7168 * rank)
        # bf16 weights: 2 + 4 (fp32 gradient) + 8 (Adam) + 4 (fp32 main copy) bytes each.
        assert per_expert["state_bytes_per_ep_rank"] == 18 * per_expert["params_per_ep_rank"]
    with pytest.raises(ValueError, match="expert layout 'fused' is not one of"):
        expert_adapter_count(dims, 8, "fused")


@pytest.mark.usefixtures("megatron_single_rank")
@pytest.mark.parametrize("rank,layout", [(2, "per-expert"), (8, "per-expert"),
                                         (8, "shared-outer")])
def test_measured_on_a_built_model(tmp_path, rank, layout):
    """LoRA on the experts of a built tiny Qwen3-MoE, in either expert layout: its parameters
    and, after one Adam step on fp32 adapters, the bytes of weights, gradients and Adam's moments
    equal the price."""
    from megatron_slmoe.hf.convert import build_model_in_layout
    from megatron_slmoe.hf.loader import open_hf_checkpoint
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.inject import inject_lora

    hf_models.save_family("qwen3_moe", str(tmp_path / "hf"), mlp_only_layers=[])
    hf = open_hf_checkpoint(str(tmp_path / "hf"), check_shapes=False)
    model, _ = build_model_in_layout(hf.model_config)
    inject_lora([model], LoRAConfig(rank=rank, targets=["linear_fc1", "linear_fc2"],
                                    expert_layout=layout))
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    assert all(".experts." in n for n, p in model.named_parameters() if p.requires_grad)
    dims = ExpertDims(2, hf_models.EXPERTS, hf_models.HIDDEN, 16)
    count = expert_adapter_count(dims, rank, layout)
    assert sum(p.numel() for p in params) == count.total
    optimizer = torch.optim.Adam(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    measured = sum(t.untyped_storage().nbytes() for p in params
                   for t in (p, p.grad, *(v for v in optimizer.state[p].values()
                                          if torch.is_tensor(v) and v.dim() > 0)))
    expected = adapter_state_bytes(count, ep=1, element_size=4)
    assert abs(measured - expected) <= 0.05 * expected
