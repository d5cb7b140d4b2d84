"""``slmoe-make-hf-checkpoint``'s writer: every preset, scaled down, writes a checkpoint that
transformers loads and that this project imports with transformers' logits (fp32), one shard per
decoder layer plus one for the rest."""

import json
import os

import pytest
import torch

from megatron_slmoe.hf.synthetic import PRESETS, hf_config, write_random_checkpoint
from tests.helpers import hf_models

pytestmark = pytest.mark.usefixtures("megatron_single_rank")

SMALL = {  # the layer's structure kept, its widths cut
    "qwen3-30b-a3b": dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                          moe_intermediate_size=32, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, num_experts=8,
                          num_experts_per_tok=2),
    "deepseek-v3": dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                        moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=1,
                        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
}


def test_every_preset_has_a_small_version():
    assert set(SMALL) == set(PRESETS)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_checkpoint_loads_in_transformers_and_imports_with_its_logits(tmp_path, preset):
    from transformers import AutoModelForCausalLM

    model_type, fields = PRESETS[preset]
    config = hf_config(model_type, 2, **{**fields, **SMALL[preset]})
    directory = str(tmp_path / "ckpt")
    sizes = write_random_checkpoint(config, directory, init_std=0.2)
    assert len(sizes) == 3  # two decoder layers, then embeddings, norm and head
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        assert set(json.load(f)["weight_map"].values()) == set(sizes)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    input_ids = hf_models.tokens()
    logits, _ = hf_models.import_and_run(directory, input_ids)
    torch.testing.assert_close(logits, hf_models.hf_logits(reference, input_ids),
                               rtol=1e-5, atol=1e-5)
