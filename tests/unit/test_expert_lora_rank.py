"""The routed experts' LoRA rank of its own (issue 42): ``--expert-lora-rank`` and
``--moe-rank-scaling`` (rank // top-k, alpha kept, so the experts' scale is alpha / their rank).

On transformers' tiny Qwen3-MoE (top-2): LoRA rank 4, alpha 8, experts at 4 // 2 = 2 (scale 4),
every factor random as after training. PEFT itself is the reference: our PEFT export (fused and
per expert, the experts' rank as ``rank_pattern``) loaded by ``PeftModel`` gives the Megatron
logits, and so does the merged checkpoint; the adapter file states each module's rank and scale,
loads back (and refuses another expert rank), and PEFT's adapter imported back gives them too."""

import json

import pytest
import torch

from tests.helpers import hf_models

pytestmark = pytest.mark.usefixtures("megatron_single_rank")

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def test_expert_rank_rules():
    from megatron_slmoe.config.errors import ConfigError
    from megatron_slmoe.lora.config import LoRAConfig

    # NeMo AutoModel's K3 recipe: rank 32 on dense layers, 32 // top-16 = 2 on the experts, alpha
    # kept so their scale is 32 / 2 = 16.
    k3 = LoRAConfig(rank=32, alpha=32.0, moe_rank_scaling=True)
    assert k3.expert_rank_for(16) == 2 and k3.scaling_for(2) == 16.0 and k3.scaling == 1.0
    assert LoRAConfig(rank=8, expert_rank=3).expert_rank_for(16) == 3
    assert LoRAConfig(rank=8).expert_rank_for(16) == 8
    with pytest.raises(ValueError, match=r"--lora-rank 8 // top-k 16 is below 1"):
        LoRAConfig(rank=8, moe_rank_scaling=True).expert_rank_for(16)
    with pytest.raises(ValueError, match=r"--lora-rank 12 does not divide by the top-k 8"):
        LoRAConfig(rank=12, moe_rank_scaling=True).expert_rank_for(8)
    with pytest.raises(ConfigError, match="both set the experts' rank"):
        LoRAConfig(rank=8, expert_rank=2, moe_rank_scaling=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from megatron_slmoe.lora.adapter import save_adapter
    from megatron_slmoe.lora.config import LoRAConfig

    root = tmp_path_factory.mktemp("expert_rank")
    hf_models.save_family("qwen3_moe", str(root / "hf"), mlp_only_layers=[])
    lora_config = LoRAConfig(rank=4, alpha=8.0, targets=TARGETS, moe_rank_scaling=True)
    model = hf_models.imported_lora_model(str(root / "hf"), lora_config)
    experts = model.decoder.layers[1].mlp.experts
    assert tuple(experts.fc1_lora_A.shape) == (hf_models.EXPERTS, 2, hf_models.HIDDEN)
    assert experts.lora_rank == 2 and experts.lora_scaling == 4.0
    assert model.decoder.layers[1].self_attention.linear_qkv.lora_scaling == 2.0
    logits = hf_models.megatron_logits(model, hf_models.tokens())
    save_adapter([model], str(root / "adapter"), lora_config)
    return root, lora_config, logits


def test_adapter_states_each_scale_and_loads_back(trained, tmp_path):
    from megatron_slmoe.lora.adapter import AdapterError, load_adapter
    from megatron_slmoe.lora.config import LoRAConfig

    root, lora_config, logits = trained
    document = json.loads((root / "adapter" / "adapter_config.json").read_text())
    scales = document["module_scales"]
    assert scales["decoder.layers.1.mlp.experts.*.linear_fc1"] == {
        "rank": 2, "alpha": 8.0, "scaling": 4.0}
    assert scales["decoder.layers.0.self_attention.linear_qkv"] == {
        "rank": 4, "alpha": 8.0, "scaling": 2.0}
    assert document["lora"]["moe_rank_scaling"] is True
    model = hf_models.imported_lora_model(str(root / "hf"), None)
    assert load_adapter([model], str(root / "adapter")) == lora_config
    torch.testing.assert_close(hf_models.megatron_logits(model, hf_models.tokens()), logits)
    # Injected with the experts at the dense rank: one line, not a silent misfit.
    other = hf_models.imported_lora_model(str(root / "hf"),
                                          LoRAConfig(rank=4, alpha=8.0, targets=TARGETS))
    with pytest.raises(AdapterError, match=r"lora.moe_rank_scaling True .* injected with False"):
        load_adapter([other], str(root / "adapter"))


@pytest.mark.parametrize("layout", ["fused", "per-expert"])
def test_peft_loads_the_export_with_the_experts_rank(trained, layout):
    from peft import PeftModel

    from megatron_slmoe.commands.convert_hf import main

    root, _, logits = trained
    out = root / f"peft-{layout}"
    assert main(["export", "--adapter", str(root / "adapter"), "--hf-checkpoint",
                 str(root / "hf"), "--output", str(out), "--expert-layout", layout]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    # r is the experts' rank (PEFT fuses a per-expert adapter at r), the others' a rank_pattern.
    assert config["r"] == 2 and config["lora_alpha"] == 8.0
    assert set(config["rank_pattern"].values()) == {4}
    assert any("o_proj" in key for key in config["rank_pattern"])
    base = hf_models.build("qwen3_moe", mlp_only_layers=[])
    peft = PeftModel.from_pretrained(base, str(out)).eval()
    torch.testing.assert_close(hf_models.hf_logits(peft, hf_models.tokens()), logits,
                               rtol=1e-5, atol=2e-5)


def test_merged_export_and_peft_import_give_the_adapter_logits(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_slmoe.commands.convert_hf import main
    from megatron_slmoe.hf.merged_export import export_merged
    from megatron_slmoe.lora.adapter import load_adapter

    root, _, logits = trained
    export_merged(str(root / "adapter"), str(root / "hf"), str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    torch.testing.assert_close(hf_models.hf_logits(merged, hf_models.tokens()), logits,
                               rtol=1e-5, atol=2e-5)
    # PEFT's adapter (rank_pattern on the experts) back into ours: the experts keep rank 2.
    peft_dir = root / "peft-fused"
    if not peft_dir.exists():
        assert main(["export", "--adapter", str(root / "adapter"), "--hf-checkpoint",
                     str(root / "hf"), "--output", str(peft_dir), "--expert-layout",
                     "fused"]) == 0
    assert main(["import-adapter", "--peft-adapter", str(peft_dir), "--hf-checkpoint",
                 str(root / "hf"), "--output", str(tmp_path / "back")]) == 0
    model = hf_models.imported_lora_model(str(root / "hf"), None)
    config = load_adapter([model], str(tmp_path / "back"))
    assert (config.rank, config.expert_rank) == (12, 2)  # q, k and v stack in linear_qkv
    assert model.decoder.layers[1].mlp.experts.fc2_lora_B.shape[-1] == 2
    torch.testing.assert_close(hf_models.megatron_logits(model, hf_models.tokens()), logits,
                               rtol=1e-5, atol=2e-5)


def test_a_rank_the_experts_cannot_take_is_one_line_before_anything_changes(trained):
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.inject import inject_lora, lora_modules
    from megatron_slmoe.lora.targets import LoRATargetError

    root, _, _ = trained
    model = hf_models.imported_lora_model(str(root / "hf"), None)
    for rank, message in ((1, r"--lora-rank 1 // top-k 2 is below 1"),
                          (3, r"--lora-rank 3 does not divide by the top-k 2")):
        with pytest.raises(LoRATargetError, match=message):
            inject_lora([model], LoRAConfig(rank=rank, targets=TARGETS, moe_rank_scaling=True))
        assert lora_modules([model]) == []  # refused before any module was adapted

