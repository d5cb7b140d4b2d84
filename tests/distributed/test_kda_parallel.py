"""The KDA layer with its heads split over TP=2 (with sequence parallelism, as training runs it)
equals the one-process plain reference layer: outputs, input gradients and every parameter's
gradient (sharded as the layer holds it; the gradient of the replicated ``f_a_proj`` summed over
TP as finalize_model_grads does for parameters marked ``sequence_parallel``). Generation's layout
(sequence parallelism off) decodes step by step to the same outputs; the dist-checkpoint shards
of the head-sliced parameters carry their global shapes and offsets."""

from __future__ import annotations

import torch

from tests.helpers.ranks import run_ranks

TOL = dict(atol=1e-5, rtol=1e-4)


def _tp_rank_case() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.inference.contexts import StaticInferenceContext

    from tests.helpers import kda_case

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    reference = kda_case.reference_layer(seed=11)
    layer = kda_case.build_layer(reference)
    assert layer.config.sequence_parallel and layer.num_heads_local == kda_case.HEADS // tp
    gen = torch.Generator().manual_seed(12)
    S, B = 40, 2
    x = torch.randn(S, B, kda_case.HIDDEN, generator=gen)
    w = torch.randn(S, B, kda_case.HIDDEN, generator=gen)

    def mine(t):  # this rank's slice of the sequence
        return t.chunk(tp, dim=0)[rank]

    x_local = mine(x).clone().requires_grad_(True)
    out_local, _ = layer(x_local)
    (out_local * mine(w)).sum().backward()
    x_ref = x.transpose(0, 1).clone().requires_grad_(True)
    out_ref = reference(x_ref).transpose(0, 1)
    (out_ref * w).sum().backward()

    torch.testing.assert_close(out_local, mine(out_ref), **TOL)
    torch.testing.assert_close(x_local.grad, mine(x_ref.grad.transpose(0, 1)), **TOL)
    ref_params = dict(reference.named_parameters())
    for name, param in layer.named_parameters():
        grad = param.grad.clone()
        if getattr(param, "sequence_parallel", False):
            torch.distributed.all_reduce(grad, group=ps.get_tensor_model_parallel_group())
        want = kda_case.rank_slice(name, ref_params[name].grad)
        torch.testing.assert_close(grad, want, **TOL, msg=name)

    # Generation: sequence parallelism off (as the generator switches it), a prefill and steps.
    layer.config.sequence_parallel = False
    for module in layer.modules():
        if isinstance(module.__dict__.get("sequence_parallel"), bool):
            module.sequence_parallel = False
    context = StaticInferenceContext(max_batch_size=B, max_sequence_length=S)
    pieces = []
    with torch.no_grad():
        for start, stop in [(0, 33)] + [(t, t + 1) for t in range(33, S)]:
            pieces.append(layer(x[start:stop], inference_context=context)[0])
            context.increment_sequence_len_offset(stop - start)
    torch.testing.assert_close(torch.cat(pieces), out_ref.detach(), **TOL)

    sharded = layer.sharded_state_dict(prefix="kda.")
    heads = kda_case.HEADS // tp
    P = kda_case.HEADS * kda_case.HEAD_DIM
    for key, shape, offset in [
        ("kda.A_log", (kda_case.HEADS,), (rank * heads,)),
        ("kda.dt_bias", (P,), (rank * P // tp,)),
        ("kda.q_conv1d.weight", (P, 1, 4), (rank * P // tp, 0, 0)),
        ("kda.q_proj.weight", (P, kda_case.HIDDEN), (rank * P // tp, 0)),
        ("kda.o_proj.weight", (kda_case.HIDDEN, P), (0, rank * P // tp)),
        ("kda.f_a_proj.weight", (kda_case.HEAD_DIM, kda_case.HIDDEN), (0, 0)),
        ("kda.o_norm.weight", (kda_case.HEAD_DIM,), (0,)),
    ]:
        assert (tuple(sharded[key].global_shape), tuple(sharded[key].global_offset)) == \
            (shape, offset), key


def test_kda_tensor_parallel_equals_reference():
    run_ranks(_tp_rank_case, 2, tp=2)
