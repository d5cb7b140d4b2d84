"""Adapters out: an adapter trained on an imported tiny random HF model (every LoRA factor random,
as after training), exported as a PEFT adapter in both expert layouts, loaded by PEFT itself
(``PeftModel.from_pretrained``) on transformers' model: the same fp32 logits as the Megatron model
with its adapter; merged into a full HF checkpoint loaded with ``AutoModelForCausalLM``: the same
logits; the base alone written back bitwise; bad input one line, exit 2, nothing written."""

import json
import os

import pytest
import torch

from tests.helpers import hf_models

pytestmark = pytest.mark.usefixtures("megatron_single_rank")

ATTENTION_AND_EXPERTS = ["linear_proj", "linear_fc1", "linear_fc2"]
CASES = {
    # Every target the HF model has: a dense layer 0 and, for DeepSeek, shared experts.
    ("qwen3_moe", "fused"): (dict(), ["linear_qkv", *ATTENTION_AND_EXPERTS, "router"]),
    # MLA: linear_qkv adapts q_a/q_b_proj and kv_a_proj_with_mqa/kv_b_proj.
    ("deepseek_v3", "fused"): (dict(), [*ATTENTION_AND_EXPERTS, "linear_qkv", "shared_experts",
                                        "router"]),
    # Per-expert modules on transformers 5: PEFT converts them to the fused form, taking every
    # gate/up/down_proj target for an expert projection, so no dense MLP may be adapted.
    # NemotronH: `backbone.` on disk, fused relu2 experts in memory, latent projections; the
    # Stable Latent MoE: our own transformers model (per-expert on disk, fused in memory).
    ("nemotron_h", "fused"): (dict(), [*ATTENTION_AND_EXPERTS, "linear_qkv", "shared_experts",
                                       "router", "latent"]),
    ("stable_latent_moe", "fused"): (dict(), [*ATTENTION_AND_EXPERTS, "linear_qkv",
                                              "shared_experts", "router", "latent"]),
    ("qwen3_moe", "per-expert"): (dict(mlp_only_layers=[]), ["linear_qkv",
                                                             *ATTENTION_AND_EXPERTS]),
    ("deepseek_v3", "per-expert"): (dict(first_k_dense_replace=0, q_lora_rank=None),
                                    [*ATTENTION_AND_EXPERTS, "linear_qkv"]),  # q_proj
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Per (family, layout): the HF base directory, its overrides, the adapter directory and the
    Megatron logits with the adapter."""
    from megatron_slmoe.lora.adapter import save_adapter

    made = {}

    def make(family, layout):
        if (family, layout) not in made:
            overrides, targets = CASES[family, layout]
            root = tmp_path_factory.mktemp(f"{family}-{layout}")
            hf_models.save_family(family, str(root / "hf"), **overrides)
            model, lora_config = hf_models.import_with_lora(str(root / "hf"), targets)
            logits = hf_models.megatron_logits(model, hf_models.tokens())
            save_adapter([model], str(root / "adapter"), lora_config)
            made[family, layout] = (root, overrides, logits)
        return made[family, layout]

    return make


def _convert(*argv):
    from megatron_slmoe.commands.convert_hf import main

    return main(["export", *map(str, argv)])


@pytest.mark.parametrize("family, layout", list(CASES), ids=[f"{f}-{l}" for f, l in CASES])
def test_peft_loads_the_adapter_with_the_megatron_logits(trained, family, layout):
    from peft import PeftModel

    root, overrides, megatron = trained(family, layout)
    assert _convert("--adapter", root / "adapter", "--hf-checkpoint", root / "hf", "--output",
                    root / "peft", "--expert-layout", layout) == 0
    config = json.loads((root / "peft" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    from safetensors import safe_open

    with safe_open(str(root / "peft" / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert all(k.startswith("base_model.model.model.layers.") for k in keys)
    if family == "deepseek_v3":  # MLA input projections under linear_qkv
        mla = ("kv_a_proj_with_mqa", "kv_b_proj") + (("q_proj",) if layout == "per-expert"
                                                      else ("q_a_proj", "q_b_proj"))
        assert all(any(f".self_attn.{m}.lora_A.weight" in k for k in keys) for m in mla)
    if layout == "per-expert":
        assert any(".mlp.experts.3.down_proj.lora_B.weight" in k for k in keys)
    else:
        assert any(".experts.lora_A.weight" in k for k in keys)
    input_ids = hf_models.tokens()
    base = hf_models.build(family, **overrides)
    base_logits = hf_models.hf_logits(base, input_ids)
    peft_logits = hf_models.hf_logits(PeftModel.from_pretrained(base, str(root / "peft")).eval(),
                                      input_ids)
    torch.testing.assert_close(peft_logits, megatron, rtol=1e-5, atol=2e-5)
    assert (peft_logits - base_logits).abs().max() > 0.1  # the adapter matters


@pytest.mark.parametrize("family", ["deepseek_v3", "nemotron_h", "stable_latent_moe"])
def test_merged_checkpoint_loads_with_the_megatron_logits(trained, family):
    from transformers import AutoModelForCausalLM

    from megatron_slmoe.hf.merged_export import export_merged

    root, _, megatron = trained(family, "fused")
    export_merged(str(root / "adapter"), str(root / "hf"), str(root / "merged"),
                  max_shard_bytes=64 * 2**10)
    index = json.loads((root / "merged" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    layer = "backbone.layers.1.mixer" if family == "nemotron_h" else "model.layers.1.mlp"
    assert f"{layer}.experts.3.up_proj.weight" in index["weight_map"]  # as save_pretrained
    merged = AutoModelForCausalLM.from_pretrained(str(root / "merged"), dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    torch.testing.assert_close(hf_models.hf_logits(merged, hf_models.tokens()), megatron,
                               rtol=1e-5, atol=2e-5)


def test_base_written_back_bitwise(tmp_path):
    """The base alone through the merged writer: every tensor bitwise, from the fused layout too
    (written per expert, as save_pretrained writes by default)."""
    from megatron_slmoe.hf.merged_export import export_merged

    model = hf_models.save_family("qwen3_moe", str(tmp_path / "fused"), layout="fused")
    hf_models.save(model, str(tmp_path / "original"))
    export_merged(None, str(tmp_path / "fused"), str(tmp_path / "out"))
    hf_models.assert_same_tensors(tmp_path / "original", tmp_path / "out")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_hf_megatron_hf_round_trip_is_bitwise(tmp_path, family):
    """HF (fused expert layout) -> Megatron model -> HF: every tensor bitwise as save_pretrained
    writes the same model (per-expert keys)."""
    from megatron_slmoe.hf.convert import build_model_in_layout
    from megatron_slmoe.hf.loader import load_hf_weights, open_hf_checkpoint
    from megatron_slmoe.hf.megatron_export import export_megatron_weights

    model = hf_models.save_family(family, str(tmp_path / "fused"), layout="fused")
    hf_models.save(model, str(tmp_path / "original"))
    hf = open_hf_checkpoint(str(tmp_path / "fused"), check_shapes=False)
    megatron, _ = build_model_in_layout(hf.model_config)
    load_hf_weights([megatron], str(tmp_path / "fused"), hf)
    export_megatron_weights([megatron], hf, str(tmp_path / "out"), max_shard_bytes=32 * 2**10)
    hf_models.assert_same_tensors(tmp_path / "original", tmp_path / "out")


def test_bad_input_is_one_line_and_writes_nothing(trained, tmp_path, capsys):
    root, _, _ = trained("qwen3_moe", "fused")
    other = tmp_path / "other-base"
    hf_models.save_family("qwen3_moe", str(other), moe_intermediate_size=24)
    out = tmp_path / "out"
    assert _convert("--adapter", root / "adapter", "--hf-checkpoint", other, "--output", out,
                    "--expert-layout", "fused") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "linear_fc1" in err, err
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".out")]
    assert _convert("--merged", "--adapter", root / "adapter", "--hf-checkpoint", other,
                    "--output", out) == 2
    assert not out.exists()
    (out / "x").parent.mkdir()
    (out / "x").write_text("keep")
    assert _convert("--adapter", root / "adapter", "--hf-checkpoint", root / "hf", "--output",
                    out) == 2
    assert "not an empty directory" in capsys.readouterr().err


def test_per_expert_layout_refuses_what_peft_would_misread(trained, tmp_path, capsys, caplog):
    """PEFT reads every gate/up/down_proj target of a per-expert Qwen3-MoE adapter as expert LoRA
    (a dense MLP's LoRA would land on the experts) and cannot adapt a router it does not convert:
    one line, exit 2, nothing written. Where PEFT converts nothing (NemotronH) it would leave the
    expert LoRA out: written (vLLM's layout), with a warning naming the fused layout."""
    for family, message in (("qwen3_moe", "model.layers.0.mlp.gate_proj cannot be exported per"),
                            ("stable_latent_moe", "StableLatentMoeRouter, which PEFT adapts")):
        root, _, _ = trained(family, "fused")
        out = tmp_path / family
        assert _convert("--adapter", root / "adapter", "--hf-checkpoint", root / "hf",
                        "--output", out, "--expert-layout", "per-expert") == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err and "--export-hf-layout fused" in err, err
        assert not out.exists()
    from megatron_slmoe.hf.peft_export import export_peft_adapter

    root = tmp_path / "nemotron"
    hf_models.save_family("nemotron_h", str(root / "hf"))
    from megatron_slmoe.lora.adapter import save_adapter

    model, lora_config = hf_models.import_with_lora(str(root / "hf"), ["linear_fc1"])
    save_adapter([model], str(root / "adapter"), lora_config)
    with caplog.at_level("WARNING", logger="megatron_slmoe.hf.peft_export"):
        export_peft_adapter(str(root / "adapter"), str(root / "hf"), str(root / "peft"),
                            layout="per-expert")
    assert "leave the expert LoRA out" in caplog.text and "NemotronHForCausalLM" in caplog.text
    assert (root / "peft" / "adapter_model.safetensors").exists()


# --- PEFT adapters in -----------------------------------------------------------------------------


def _peft_made_adapter(family, directory):
    """A PEFT adapter made by PEFT itself on the HF model (random B too), with a rank and an alpha
    pattern, a dense MLP parameter and the fused experts; returns its logits."""
    from peft import LoraConfig, get_peft_model

    experts = {"nemotron_h": ["mixer.experts.up_proj", "mixer.experts.down_proj"],
               "stable_latent_moe": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    dense = {"qwen3_moe": ["model.layers.0.mlp.up_proj.weight"],
             "deepseek_v3": ["model.layers.0.mlp.up_proj.weight"],
             "nemotron_h": ["model.layers.3.mixer.up_proj.weight"], "stable_latent_moe": []}
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "q_proj", "v_proj"]
                        if family != "deepseek_v3" else ["o_proj", "q_a_proj", "q_b_proj",
                                                         "kv_a_proj_with_mqa", "kv_b_proj"],
                        target_parameters=experts.get(family, ["mlp.experts.gate_up_proj",
                                                               "mlp.experts.down_proj"])
                        + dense[family],
                        rank_pattern={"o_proj": 2}, alpha_pattern={"o_proj": 3},
                        init_lora_weights=False)
    model = get_peft_model(hf_models.build(family), config).eval()
    model.save_pretrained(directory)
    return hf_models.hf_logits(model, hf_models.tokens())


@pytest.mark.parametrize("family", hf_models.FAMILY_NAMES)
def test_peft_adapter_imported_gives_peft_logits(tmp_path, family):
    from megatron_slmoe.hf.convert import build_model_in_layout
    from megatron_slmoe.hf.loader import load_hf_weights, open_hf_checkpoint
    from megatron_slmoe.lora.adapter import load_adapter

    hf_models.save_family(family, str(tmp_path / "hf"))
    peft_logits = _peft_made_adapter(family, str(tmp_path / "peft"))
    assert _convert_import(tmp_path) == 0
    hf = open_hf_checkpoint(str(tmp_path / "hf"), check_shapes=False)
    model, _ = build_model_in_layout(hf.model_config)
    load_hf_weights([model], str(tmp_path / "hf"), hf)
    config = load_adapter([model], str(tmp_path / "adapter"))
    assert config.rank == (4 if family == "deepseek_v3" else 8)  # q and v stack in linear_qkv
    torch.testing.assert_close(hf_models.megatron_logits(model, hf_models.tokens()), peft_logits,
                               rtol=1e-5, atol=2e-5)


def _convert_import(tmp_path):
    from megatron_slmoe.commands.convert_hf import main

    return main(["import-adapter", "--peft-adapter", str(tmp_path / "peft"), "--hf-checkpoint",
                 str(tmp_path / "hf"), "--output", str(tmp_path / "adapter")])


def test_peft_options_we_cannot_honour_are_refused(tmp_path, capsys):
    hf_models.save_family("qwen3_moe", str(tmp_path / "hf"))
    _peft_made_adapter("qwen3_moe", str(tmp_path / "peft"))
    config_path = tmp_path / "peft" / "adapter_config.json"
    original = json.loads(config_path.read_text())
    for option, value in (("use_dora", True), ("bias", "all"), ("fan_in_fan_out", True)):
        config_path.write_text(json.dumps({**original, option: value}))
        assert _convert_import(tmp_path) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and option in err, err
        assert not (tmp_path / "adapter").exists()
    config_path.write_text(json.dumps(original))
    other = tmp_path / "hf"
    import shutil

    shutil.rmtree(other)
    hf_models.save_family("qwen3_moe", str(other), moe_intermediate_size=24)
    assert _convert_import(tmp_path) == 2  # an adapter of another base: its shapes
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "the base" in err, err
    assert not (tmp_path / "adapter").exists()


def test_run_start_refuses_a_busy_export_dir_and_a_peft_init_without_its_base(tmp_path):
    """Checked before any process group forms, not after hours of training."""
    from megatron_slmoe.training.cli import parse_command_line
    from megatron_slmoe.config.errors import ConfigError
    from megatron_slmoe.training.inputs import _check_paths

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("keep")
    (tmp_path / "hf").mkdir()
    run = parse_command_line(["--hf-checkpoint", str(tmp_path / "hf"), "--export-hf", str(busy)],
                             prog="t", description="", world_size=1).run
    with pytest.raises(ConfigError, match="--export-hf .* is not an empty directory"):
        _check_paths(run)
    (tmp_path / "peft").mkdir()
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    run = parse_command_line(["--adapter-init", str(tmp_path / "peft")], prog="t",
                             description="", world_size=1).run
    with pytest.raises(ConfigError, match="PEFT adapter; it needs --hf-checkpoint"):
        _check_paths(run)


def test_an_adapter_of_another_model_is_refused_as_such(trained, tmp_path, capsys):
    """An adapter that records the model it was trained on, exported onto another checkpoint:
    'trained on another model' (as generate and --adapter-init say), not a weight the base lacks;
    onto its own, it exports."""
    import shutil

    from megatron_slmoe.hf import open_hf_checkpoint
    from megatron_slmoe.lora.adapter import adapter_config_json, base_identity, read_adapter_config

    root, _, _ = trained("qwen3_moe", "fused")
    adapter = tmp_path / "adapter"
    shutil.copytree(root / "adapter", adapter)
    lora_config, _ = read_adapter_config(str(adapter))
    (adapter / "adapter_config.json").write_text(adapter_config_json(
        lora_config, base_identity(open_hf_checkpoint(str(root / "hf")).model_config)))
    other = tmp_path / "deepseek"
    hf_models.save_family("deepseek_v3", str(other))
    for merged in ([], ["--merged"]):
        assert _convert(*merged, "--adapter", adapter, "--hf-checkpoint", other, "--output",
                        tmp_path / "out") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--adapter {adapter} was trained on another model" in err
        assert not (tmp_path / "out").exists()
    assert _convert("--adapter", adapter, "--hf-checkpoint", root / "hf", "--output",
                    tmp_path / "own", "--expert-layout", "fused") == 0
