"""Packed routed experts under expert parallelism (EP=2): on each rank the model of a Kimi K3
release checkpoint (MXFP4 experts), of Kimi-K2.5 (INT4 pack-quantized) and of DeepSeek-V3 (block
FP8) gives the same logits
and LoRA gradients with its experts held packed as dequantised, and holds half of the
checkpoint's packed expert bytes (its own experts' values and scales)."""

import pytest
import torch

from tests.helpers import hf_models
from tests.helpers import kimi_k3_reference as k3ref
from tests.helpers import packed_experts as pe
from tests.helpers.ranks import run_ranks


def _compare(directory: str, input_ids: torch.Tensor):
    logits, grads, model = pe.run_lora_step(directory, "packed", input_ids)
    expected_logits, expected_grads, _ = pe.run_lora_step(directory, "dequantize", input_ids)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-6, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    for key, grad in expected_grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-6, atol=1e-6, msg=key)
    return pe.expert_weight_bytes(model), sorted(k for k in grads if ".experts." in k)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed-experts-ep")
    config = k3ref.tiny_config(num_hidden_layers=4, full_attn_layers=[2, 4], kda_layers=[1, 3])
    k3 = hf_models.save_kimi_k3(k3ref.round_experts_to_mxfp4_(k3ref.build(config)), root / "k3")
    kimi = hf_models.build_kimi(text_overrides=dict(moe_intermediate_size=32))
    hf_models.save(kimi, str(root / "k25"), layout="original")
    hf_models.pack_experts_int4(str(root / "k25"), str(root / "k25-decoded"))
    ids = hf_models.kimi_inputs()["input_ids"]
    ids = torch.where(ids == hf_models.KIMI_IMAGE_TOKEN, torch.ones_like(ids), ids)
    hf_models.save_fp8(hf_models.build("deepseek_v3"), str(root / "dsv3"), block=(16, 16))
    return {"k3-mxfp4": (str(k3), hf_models.tokens(batch=2, seq=12) % config.vocab_size),
            "k25-int4": (str(root / "k25"), ids), "dsv3-fp8": (str(root / "dsv3"), hf_models.tokens())}


@pytest.mark.parametrize("name", ["k3-mxfp4", "k25-int4", "dsv3-fp8"])
def test_packed_experts_under_ep2_equal_dequantized(checkpoints, name):
    from megatron_slmoe.hf.checkpoint import HFCheckpoint

    directory, input_ids = checkpoints[name]
    results = run_ranks(_compare, 2, ep=2, etp=1, timeout=300.0, directory=directory,
                        input_ids=input_ids)
    tensors = HFCheckpoint.open(directory).tensors
    stored = sum(tensors[i.packed].nbytes + tensors[i.scale].nbytes if i.packed
                 else i.nbytes + tensors[k + "_scale_inv"].nbytes
                 for k, i in tensors.items() if ".experts." in k and (i.packed or i.is_fp8))
    assert [held for held, _ in results] == [stored // 2, stored // 2]
    assert results[0][1] and results[0][1] == results[1][1]
