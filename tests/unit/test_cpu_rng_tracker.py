"""Megatron's RNG tracker on the CPU platform: named streams are reproducible, independent of
each other, and forking leaves the surrounding (default) random stream untouched."""

import pytest
import torch

import megatron_slmoe

pytestmark = pytest.mark.skipif(megatron_slmoe.PLATFORM.name != "cpu", reason="CPU adaptor")


def _seeded_tracker(seed=1234):
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        model_parallel_cuda_manual_seed,
    )

    model_parallel_cuda_manual_seed(seed, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    return get_cuda_rng_tracker()


def test_fork_restores_the_default_stream():
    tracker = _seeded_tracker()
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    with tracker.fork():
        torch.rand(100)
    assert torch.equal(torch.rand(4), expected)


def test_named_streams_are_reproducible_and_distinct():
    tracker = _seeded_tracker()
    with tracker.fork("model-parallel-rng"):
        tp_first = torch.rand(4)
    with tracker.fork("expert-parallel-rng"):
        ep_first = torch.rand(4)
    with tracker.fork("model-parallel-rng"):
        tp_second = torch.rand(4)
    assert not torch.equal(tp_first, ep_first)
    assert not torch.equal(tp_first, tp_second)  # the stream advanced

    tracker = _seeded_tracker()
    with tracker.fork("model-parallel-rng"):
        assert torch.equal(torch.rand(4), tp_first)


def test_states_round_trip_for_checkpoints():
    tracker = _seeded_tracker()
    states = {name: state.clone() for name, state in tracker.get_states().items()}
    with tracker.fork():
        first = torch.rand(4)
    tracker.set_states(states)
    with tracker.fork():
        assert torch.equal(torch.rand(4), first)
