"""Attention Residuals across pipeline stages and tensor-parallel ranks: the stream (running sum
and bank, padded to the model's slots) handed from stage to stage by Megatron-Core's own
schedules, under PP=2 (the bank restarts on both stages) and TP=2 with sequence parallelism,
gives the logits of the same weights on one rank (moved between layouts as a dist
checkpoint)."""

import pytest
import torch

from tests.helpers import gpt_case, hf_models
from tests.helpers.ranks import run_ranks

BLOCK, LAYERS = 2, 6


def _reference(directory: str, input_ids: torch.Tensor):
    from megatron.core import dist_checkpointing

    model = gpt_case.tiny_attnres_model(BLOCK, LAYERS)
    dist_checkpointing.save(model.sharded_state_dict(), directory)
    return hf_models.megatron_logits(model, input_ids)


def _in_layout(directory: str, input_ids: torch.Tensor):
    from megatron.core import dist_checkpointing

    model = gpt_case.tiny_attnres_model(BLOCK, LAYERS, seed=99)  # then overwritten
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), directory))
    return hf_models.megatron_logits(model, input_ids)


@pytest.mark.parametrize("sizes", [dict(pp=2), dict(tp=2)], ids=["pp2", "tp2-sp"])
def test_layouts_equal_one_rank(tmp_path, sizes):
    input_ids = hf_models.tokens(batch=2, seq=8) % 512
    (tmp_path / "weights").mkdir()
    directory = str(tmp_path / "weights")
    (expected,) = run_ranks(_reference, 1, directory=directory, input_ids=input_ids)
    results = run_ranks(_in_layout, 2, etp=1, **sizes, directory=directory,
                        input_ids=input_ids)
    last = [r for r in results if r is not None]
    assert last, "no rank returned logits"
    for logits in last:
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
