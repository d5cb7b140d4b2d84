"""Kimi K3 in: a tiny K3 checkpoint in the release's layout (13 layers: KDA and gated NoPE MLA
layers in K3's pattern, Attention Residual blocks of 3 so the bank restarts five times, a dense
first layer, latent MoE layers whose experts are stored MXFP4) imports into our Megatron-Core
model and gives the plain K3 reference's logits: our fp32 logits within 1e-5 of the reference
run in fp64 (the reference's own fp32 logits are 1.3e-5 from its fp64 ones over 13 layers, ours
5e-6). Bad checkpoints are one line."""

import copy

import pytest
import torch

from tests.helpers import hf_models
from tests.helpers import kimi_k3_reference as k3ref

pytestmark = pytest.mark.usefixtures("megatron_single_rank")


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    model = k3ref.round_experts_to_mxfp4_(k3ref.build())
    return model, hf_models.save_kimi_k3(model, tmp_path_factory.mktemp("k3") / "release")


def test_release_checkpoint_imports_with_the_reference_logits(k3):
    model, directory = k3
    input_ids = hf_models.tokens(batch=2, seq=12) % model.config.vocab_size
    logits, report = hf_models.import_and_run(directory, input_ids)
    with torch.no_grad():
        expected = copy.deepcopy(model).double()(input_ids)
    torch.testing.assert_close(logits.double(), expected, rtol=1e-5, atol=1e-5)
    assert report.tensors > 100
