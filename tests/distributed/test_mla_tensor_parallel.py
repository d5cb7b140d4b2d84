"""Multi-latent attention's gradients under tensor parallelism (moe.specs.TensorParallelMLA):
with Megatron-Core's local column-parallel kv down-projection, each TP rank's gradient of the
shared rope key was a partial sum that its gather's backward dropped, so every MLA layer's input
gradient was a few percent off under TP=2 (and 16-24% at the first layer of a 2-layer model)
while the logits were right. DeepSeek-V3 (Megatron's MLA) and Kimi K3 (gated NoPE MLA among KDA
layers) imported under TP=2 with sequence parallelism give the gradients of one rank: every
norm weight's (and the mixes' of K3's Attention Residuals), summed over TP as Megatron's
finalize_model_grads sums them, for a loss on the full-vocabulary logits."""

import pytest
import torch

from tests.helpers import hf_models
from tests.helpers import kimi_k3_reference as k3ref
from tests.helpers.ranks import run_ranks


def _norm_grads(hf_dir: str, input_ids: torch.Tensor, weights: torch.Tensor) -> dict:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from megatron_slmoe.hf.convert import build_model_in_layout
    from megatron_slmoe.hf.loader import load_hf_weights, open_hf_checkpoint

    hf = open_hf_checkpoint(hf_dir, check_shapes=False)
    model, _ = build_model_in_layout(hf.model_config)
    load_hf_weights([model], hf_dir, hf)
    position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    logits = model(input_ids, position_ids, None)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:
        logits = gather_from_tensor_model_parallel_region(logits)
    (logits.float() * weights).sum().backward()
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is not None and ("norm" in name or "res." in name):
            grad = param.grad.clone()
            if tp > 1 and getattr(param, "sequence_parallel", False):
                torch.distributed.all_reduce(
                    grad, group=parallel_state.get_tensor_model_parallel_group())
            grads[name] = grad
    return grads


def _deepseek(root):
    hf_models.save_family("deepseek_v3", str(root))
    return str(root), hf_models.VOCAB, 8


def _kimi_k3(root):
    config = k3ref.tiny_config(num_hidden_layers=6, full_attn_layers=[2, 4, 6],
                               kda_layers=[1, 3, 5])
    hf_models.save_kimi_k3(k3ref.round_experts_to_mxfp4_(k3ref.build(config)), root)
    return str(root), config.vocab_size, 12


@pytest.mark.parametrize("make", [_deepseek, _kimi_k3], ids=["deepseek_v3", "kimi_k3"])
def test_tp2_gradients_equal_one_rank(tmp_path, make):
    hf_dir, vocab, seq = make(tmp_path / "hf")
    input_ids = hf_models.tokens(batch=2, seq=seq) % vocab
    weights = torch.randn(2, seq, vocab, generator=torch.Generator().manual_seed(0))
    (expected,) = run_ranks(_norm_grads, 1, hf_dir=hf_dir, input_ids=input_ids, weights=weights)
    got = run_ranks(_norm_grads, 2, tp=2, etp=1, hf_dir=hf_dir, input_ids=input_ids,
                    weights=weights)[0]
    assert set(got) == set(expected) and any("input_layernorm" in n for n in expected)
    for name, grad in expected.items():
        error = ((got[name] - grad).norm() / grad.norm()).item()
        assert error < 1e-4, (name, error)
