"""Kimi K3 out (issue 40 item 5): LoRA on every K3 module kind of a tiny release checkpoint
(KDA's q/k/v/g/b/f_a/f_b and o_proj, gated NoPE MLA's projections and output gate, the dense
first layer, the routed experts in the latent, shared experts, latent projections), all factors
drawn at random as after training, then

- the PEFT export names the release's modules (``base_model.model.language_model.model.layers.N.
  block_sparse_moe.experts.E.w1`` ...) and PEFT's ``PeftModel`` with it on the plain reference
  (tests/helpers/kimi_k3_reference.py) gives our logits;
- the merged export writes the release's layout (experts MXFP4-packed again, the fp32 tensors
  fp32, A_log padded) and re-imports to the logits of the reference holding what it wrote
  (decoded by the reference's own MXFP4 decoder); its unpacked weights are PEFT's own merge
  (W + s B A), its experts that merge to within MXFP4's rounding."""

import copy
import json
import os

import pytest
import torch
from safetensors import safe_open

from tests.helpers import hf_models
from tests.helpers import kimi_k3_reference as k3ref

pytestmark = pytest.mark.usefixtures("megatron_single_rank")

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "shared_experts", "latent")


def _tensors(directory) -> dict:
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _peft_on(reference, peft_dir, dtype=torch.float32):
    """PeftModel.from_pretrained with our export on a copy of the reference. The export says
    task_type CAUSAL_LM (as for the release's model), whose PEFT wrapper keeps the base model's
    generation hook; the plain reference has none, so the copy gets a stand-in (and is run
    through PEFT's LoRA model, ``peft_model.base_model``, not the causal-LM wrapper's forward,
    which reads a transformers config)."""
    from peft import PeftModel

    model = copy.deepcopy(reference).to(dtype)
    model.prepare_inputs_for_generation = None
    return PeftModel.from_pretrained(model, peft_dir).eval()


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """(reference, release dir, our adapted model, adapter dir, input ids, our logits)."""
    from megatron_slmoe.lora.adapter import save_adapter

    root = tmp_path_factory.mktemp("k3-out")
    reference = k3ref.round_experts_to_mxfp4_(k3ref.build())
    release = hf_models.save_kimi_k3(reference, root / "release")
    ours, lora_config = hf_models.import_with_lora(release, TARGETS, seed=3)
    with torch.no_grad():  # factors N(0, 0.1^2): the logits move by ~2, the model stays tame
        for param in ours.parameters():
            if getattr(param, "is_lora", False):
                param.div_(3)
    adapter = root / "adapter"
    save_adapter([ours], str(adapter), lora_config)
    input_ids = hf_models.tokens(batch=2, seq=12) % reference.config.vocab_size
    return reference, release, ours, str(adapter), input_ids, hf_models.megatron_logits(
        ours, input_ids)


def test_lora_reaches_every_k3_module_kind(adapted):
    from megatron_slmoe.lora.base import is_lora_module
    from megatron_slmoe.lora.linear import (
        LoRAColumnParallelLinear,
        LoRAReplicatedLinear,
        LoRARowParallelLinear,
    )

    _, _, ours, *_ = adapted
    kinds = {name.split("decoder.layers.", 1)[-1]: type(m).__name__
             for name, m in ours.named_modules() if is_lora_module(m)}
    kda = {f"1.self_attention.{p}": LoRAColumnParallelLinear.__name__
           for p in ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "f_b_proj")}
    kda["1.self_attention.f_a_proj"] = LoRAReplicatedLinear.__name__
    kda["1.self_attention.o_proj"] = LoRARowParallelLinear.__name__
    mla = {f"3.self_attention.{p}": LoRAColumnParallelLinear.__name__
           for p in ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                     "linear_kv_up_proj", "linear_gate")}
    mla["3.self_attention.linear_proj"] = LoRARowParallelLinear.__name__
    for name, kind in {**kda, **mla}.items():
        assert kinds.get(name) == kind, (name, kinds.get(name))
    for name in ("0.mlp.linear_fc1", "0.mlp.linear_fc2", "1.mlp.experts",
                 "1.mlp.shared_experts.linear_fc1", "1.mlp.shared_experts.linear_fc2",
                 "1.mlp.latent_down", "1.mlp.latent_up"):
        assert name in kinds, name
    # 13 layers: 9 KDA x 8 + 4 MLA x 6 + dense 2 + 12 MoE x (experts, 2 shared, 2 latent).
    assert len(kinds) == 9 * 8 + 4 * 6 + 2 + 12 * 5


