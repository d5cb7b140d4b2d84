"""Export layouts named by what reads them (issue 42): ``--export-hf-layout`` and the manifest.

The fused layout is held to PEFT's own ``target_parameters`` adapter on transformers' tiny
Qwen3-MoE, tensor for tensor: PEFT builds and saves an adapter on the fused 3D experts (every
factor random; the experts at rank 2, o_proj at 4); PEFT's own per-expert delta
(``ParamWrapper.get_delta_weight``) equals s * B_e A_e of our imported adapter's expert e, and our
fused export of that adapter is PEFT's file: the same names, shapes and values. PEFT's lora_B
[out, r*E] puts the expert index fastest; the test data tells that order from rank-fastest, so an
export (or import) in the other order fails both checks. Bad layouts: one line, exit 2.
"""

import json
import os

import pytest
import torch

from tests.helpers import hf_models

pytestmark = pytest.mark.usefixtures("megatron_single_rank")

EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
EXPERT_RANK, DENSE_RANK = 2, 4
ALPHA = DENSE_RANK  # PEFT's scales as the import keeps them (dense 1, experts alpha / 2): no rescale
OVERRIDES = dict(mlp_only_layers=[])  # every MLP routed: each Megatron fc1/fc2 LoRA is PEFT's


def _tensors(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _convert(*argv):
    from megatron_slmoe.commands.convert_hf import main

    return main([*map(str, argv)])


@pytest.fixture(scope="module")
def peft_made(tmp_path_factory):
    """PEFT's own adapter on the fused experts (and o_proj, one Megatron module each), saved; the PeftModel; our import
    of it, and our fused export of that."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("export_layouts")
    hf_models.save_family("qwen3_moe", str(root / "hf"), **OVERRIDES)
    config = LoraConfig(r=EXPERT_RANK, lora_alpha=ALPHA, target_modules=["o_proj"],
                        target_parameters=EXPERT_PARAMETERS, rank_pattern={"o_proj": DENSE_RANK},
                        init_lora_weights=False)
    model = get_peft_model(hf_models.build("qwen3_moe", **OVERRIDES), config).eval()
    model.save_pretrained(str(root / "peft"))
    assert _convert("import-adapter", "--peft-adapter", root / "peft", "--hf-checkpoint",
                    root / "hf", "--output", root / "adapter") == 0
    assert _convert("export", "--adapter", root / "adapter", "--hf-checkpoint", root / "hf",
                    "--output", root / "fused", "--export-hf-layout", "fused") == 0
    return root, model


def test_fused_export_is_peft_target_parameters_tensor_for_tensor(peft_made):
    from peft.tuners.lora.layer import ParamWrapper

    root, peft_model = peft_made
    ours = _tensors(root / "adapter" / "adapter_model.safetensors")
    scale = ALPHA / EXPERT_RANK
    wrappers = {(name.split(".")[4], m.parameter_name): m for name, m in
                peft_model.named_modules() if isinstance(m, ParamWrapper)}
    assert sorted(wrappers) == [(layer, p) for layer in ("0", "1")
                                for p in ("down_proj", "gate_up_proj")]
    for (layer, parameter), wrapper in wrappers.items():
        ours_name = {"gate_up_proj": "linear_fc1", "down_proj": "linear_fc2"}[parameter]
        delta = wrapper.get_delta_weight("default")  # PEFT's [E, out, in]
        assert delta.shape[0] == hf_models.EXPERTS
        for e in range(hf_models.EXPERTS):
            a = ours[f"decoder.layers.{layer}.mlp.experts.{e}.{ours_name}.lora_A.weight"]
            b = ours[f"decoder.layers.{layer}.mlp.experts.{e}.{ours_name}.lora_B.weight"]
            assert a.shape[0] == EXPERT_RANK  # gate rows then up rows: Megatron's and HF's order
            torch.testing.assert_close(scale * b @ a, delta[e], rtol=1e-6, atol=1e-7)

    theirs = _tensors(root / "peft" / "adapter_model.safetensors")
    exported = _tensors(root / "fused" / "adapter_model.safetensors")
    assert sorted(exported) == sorted(theirs)
    for name, tensor in theirs.items():
        assert exported[name].shape == tensor.shape, name
        assert torch.equal(exported[name], tensor), name
    # The data tells the two orders apart: rank-fastest columns are another tensor.
    b = theirs["base_model.model.model.layers.1.mlp.experts.lora_B.weight"]
    assert b.shape[1] == EXPERT_RANK * hf_models.EXPERTS
    rank_fastest = b.reshape(b.shape[0], EXPERT_RANK, -1).transpose(1, 2).reshape(b.shape[0], -1)
    assert not torch.equal(rank_fastest, b)
    config = json.loads((root / "fused" / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == [f"model.layers.{layer}.{p}" for layer in (0, 1)
                                                   for p in sorted(EXPERT_PARAMETERS)]
    assert config["r"] == EXPERT_RANK


def test_manifest_states_layout_engine_modules_ranks_and_scales(peft_made):
    root, _ = peft_made
    manifest = json.loads((root / "fused" / "slmoe_adapter_manifest.json").read_text())
    assert manifest["layout"] == "fused" and manifest["trained_expert_layout"] == "per-expert"
    assert any("PEFT target_parameters" in e for e in manifest["engines"])
    assert manifest["base_model_name_or_path"] == str(root / "hf")
    assert manifest["files"] == ["adapter_config.json", "adapter_model.safetensors"]
    modules = {(m["module"], m["parameter"]): m for m in manifest["modules"]}
    experts = modules["model.layers.1.mlp.experts", "gate_up_proj"]
    assert (experts["experts"], experts["rank"], experts["scaling"]) == (
        hf_models.EXPERTS, EXPERT_RANK, ALPHA / EXPERT_RANK)
    assert experts["megatron"] == "decoder.layers.1.mlp.experts.*.linear_fc1"
    o_proj = modules["model.layers.0.self_attn.o_proj", None]
    assert (o_proj["rank"], o_proj["scaling"]) == (DENSE_RANK, ALPHA / DENSE_RANK)

    # Per expert: one entry for a layer's experts, what vLLM reads.
    assert _convert("export", "--adapter", root / "adapter", "--hf-checkpoint", root / "hf",
                    "--output", root / "per-expert", "--base-model-name-or-path",
                    "Qwen/Qwen3-30B-A3B") == 0
    manifest = json.loads((root / "per-expert" / "slmoe_adapter_manifest.json").read_text())
    assert manifest["layout"] == "per-expert" and "vLLM" in manifest["engines"][0]
    assert manifest["base_model_name_or_path"] == "Qwen/Qwen3-30B-A3B"
    modules = {m["module"]: m for m in manifest["modules"]}
    down = modules["model.layers.1.mlp.experts.*.down_proj"]
    assert (down["rank"], down["scaling"], down["experts"]) == (EXPERT_RANK, ALPHA / EXPERT_RANK, 1)
    peft_keys = _tensors(root / "per-expert" / "adapter_model.safetensors")
    assert f"base_model.model.model.layers.1.mlp.experts.{hf_models.EXPERTS - 1}.down_proj." \
           f"lora_B.weight" in peft_keys


def test_registry_names_every_layout_and_its_writer():
    from megatron_slmoe.hf.export_layouts import LAYOUTS
    from megatron_slmoe.lora.config import EXPERT_LAYOUTS

    assert list(LAYOUTS) == ["per-expert", "fused", "shared-outer", "shared-outer-expanded"]
    for name, layout in LAYOUTS.items():
        assert layout.engines and layout.load and set(layout.trained) <= set(EXPERT_LAYOUTS)
        assert callable(layout.write_function()), name
    assert any("--experts-shared-outer-loras" in e for e in LAYOUTS["shared-outer"].engines)


@pytest.mark.parametrize("layout, needle", [
    ("diagonal", "--export-hf-layout 'diagonal' is not one of per-expert, fused, shared-outer, "
                 "shared-outer-expanded"),
    ("shared-outer", "--export-hf-layout shared-outer needs an adapter trained with "
                     "--expert-lora-layout shared-outer; this one is per-expert (export it as "
                     "per-expert or fused)"),
    ("shared-outer-expanded", "needs an adapter trained with --expert-lora-layout shared-outer"),
])
def test_a_layout_that_does_not_fit_is_one_line(peft_made, tmp_path, capsys, layout, needle):
    root, _ = peft_made
    out = tmp_path / "out"
    assert _convert("export", "--adapter", root / "adapter", "--hf-checkpoint", root / "hf",
                    "--output", out, "--export-hf-layout", layout) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err, err
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".out")]


def test_a_run_refuses_at_start_an_export_layout_its_experts_cannot_give(peft_made, tmp_path,
                                                                       capsys, monkeypatch):
    from megatron_slmoe.training.finetune import main

    root, _ = peft_made
    monkeypatch.setenv("WORLD_SIZE", "1")
    code = main(["--hf-checkpoint", str(root / "hf"), "--export-hf", str(tmp_path / "peft"),
                 "--export-hf-layout", "shared-outer", "--output-dir", str(tmp_path / "out"),
                 "--validate-only"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert (f"--export-hf {tmp_path / 'peft'}: --export-hf-layout shared-outer needs an adapter "
            f"trained with --expert-lora-layout shared-outer") in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "peft").exists()
