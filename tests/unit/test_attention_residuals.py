"""Block Attention Residuals on Megatron-Core (``model.attention_residuals``): the mix equals a
softmax over the candidates written out by hand; a GPT model built with ``blocks:
attention_residual_block`` equals the AttnRes recurrence written as a plain loop over the
model's own sublayers (its attention and MLP/MoE modules, called one by one), with the bank
restarted several times; the stream's slots are what the module doc says."""

import pytest
import torch

from tests.helpers import gpt_case, hf_models

pytestmark = pytest.mark.usefixtures("megatron_single_rank")


def _mix_by_hand(running, bank, norm_weight, proj_weight, eps):
    """Each candidate's score and the weighted sum, one candidate at a time, in float64."""
    candidates = [v.double() for v in [*bank, running]]
    query = norm_weight.double() * proj_weight[0].double()
    scores = [((v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)) * query).sum(-1)
              for v in candidates]
    weights = torch.softmax(torch.stack(scores), dim=0)
    return sum(w.unsqueeze(-1) * v for w, v in zip(weights, candidates))


def test_mix_is_a_softmax_over_the_candidates():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_slmoe.model.attention_residuals import AttentionResidualMix

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                               use_cpu_initialization=True)
    mix = AttentionResidualMix(config, 8, eps=1e-5)
    torch.manual_seed(0)
    with torch.no_grad():
        mix.norm_weight.normal_()
        mix.proj_weight.normal_()
    running = torch.randn(5, 2, 8)
    bank = [torch.randn(5, 2, 8) * s for s in (1.0, 3.0, 0.1)]
    expected = _mix_by_hand(running, bank, mix.norm_weight, mix.proj_weight, 1e-5)
    torch.testing.assert_close(mix(running, bank).double(), expected, rtol=1e-6, atol=1e-6)
    # One candidate: the mix is that candidate.
    torch.testing.assert_close(mix(running, []), running)


def test_mix_gradients_equal_autograd_through_the_softmax_by_hand():
    """The mix's own backward (it keeps the candidates, not a stacked copy) against autograd
    through the by-hand softmax, float64: the candidates' and both weights' gradients."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_slmoe.model.attention_residuals import AttentionResidualMix

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                               use_cpu_initialization=True, params_dtype=torch.float64)
    mix = AttentionResidualMix(config, 8, eps=1e-5)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        mix.norm_weight.copy_(1 + 0.3 * torch.randn(8, generator=gen, dtype=torch.float64))
        mix.proj_weight.copy_(torch.randn(1, 8, generator=gen, dtype=torch.float64))
    stream = torch.randn(4 * 5, 2, 8, generator=gen, dtype=torch.float64) * 2
    stream.requires_grad_(True)
    running, *bank = stream.chunk(4, dim=0)  # candidates as the layers see them: slot views
    grad_out = torch.randn(5, 2, 8, generator=gen, dtype=torch.float64)
    params = [mix.norm_weight, mix.proj_weight]
    ours = torch.autograd.grad((mix(running, bank) * grad_out).sum(), [stream, *params])
    theirs = torch.autograd.grad(
        (_mix_by_hand(running, bank, *params, 1e-5) * grad_out).sum(), [stream, *params])
    for got, expected in zip(ours, theirs):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert all(g.abs().max() > 1e-3 for g in ours)


def test_stream_slots():
    from megatron_slmoe.model.attention_residuals import bank_size, stream_slots

    # Bank vectors are added at layers 0, block, 2 block, ...: K3 (93 layers, block 12) ends
    # with 8 of them and the running sum, 9 candidates.
    assert [bank_size(i, 12) for i in (0, 1, 12, 13, 92)] == [0, 1, 1, 2, 8]
    assert stream_slots(93, 12) == 9
    assert stream_slots(5, 2) == 4


def test_model_equals_the_recurrence_over_its_own_sublayers():
    block, num_layers = 2, 5
    model = gpt_case.tiny_attnres_model(block, num_layers)
    input_ids = hf_models.tokens(batch=2, seq=8) % 512
    logits = hf_models.megatron_logits(model, input_ids)

    def mix(module, running, bank):
        eps = module.eps
        return _mix_by_hand(running, bank, module.norm_weight, module.proj_weight,
                            eps).to(running.dtype)

    with torch.no_grad():
        position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        running = model.embedding(input_ids=input_ids, position_ids=position_ids)
        rotary = model.rotary_pos_emb(input_ids.shape[1])
        bank = []
        for index, layer in enumerate(model.decoder.layers):
            h = mix(layer.self_attention_res, running, bank) if bank else running
            if index % block == 0:
                bank.append(running)
                running = torch.zeros_like(running)
            attention, _ = layer.self_attention(layer.input_layernorm(h), attention_mask=None,
                                                rotary_pos_emb=rotary)
            running = running + attention
            h = mix(layer.mlp_res, running, bank)
            running = running + layer.mlp(layer.pre_mlp_layernorm(h))[0]
        assert len(bank) == 3  # restarted at layers 0, 2 and 4
        final = model.decoder.final_layernorm
        out = final.norm(mix(final.attn_res, running, bank))
        expected = model.output_layer(out)[0].transpose(0, 1)
    torch.testing.assert_close(logits, expected.float(), rtol=1e-5, atol=1e-5)
    # The mixes matter: other mixing weights give other logits.
    with torch.no_grad():
        model.decoder.layers[3].mlp_res.proj_weight.mul_(-1.0)
    assert not torch.allclose(hf_models.megatron_logits(model, input_ids), logits, atol=1e-4)
