"""Kimi K3 split over ranks: a tiny K3 release checkpoint (14 layers, KDA and gated NoPE MLA,
Attention Residual blocks of 3, MXFP4 experts) imported rank-locally under TP=2 (sequence
parallel: KDA and MLA heads split), EP=2, PP=2 (the Attention-Residual stream, padded, crosses
the stage boundary) and TP=2 x PP=2 gives the plain reference's logits (its fp64 run, 1e-5)."""

import copy

import pytest
import torch

from tests.helpers import hf_models
from tests.helpers import kimi_k3_reference as k3ref
from tests.helpers.ranks import run_ranks

LAYOUTS = {"tp2-sp": (2, dict(tp=2)), "ep2": (2, dict(ep=2)), "pp2": (2, dict(pp=2)),
           "tp2-pp2": (4, dict(tp=2, pp=2))}


def _logits(directory: str, input_ids: torch.Tensor):
    logits, _ = hf_models.import_and_run(directory, input_ids)
    return logits


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    config = k3ref.tiny_config(num_hidden_layers=14, full_attn_layers=[4, 8, 12, 14],
                               kda_layers=[1, 2, 3, 5, 6, 7, 9, 10, 11, 13])
    model = k3ref.round_experts_to_mxfp4_(k3ref.build(config))
    directory = hf_models.save_kimi_k3(model, tmp_path_factory.mktemp("k3") / "release")
    input_ids = hf_models.tokens(batch=2, seq=12) % config.vocab_size
    with torch.no_grad():
        expected = copy.deepcopy(model).double()(input_ids)
    return directory, input_ids, expected


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_gives_the_reference_logits(k3, layout):
    directory, input_ids, expected = k3
    world, sizes = LAYOUTS[layout]
    results = run_ranks(_logits, world, etp=1, timeout=300.0, **sizes, directory=directory,
                        input_ids=input_ids)
    last = [r for r in results if r is not None]
    assert len(last) == world // sizes.get("pp", 1)
    for logits in last:
        torch.testing.assert_close(logits.double(), expected, rtol=1e-5, atol=1e-5)