def test_peft_adapter_on_the_reference_gives_our_logits(adapted, tmp_path):
    from megatron_slmoe.hf.peft_export import export_peft_adapter

    reference, release, _, adapter, input_ids, ours = adapted
    peft_dir = export_peft_adapter(adapter, release, str(tmp_path / "peft"))
    config = json.loads(open(os.path.join(peft_dir, "adapter_config.json")).read())
    assert {"q_proj", "f_a_proj", "o_proj", "g_proj", "q_a_proj", "kv_b_proj", "w1", "w2", "w3",
            "gate_proj", "routed_expert_down_proj"} <= set(config["target_modules"])
    keys = set(_tensors(peft_dir))
    prefix = "base_model.model.language_model.model.layers"
    for key in (f"{prefix}.1.block_sparse_moe.experts.5.w1.lora_A.weight",
                f"{prefix}.1.block_sparse_moe.experts.5.w2.lora_B.weight",
                f"{prefix}.1.block_sparse_moe.shared_experts.up_proj.lora_B.weight",
                f"{prefix}.1.block_sparse_moe.routed_expert_up_proj.lora_A.weight",
                f"{prefix}.1.self_attn.f_a_proj.lora_A.weight",
                f"{prefix}.3.self_attn.g_proj.lora_B.weight",
                f"{prefix}.0.mlp.gate_proj.lora_A.weight"):
        assert key in keys, key
    with torch.no_grad():
        theirs = _peft_on(reference, peft_dir, torch.float64).base_model(input_ids)
        theirs_fp32 = _peft_on(reference, peft_dir).base_model(input_ids)
    # Against the fp64 run, as close as the reference's own fp32 run is (rounding over 13
    # adapted layers: ~1.5e-5; a wrong adapter or mapping is off by far more).
    own_rounding = float((theirs_fp32.double() - theirs).abs().max())
    assert float((ours.double() - theirs).abs().max()) <= max(1e-5, 2 * own_rounding)
    with torch.no_grad():
        base = copy.deepcopy(reference).double()(input_ids)
    assert (theirs - base).abs().max() > 1e-2  # the adapter matters


def test_merged_export_writes_the_release_layout_and_reimports(adapted, tmp_path):
    from megatron_slmoe.hf.merged_export import export_merged
    from megatron_slmoe.hf.peft_export import export_peft_adapter

    reference, release, _, adapter, input_ids, _ = adapted
    merged_dir = export_merged(adapter, release, str(tmp_path / "merged"))
    base, merged = _tensors(release), _tensors(merged_dir)
    assert merged.keys() == base.keys()
    for key, tensor in base.items():
        assert merged[key].dtype == tensor.dtype and merged[key].shape == tensor.shape, key
    a_log = "language_model.model.layers.1.self_attn.A_log"
    heads = reference.config.kda_num_heads
    assert torch.equal(merged[a_log], base[a_log]) and not merged[a_log][heads:].any()
    assert json.loads(open(os.path.join(merged_dir, "config.json")).read()) == json.loads(
        open(os.path.join(release, "config.json")).read())

    # PEFT's own merge of our adapter on the reference: W + s B A.
    peft_dir = export_peft_adapter(adapter, release, str(tmp_path / "peft"))
    expected = _peft_on(reference, peft_dir).merge_and_unload()
    expected = expected.state_dict()
    written = k3ref.dequantise_release_state_dict(merged)
    for key, tensor in written.items():
        if ".experts." not in key:
            torch.testing.assert_close(tensor, expected[key], rtol=0, atol=1e-6, msg=key)
            continue
        # MXFP4: within one step of the group's largest E2M1 gap (2 x 2^(s-127)) of the merge.
        step = torch.pow(2.0, merged[key + "_scale"].double() - 127).repeat_interleave(32, dim=1)
        assert bool(((tensor.double() - expected[key].double()).abs() <= 2 * step).all()), key
    changed = ".layers.1.block_sparse_moe.experts.0.w1.weight"
    assert not torch.equal(written["language_model.model" + changed],
                           reference.state_dict()["language_model.model" + changed])

    # The requantisation report: each re-encoded expert's ||Q(W) - W|| / ||W|| against PEFT's
    # merge in bf16, as the reference's own decode of what was written gives it.
    report = json.loads(open(os.path.join(merged_dir, "requantization.json")).read())
    base_state = reference.state_dict()
    errors = []
    for key, tensor in written.items():
        if ".experts." in key and not torch.equal(expected[key], base_state[key]):
            want = expected[key].to(torch.bfloat16).double()
            errors.append(float((tensor.double() - want).norm() / want.norm()))
    stats = report["formats"]["mxfp4-pack-quantized"]
    assert list(report["formats"]) == ["mxfp4-pack-quantized"] and stats["weights"] == len(errors) > 0
    assert stats["max_rel"] == pytest.approx(max(errors), rel=1e-3)
    assert stats["mean_rel"] == pytest.approx(sum(errors) / len(errors), rel=1e-3)
    assert 0 < stats["max_rel"] < 0.2 and "max" in report["line"]

    # It re-imports with the logits of the reference holding what it wrote.
    logits, _ = hf_models.import_and_run(merged_dir, input_ids)
    holder = copy.deepcopy(reference)
    holder.load_state_dict(written)
    with torch.no_grad():
        want = holder.double()(input_ids)
    torch.testing.assert_close(logits.double(), want, rtol=1e-5, atol=1e-5)


def test_an_export_layout_k3_cannot_take_is_one_line(adapted, tmp_path, capsys):
    """K3's transformers model holds its experts per expert: no fused 3D tensor to target."""
    from megatron_slmoe.commands.convert_hf import main

    _, release, _, adapter, _, _ = adapted
    out = tmp_path / "fused"
    assert main(["export", "--adapter", str(adapter), "--hf-checkpoint", str(release),
                 "--output", str(out), "--export-hf-layout", "fused"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "has no fused 3D tensor" in err, err
    assert not out.exists()
