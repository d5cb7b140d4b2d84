"""torch.compile traces the grouped LoRA expert op through its fake kernels: the expert MLP op alone
in one graph (fullgraph), and a whole Stable Latent MoE GPT with LoRA; the compiled forward and
backward graphs contain the native ops, and the results equal eager mode."""

import pytest
import torch

from megatron_slmoe.ops import LoRAGroupedWeights, lora_expert_mlp, native_kernels

pytestmark = pytest.mark.skipif("cpu" not in native_kernels()["lora_grouped_linear"],
                                reason="the native CPU kernel is not built")

FWD, BWD = "slmoe.lora_grouped_linear_fwd", "slmoe.lora_grouped_linear_bwd"


def recording_backend(seen: list):
    """AOT autograd that runs the traced graphs eagerly and records the ops in them (forward and
    backward graphs are traced with fake tensors, so the ops' fake kernels are what they see)."""
    from torch._dynamo.backends.common import aot_autograd

    def record(gm, _example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    return aot_autograd(fw_compiler=record, bw_compiler=record)


def _grads(y, tensors):
    return torch.autograd.grad(y.pow(2).sum(), tensors)


def test_expert_mlp_op_compiles_in_one_graph():
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 4])
    E, T, d, F, r = 4, 12, 8, 6, 2

    def rand(*shape, grad=False):
        return (torch.randn(*shape, generator=gen) * 0.5).requires_grad_(grad)

    x, probs = rand(T, d, grad=True), torch.rand(T, generator=gen).requires_grad_(True)
    fc1 = LoRAGroupedWeights(rand(E, 2 * F, d), rand(E, r, d, grad=True), rand(E, 2 * F, r, grad=True))
    fc2 = LoRAGroupedWeights(rand(E, d, F), rand(E, r, F, grad=True), rand(E, d, r, grad=True))
    leaves = [x, probs, fc1.lora_a, fc1.lora_b, fc2.lora_a, fc2.lora_b]

    def mlp(x_, probs_):
        return lora_expert_mlp(x_, counts, fc1, fc2, 2.0, 0.0, probs_T=probs_)

    seen = []
    compiled = torch.compile(mlp, backend=recording_backend(seen), fullgraph=True)
    y = compiled(x, probs)
    grads = _grads(y, leaves)
    assert seen.count(FWD + ".default") == 2 and seen.count(BWD + ".default") == 2, seen
    y_eager = mlp(x, probs)
    torch.testing.assert_close(y, y_eager, rtol=0, atol=0)
    for got, want in zip(grads, _grads(y_eager, leaves)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_lora_slmoe_gpt_compiles_and_matches_eager(megatron_single_rank):
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.inject import inject_lora
    from megatron_slmoe.model.build import build_gpt_model
    from megatron_slmoe.model.model_file import load_model_config

    torch.manual_seed(0)
    mc = load_model_config("tiny")
    model = build_gpt_model(mc, mc.transformer_config(use_cpu_initialization=True, num_layers=2,
                                                      moe_layer_freq=[0, 1]))
    inject_lora([model], LoRAConfig(rank=4))
    trainable = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in trainable:  # B starts at zero: let every adapter matter
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    tokens = torch.randint(0, mc.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(32).expand(2, 32)

    def loss_and_grads(m):
        loss = m(tokens, positions, None, labels=tokens).float().mean()
        return loss.detach(), torch.autograd.grad(loss, trainable)

    want_loss, want_grads = loss_and_grads(model)
    seen = []
    got_loss, got_grads = loss_and_grads(torch.compile(model, backend=recording_backend(seen)))
    assert FWD + ".default" in seen and BWD + ".default" in seen
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
