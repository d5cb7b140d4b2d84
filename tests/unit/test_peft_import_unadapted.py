"""PEFT adapters that leave modules of an adapted target alone (issue 42): made by PEFT itself on
transformers' tiny Qwen3-MoE (a dense MLP in layer 0, experts in layer 1), imported with
``slmoe-convert-hf import-adapter``. Modules PEFT did not adapt take no LoRA: an experts-only
``target_parameters`` adapter (layer 0's dense MLP is linear_fc1/fc2 too) gives transformers +
PEFT's logits; exported back, either adapter is PEFT's own file, tensor for tensor (no zero
k/v_proj beside an adapted q_proj, no zero dense MLP). A tensor that is not a LoRA factor is one
line, exit 2."""

import json

import pytest
import torch

from tests.helpers import hf_models

pytestmark = pytest.mark.usefixtures("megatron_single_rank")

EXPERTS_ONLY = dict(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
Q_ONLY = dict(target_modules=["q_proj"])


def _peft_adapter(directory, **targets):
    """PEFT's adapter (every factor random, as after training) on the tiny Qwen3-MoE, whose
    layer 0 is a dense MLP (``mlp_only_layers=[0]``); returns PEFT's logits and the base's."""
    from peft import LoraConfig, get_peft_model

    base = hf_models.build("qwen3_moe")
    assert base.config.mlp_only_layers == [0]
    base_logits = hf_models.hf_logits(base, hf_models.tokens())
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                            **targets)).eval()
    model.save_pretrained(str(directory))
    return hf_models.hf_logits(model, hf_models.tokens()), base_logits


def _convert(*argv):
    from megatron_slmoe.commands.convert_hf import main

    return main([*map(str, argv)])


def _round_trip(root, layout):
    """Import PEFT's adapter, export it back in ``layout``; assert PEFT's file comes back."""
    from safetensors.torch import load_file

    assert _convert("import-adapter", "--peft-adapter", root / "peft", "--hf-checkpoint",
                    root / "hf", "--output", root / "adapter") == 0
    assert _convert("export", "--adapter", root / "adapter", "--hf-checkpoint", root / "hf",
                    "--output", root / "back", "--export-hf-layout", layout) == 0
    peft = load_file(str(root / "peft" / "adapter_model.safetensors"))
    back = load_file(str(root / "back" / "adapter_model.safetensors"))
    assert sorted(back) == sorted(peft)
    for name, tensor in peft.items():
        assert torch.equal(back[name], tensor), name
    wrote, read = (json.loads((root / d / "adapter_config.json").read_text())
                   for d in ("peft", "back"))
    assert (read["r"], read["lora_alpha"]) == (wrote["r"], wrote["lora_alpha"])
    assert sorted(read["target_modules"] or []) == sorted(wrote["target_modules"] or [])
    # Ours names each parameter in full (model.layers.1.mlp.experts.down_proj), PEFT's a suffix.
    assert all(any(p.endswith(f".{w}") for w in wrote["target_parameters"] or [])
               for p in read["target_parameters"] or [])


def test_experts_only_adapter_gives_peft_logits_and_exports_back(tmp_path):
    from megatron_slmoe.hf.convert import build_model_in_layout
    from megatron_slmoe.hf.loader import load_hf_weights, open_hf_checkpoint
    from megatron_slmoe.lora.adapter import load_adapter

    hf_models.save_family("qwen3_moe", str(tmp_path / "hf"))
    peft_logits, base_logits = _peft_adapter(tmp_path / "peft", **EXPERTS_ONLY)
    _round_trip(tmp_path, "fused")
    hf = open_hf_checkpoint(str(tmp_path / "hf"), check_shapes=False)
    model, _ = build_model_in_layout(hf.model_config)
    load_hf_weights([model], str(tmp_path / "hf"), hf)
    load_adapter([model], str(tmp_path / "adapter"))
    dense = model.decoder.layers[0].mlp.linear_fc1
    assert not dense.lora_A.weight.any() and not dense.lora_B.weight.any()  # no LoRA in effect
    torch.testing.assert_close(hf_models.megatron_logits(model, hf_models.tokens()), peft_logits,
                               rtol=1e-5, atol=1e-5)
    assert (peft_logits - base_logits).abs().max() > 0.1  # the adapter matters


def test_q_proj_only_adapter_exports_back_without_zero_k_and_v(tmp_path):
    hf_models.save_family("qwen3_moe", str(tmp_path / "hf"))
    _peft_adapter(tmp_path / "peft", **Q_ONLY)
    _round_trip(tmp_path, "per-expert")


def test_a_tensor_that_is_not_a_lora_factor_is_one_line(tmp_path, capsys):
    hf_models.save_family("qwen3_moe", str(tmp_path / "hf"))
    _peft_adapter(tmp_path / "peft", **Q_ONLY, modules_to_save=["lm_head"])
    assert _convert("import-adapter", "--peft-adapter", tmp_path / "peft", "--hf-checkpoint",
                    tmp_path / "hf", "--output", tmp_path / "adapter") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "lm_head" in err and "not a LoRA factor" in err, err
    assert not (tmp_path / "adapter").exists()
