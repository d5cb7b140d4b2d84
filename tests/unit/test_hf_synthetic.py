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


SMALL_QWEN_SET = [f"{name}={value}" for name, value in SMALL["qwen3-30b-a3b"].items()]


@pytest.mark.parametrize("values, needle", [
    (["nosuchfield=1"], "'nosuchfield' is not a field of a qwen3_moe config"),
    (["num_experts=4", "num_experts_per_tok=8"], "--moe-router-topk 8 is larger than"),
    (["hidden_size=0"], "hidden_size must be an integer >= 1, got 0"),
    (["num_experts=abc"], "num_experts must be an integer >= 1, got 'abc'"),
    (['num_experts="8"'], "num_experts must be an integer >= 1, got '8'"),
    (["vocab_size=-5"], "vocab_size must be an integer >= 1, got -5"),
])
def test_set_values_are_read_as_an_import_reads_config_json(values, needle, tmp_path, capsys):
    """--set goes through the families' schema of config.json, as --hf-checkpoint does: one
    line, exit code 2, nothing written (a checkpoint was written, or a traceback came)."""
    from megatron_slmoe.commands.make_hf_checkpoint import main

    argv = ["--preset", "qwen3-30b-a3b", "--num-layers", "1", "--output", str(tmp_path / "out")]
    for value in SMALL_QWEN_SET + values:
        argv += ["--set", value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --preset qwen3-30b-a3b with --set: ")
    assert needle in err and not (tmp_path / "out").exists()


def test_a_preset_too_large_for_the_machine_is_refused_with_the_bytes_it_needs(tmp_path, capsys,
                                                                              monkeypatch):
    """DeepSeek-V3's MoE layer (256 experts of 7168 x 2048, three matrices each) written in fp32
    on a machine with 24 GiB available: refused before any allocation (it was a raw allocator
    error)."""
    from megatron_slmoe.commands import make_hf_checkpoint

    monkeypatch.setattr(make_hf_checkpoint, "_available_memory", lambda: 24 * 2**30)
    assert make_hf_checkpoint.main(["--preset", "deepseek-v3", "--num-layers", "4", "--output",
                                    str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    experts = 256 * 3 * 7168 * 2048 * 4  # the routed experts of one MoE layer, fp32
    needed = int(err.split(" GiB (")[1].split(" bytes")[0].replace(",", ""))
    assert err.count("\n") == 1 and "its largest shard (model.layers.3)" in err
    assert experts < needed < 2 * experts and "this machine has 24.0 GiB available" in err
    assert not (tmp_path / "out").exists()
