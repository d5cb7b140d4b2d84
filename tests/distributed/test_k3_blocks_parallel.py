"""K3's blocks split over ranks equal the K3 reference (tests/helpers/kimi_k3_reference.py) on
the whole weights: gated NoPE MLA and the SiTU dense MLP under TP=2 with sequence parallelism
(heads, the output gate and the GLU halves split per rank), and the latent MoE layer with SiTU
experts, the latent RMSNorm and the selection-only expert bias under EP=2 (each rank its own
tokens, the experts split over the ranks)."""

import torch

from tests.helpers import kimi_k3_reference as R
from tests.helpers.ranks import run_ranks

HIDDEN, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V, FFN = 32, 4, 24, 16, 8, 4, 8, 40
EXPERTS, TOPK, MOE_FFN, SHARED, LATENT = 6, 2, 12, 24, 16
SEQ, BATCH = 8, 2


def _references():
    mla = R.GatedNoPEMLA(HIDDEN, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V)
    R.randomise_(mla, 0, gain=1.5)
    mlp = R.GatedMLP(HIDDEN, FFN)
    R.randomise_(mlp, 1, gain=3.0)
    moe = R.LatentMoE(HIDDEN, EXPERTS, TOPK, MOE_FFN, SHARED // MOE_FFN, latent_size=LATENT)
    R.randomise_(moe, 2, gain=2.0)
    return mla, mlp, moe


def _config(**fields):
    from megatron.core import parallel_state

    from megatron_slmoe.model.validation import make_transformer_config
    from megatron_slmoe.ops.activations import SiTUGLU

    tp = parallel_state.get_tensor_model_parallel_world_size()
    base = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        gated_linear_unit=True, activation_func=SiTUGLU(), add_bias_linear=False,
        normalization="RMSNorm", layernorm_epsilon=1e-5, use_cpu_initialization=True,
        params_dtype=torch.float32, attention_dropout=0.0, hidden_dropout=0.0,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=1)
    base.update(fields)
    return make_transformer_config(base)


def _shard(full: torch.Tensor, dim: int) -> torch.Tensor:
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    return full.chunk(tp, dim=dim)[rank]


def _tp_case(x_SBH):
    """Rank's sequence slice of the gated MLA's and the SiTU MLP's outputs."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec
    from megatron.core.transformer.spec_utils import build_module

    from megatron_slmoe.model.gated_nope_mla import gated_nope_mla_spec
    from megatron_slmoe.moe.specs import get_slmoe_decoder_block_spec

    mla_ref, mlp_ref, _ = _references()
    config = _config(multi_latent_attention=True, q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA,
                     qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE, v_head_dim=V, rope_type="rope",
                     qk_layernorm=True)
    spec = get_slmoe_decoder_block_spec(config).layer_specs[0].submodules.self_attention
    mla = build_module(gated_nope_mla_spec(spec), config=config, layer_number=1)
    column = {"linear_q_down_proj": "q_a_proj", "linear_q_up_proj": "q_b_proj",
              "linear_kv_down_proj": "kv_a_proj_with_mqa", "linear_kv_up_proj": "kv_b_proj",
              "linear_gate": "g_proj"}
    with torch.no_grad():
        for ours, theirs in column.items():
            getattr(mla, ours).weight.copy_(_shard(getattr(mla_ref, theirs).weight, 0))
        mla.linear_proj.weight.copy_(_shard(mla_ref.o_proj.weight, 1))
        mla.q_layernorm.weight.copy_(mla_ref.q_a_layernorm.weight)
        mla.kv_layernorm.weight.copy_(mla_ref.kv_a_layernorm.weight)

    mlp = build_module(get_mlp_module_spec(use_te=False), config=_config())
    with torch.no_grad():
        mlp.linear_fc1.weight.copy_(torch.cat([_shard(mlp_ref.gate_proj.weight, 0),
                                               _shard(mlp_ref.up_proj.weight, 0)]))
        mlp.linear_fc2.weight.copy_(_shard(mlp_ref.down_proj.weight, 1))
    x_local = _shard(x_SBH, 0)  # sequence parallelism: this rank's slice of the sequence
    with torch.no_grad():
        return (parallel_state.get_tensor_model_parallel_rank(), mla(x_local, None)[0],
                mlp(x_local)[0])


def test_tp2_gated_mla_and_situ_mlp_equal_the_reference():
    x_SBH = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(5))
    results = run_ranks(_tp_case, 2, tp=2, etp=1, x_SBH=x_SBH)
    mla_ref, mlp_ref, _ = _references()
    with torch.no_grad():
        mla_expected = mla_ref(x_SBH.transpose(0, 1)).transpose(0, 1)
        mlp_expected = mlp_ref(x_SBH)
    for rank, mla_out, mlp_out in results:
        rows = slice(rank * SEQ // 2, (rank + 1) * SEQ // 2)
        torch.testing.assert_close(mla_out, mla_expected[rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mlp_out, mlp_expected[rows], rtol=1e-5, atol=1e-5)


def _ep_case(x_by_rank):
    """This rank's MoE output for its own tokens, the experts split over the EP ranks."""
    import torch.distributed as dist
    from megatron.core.transformer.spec_utils import build_module

    from megatron_slmoe.moe.config import SLMoEConfig
    from megatron_slmoe.moe.specs import get_slmoe_decoder_block_spec

    _, _, moe_ref = _references()
    config = _config(num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=MOE_FFN,
                     moe_latent_size=LATENT, moe_shared_expert_intermediate_size=SHARED,
                     moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                     moe_router_dtype="fp32")
    spec = get_slmoe_decoder_block_spec(config, SLMoEConfig(latent_norm=True))
    layer = build_module(spec.layer_specs[0].submodules.mlp, config=config, layer_number=1)
    layer.set_layer_number(1)
    layer.eval()
    with torch.no_grad():
        layer.router.weight.copy_(moe_ref.gate.weight)
        layer.router.expert_bias.copy_(moe_ref.gate.e_score_correction_bias)
        layer.latent_down.weight.copy_(moe_ref.routed_expert_down_proj.weight)
        layer.latent_up.weight.copy_(moe_ref.routed_expert_up_proj.weight)
        layer.latent_norm.weight.copy_(moe_ref.routed_expert_norm.weight)
        for local, e in enumerate(layer.local_expert_indices):
            expert = moe_ref.experts[e]
            layer.experts.fc1_weight[local].copy_(torch.cat([expert.w1.weight,
                                                             expert.w3.weight]))
            layer.experts.fc2_weight[local].copy_(expert.w2.weight)
        shared = moe_ref.shared_experts
        layer.shared_experts.linear_fc1.weight.copy_(torch.cat([shared.gate_proj.weight,
                                                                shared.up_proj.weight]))
        layer.shared_experts.linear_fc2.weight.copy_(shared.down_proj.weight)
        rank = dist.get_rank()
        return rank, list(layer.local_expert_indices), layer(x_by_rank[rank])[0]


def test_ep2_latent_moe_layer_equals_the_reference():
    gen = torch.Generator().manual_seed(6)
    x_by_rank = [torch.randn(SEQ, BATCH, HIDDEN, generator=gen) * 2 for _ in range(2)]
    results = run_ranks(_ep_case, 2, ep=2, etp=1, x_by_rank=x_by_rank)
    _, _, moe_ref = _references()
    assert sorted(e for _, experts, _ in results for e in experts) == list(range(EXPERTS))
    with torch.no_grad():
        for rank, _, out in results:
            torch.testing.assert_close(out, moe_ref(x_by_rank[rank]), rtol=1e-5, atol=1e-5)
