"""Checkpoints whose routed experts are packed as compressed-tensors packs them import as the
weights they mean: Kimi-K2.5 as released (INT4 ``pack-quantized``, group 32, made here by
compressed-tensors' own observer and compressor) gives the logits of transformers' model holding
compressed-tensors' decompression of the same bytes, image+text; a packed tensor without its
scales, or with scales of the wrong size, is one line."""

import json
import os

import pytest
import torch

pytest.importorskip("compressed_tensors")

from tests.helpers import hf_models  # noqa: E402

pytestmark = pytest.mark.usefixtures("megatron_single_rank")


@pytest.fixture(scope="module")
def int4_kimi(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi-int4")
    model = hf_models.build_kimi(text_overrides=dict(moe_intermediate_size=32))
    hf_models.save(model, str(root / "packed"), layout="original")
    count = hf_models.pack_experts_int4(str(root / "packed"), str(root / "decoded"))
    assert count == 3 * hf_models.EXPERTS
    return root


def test_int4_kimi_k25_imports_as_its_decompression(int4_kimi):
    from transformers import Kimi_K25ForConditionalGeneration

    from megatron_slmoe.hf.checkpoint import HFCheckpoint

    catalogue = HFCheckpoint.open(str(int4_kimi / "packed")).tensors
    packed = [k for k in catalogue if k.endswith("weight_packed")]
    assert packed and all(catalogue[k].dtype == "I32" for k in packed)
    reference = Kimi_K25ForConditionalGeneration.from_pretrained(
        str(int4_kimi / "decoded"), attn_implementation="eager").float().eval()
    inputs = hf_models.kimi_inputs()
    logits, report = hf_models.kimi_import_and_run(str(int4_kimi / "packed"), inputs)
    torch.testing.assert_close(logits, hf_models.kimi_hf_logits(reference, inputs),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("damage, message", [
    ("drop-scale", r"has no .*experts\.0\.gate_proj\.weight_scale in any shard"),
    ("short-scale", r"weight_scale has shape \[\d+, 0\]"),
])
def test_broken_packed_weights_are_one_line(int4_kimi, tmp_path, damage, message):
    from safetensors.torch import load_file, save_file

    from megatron_slmoe.families.errors import HFCheckpointError
    from megatron_slmoe.hf.checkpoint import HFCheckpoint

    tensors = load_file(str(int4_kimi / "packed" / "model.safetensors"))
    key = next(k for k in tensors if k.endswith("experts.0.gate_proj.weight_scale"))
    if damage == "drop-scale":
        del tensors[key]
    else:
        tensors[key] = tensors[key][:, :0].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((int4_kimi / "packed" / "config.json").read_text())
    with pytest.raises(HFCheckpointError, match=message) as err:
        HFCheckpoint.open(str(tmp_path))
    assert "\n" not in str(err.value)
