"""A shared-outer adapter for serving engines (issue 42): ``--export-hf-layout
shared-outer-expanded`` (per-expert, for vLLM and PEFT) and ``shared-outer`` (SGLang's
``--experts-shared-outer-loras`` tensors).

On transformers' tiny Qwen3-MoE (top-2), LoRA rank 4 everywhere, the experts shared-outer, every
factor random as after training: PEFT's ``PeftModel`` on the expanded export gives the Megatron
logits; the SGLang export's tensors have SGLang's shapes (shared factors with an expert axis of
1) and give every expert projection's s B A of the Megatron module's own delta; the merged
HF checkpoint (``export_merged``) and our module's ``merge_lora`` give the adapter's logits
too."""

import json

import pytest
import torch

from tests.helpers import hf_models

pytestmark = pytest.mark.usefixtures("megatron_single_rank")

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
R = 4


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from megatron_slmoe.lora.adapter import save_adapter
    from megatron_slmoe.lora.config import LoRAConfig

    root = tmp_path_factory.mktemp("shared_outer_export")
    hf_models.save_family("qwen3_moe", str(root / "hf"), mlp_only_layers=[])
    lora_config = LoRAConfig(rank=R, alpha=8.0, targets=TARGETS, expert_layout="shared-outer")
    model = hf_models.imported_lora_model(str(root / "hf"), lora_config)
    experts = model.decoder.layers[1].mlp.experts
    assert tuple(experts.fc1_lora_A.shape) == (2 * R, hf_models.HIDDEN)
    logits = hf_models.megatron_logits(model, hf_models.tokens())
    save_adapter([model], str(root / "adapter"), lora_config)
    deltas = {layer: [d.clone() for _, d in model.decoder.layers[layer].mlp.experts.lora_delta()]
              for layer in range(len(model.decoder.layers))}
    return root, logits, deltas


def _export(root, layout):
    from megatron_slmoe.commands.convert_hf import main

    out = root / f"export-{layout}"
    assert main(["export", "--adapter", str(root / "adapter"), "--hf-checkpoint",
                 str(root / "hf"), "--output", str(out), "--export-hf-layout", layout]) == 0
    return out


def test_peft_loads_the_expanded_export_with_our_logits(trained):
    from peft import PeftModel

    root, logits, _ = trained
    out = _export(root, "shared-outer-expanded")
    manifest = json.loads((out / "slmoe_adapter_manifest.json").read_text())
    assert manifest["layout"] == "shared-outer-expanded"
    assert manifest["trained_expert_layout"] == "shared-outer"
    base = hf_models.build("qwen3_moe", mlp_only_layers=[])
    peft = PeftModel.from_pretrained(base, str(out)).eval()
    torch.testing.assert_close(hf_models.hf_logits(peft, hf_models.tokens()), logits,
                               rtol=1e-5, atol=2e-5)
    # And the adapters' weights matter: the base alone is far off.
    with peft.disable_adapter():
        assert not torch.allclose(hf_models.hf_logits(peft, hf_models.tokens()), logits,
                                  atol=1e-3)


def test_sglang_export_has_its_shapes_and_every_experts_delta(trained):
    from safetensors.torch import load_file

    root, _, deltas = trained
    out = _export(root, "shared-outer")
    tensors = load_file(str(out / "adapter_model.safetensors"))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == R and config["lora_alpha"] == 8.0
    experts, ffn, hidden = hf_models.EXPERTS, 16, hf_models.HIDDEN
    prefix = "base_model.model.model.layers.1.mlp.experts"
    shapes = {k[len(prefix) + 1:]: tuple(v.shape) for k, v in tensors.items()
              if k.startswith(prefix + ".")}
    assert shapes == {
        "gate_proj.lora_A.weight": (1, R, hidden), "gate_proj.lora_B.weight": (experts, ffn, R),
        "up_proj.lora_A.weight": (1, R, hidden), "up_proj.lora_B.weight": (experts, ffn, R),
        "down_proj.lora_A.weight": (experts, R, ffn), "down_proj.lora_B.weight": (1, hidden, R)}
    s = 8.0 / R
    fc1_delta, fc2_delta = deltas[1]  # the Megatron module's s dW per expert, gate rows first
    for e in range(experts):
        t = {n: tensors[f"{prefix}.{n}.weight"] for n in (
            "gate_proj.lora_A", "gate_proj.lora_B", "up_proj.lora_A", "up_proj.lora_B",
            "down_proj.lora_A", "down_proj.lora_B")}
        gate = s * t["gate_proj.lora_B"][e] @ t["gate_proj.lora_A"][0]
        up = s * t["up_proj.lora_B"][e] @ t["up_proj.lora_A"][0]
        down = s * t["down_proj.lora_B"][0] @ t["down_proj.lora_A"][e]
        torch.testing.assert_close(torch.cat([gate, up]), fc1_delta[e])
        torch.testing.assert_close(down, fc2_delta[e])
    assert any(".self_attn.o_proj.lora_A" in k for k in tensors)


def test_merged_model_gives_the_adapter_logits(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_slmoe.hf.merged_export import export_merged
    from megatron_slmoe.lora.adapter import load_adapter, merge_lora

    root, logits, _ = trained
    export_merged(str(root / "adapter"), str(root / "hf"), str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    torch.testing.assert_close(hf_models.hf_logits(merged, hf_models.tokens()), logits,
                               rtol=1e-5, atol=2e-5)
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]  # no scratch left behind
    model = hf_models.imported_lora_model(str(root / "hf"), None)
    load_adapter([model], str(root / "adapter"))
    merge_lora([model])
    torch.testing.assert_close(hf_models.megatron_logits(model, hf_models.tokens()), logits,
                               rtol=1e-5, atol=2e-5)
