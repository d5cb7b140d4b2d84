"""Adapter files on one rank: save -> load is bitwise, the directory holds safetensors and JSON
only (no pickle), saving is atomic and replaces an adapter only when complete, mismatched adapters
are refused with one line, and merging equals the model with its adapter."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from tests.helpers.lora_models import build_model, logits, lora_config, model_config, randomize

pytestmark = pytest.mark.usefixtures("megatron_single_rank")

BASE_INFO = {"model_config": "lora_unit"}


@pytest.fixture(scope="module")
def mc(tmp_path_factory):
    return model_config(tmp_path_factory)


@pytest.fixture(scope="module")
def saved(mc, tmp_path_factory):
    """A model with a random adapter on every target, its base weights and the saved adapter."""
    from megatron_slmoe.lora.adapter import save_adapter
    from megatron_slmoe.lora.inject import inject_lora

    model = build_model(mc)
    model.eval()
    base_state = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    inject_lora(model, lora_config())
    randomize(model)
    directory = tmp_path_factory.mktemp("adapters") / "adapter"
    assert save_adapter(model, directory, lora_config(), BASE_INFO) == str(directory)
    return model, base_state, str(directory)


def _fresh(mc, base_state, inject: bool = True):
    """The same base model (other initial weights, then the base state) with fresh adapters."""
    from megatron_slmoe.lora.inject import inject_lora

    model = build_model(mc, seed=1)
    model.load_state_dict(base_state, strict=False)  # no _extra_state entries
    model.eval()
    if inject:
        inject_lora(model, lora_config(init_seed=99))
    return model


def _file_tensors(directory):
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "adapter_model.safetensors"))


def test_save_load_round_trip_is_bitwise(mc, saved):
    from megatron_slmoe.lora.adapter import load_adapter, lora_state_dict
    from megatron_slmoe.lora.inject import lora_modules

    model, base_state, directory = saved
    other = _fresh(mc, base_state)
    before = lora_state_dict(other)
    assert load_adapter(other, directory, base_info=BASE_INFO) == lora_config()
    original, loaded = lora_state_dict(model), lora_state_dict(other)
    assert sorted(original) == sorted(loaded) == sorted(_file_tensors(directory))
    for name, tensor in original.items():
        assert torch.equal(loaded[name], tensor), name
        assert torch.equal(_file_tensors(directory)[name], tensor), name
    assert any(not torch.equal(before[n], loaded[n]) for n in loaded)
    for mine, theirs in zip(lora_modules(model), lora_modules(other)):
        for p, q in zip(mine.lora_parameters(), theirs.lora_parameters()):
            assert torch.equal(p, q)
    assert torch.equal(logits(other), logits(model))


def test_adapter_names_are_global_and_per_expert(saved):
    _, _, directory = saved
    tensors = _file_tensors(directory)
    for expert in range(4):
        assert tensors[f"decoder.layers.1.mlp.experts.{expert}.linear_fc1.lora_A.weight"].shape == (4, 16)
        assert tensors[f"decoder.layers.1.mlp.experts.{expert}.linear_fc1.lora_B.weight"].shape == (48, 4)
        assert tensors[f"decoder.layers.1.mlp.experts.{expert}.linear_fc2.lora_A.weight"].shape == (4, 24)
        assert tensors[f"decoder.layers.1.mlp.experts.{expert}.linear_fc2.lora_B.weight"].shape == (16, 4)
    assert tensors["decoder.layers.0.mlp.linear_fc1.lora_B.weight"].shape == (96, 4)
    assert tensors["decoder.layers.1.mlp.router.lora_B.weight"].shape == (4, 4)
    assert tensors["decoder.layers.1.mlp.latent_up.lora_A.weight"].shape == (4, 16)
    assert tensors["decoder.layers.1.mlp.shared_experts.linear_fc2.lora_A.weight"].shape == (4, 24)
    assert len(tensors) == 2 * 11 + 4 * 4  # 11 adapted linears, 4 experts x fc1/fc2 x A/B


def test_adapter_directory_is_safetensors_and_json_only(saved):
    _, _, directory = saved
    assert sorted(os.listdir(directory)) == ["adapter_config.json", "adapter_model.safetensors"]
    parent = os.path.dirname(directory)
    assert os.listdir(parent) == ["adapter"], "temporary directories left behind"
    with open(os.path.join(directory, "adapter_model.safetensors"), "rb") as fh:
        data = fh.read()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_len])  # safetensors: a JSON header, then raw bytes
    assert header["__metadata__"]["tensor_naming"] == "megatron_slmoe.global.v1"
    assert not data.startswith(b"\x80") and b"PK\x03\x04" not in data[:4]  # not pickle, not zip
    with open(os.path.join(directory, "adapter_config.json"), encoding="utf-8") as fh:
        config = json.load(fh)
    assert config["format_version"] == 1
    assert config["base_model"] == BASE_INFO
    assert config["lora"]["rank"] == 4 and config["lora"]["alpha"] == 8.0


def test_saving_again_replaces_the_adapter_atomically(mc, saved, tmp_path):
    from megatron_slmoe.lora.adapter import AdapterError, save_adapter

    model, _, _ = saved
    target = tmp_path / "adapter"
    save_adapter(model, target, lora_config(), {"model_config": "first"})
    save_adapter(model, target, lora_config(), {"model_config": "second"})
    assert json.loads((target / "adapter_config.json").read_text())["base_model"] == {
        "model_config": "second"}
    assert sorted(os.listdir(tmp_path)) == ["adapter"]
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(AdapterError, match="holds no adapter; refusing") as err:
        save_adapter(model, other, lora_config(), {})
    assert "\n" not in str(err.value)
    assert (other / "keep.txt").read_text() == "mine"
    with pytest.raises(AdapterError, match="lora.rank"):
        save_adapter(model, tmp_path / "x", lora_config(rank=8), {})


def test_load_injects_into_a_plain_model(mc, saved):
    from megatron_slmoe.lora.adapter import load_adapter

    model, base_state, directory = saved
    plain = _fresh(mc, base_state, inject=False)
    load_adapter(plain, directory)
    assert torch.equal(logits(plain), logits(model))


def _rewrite(directory, target, tensors=None, config_text=None):
    from safetensors.torch import save_file

    os.makedirs(target, exist_ok=True)
    tensors = tensors if tensors is not None else _file_tensors(directory)
    save_file(tensors, os.path.join(target, "adapter_model.safetensors"))
    if config_text is None:
        with open(os.path.join(directory, "adapter_config.json"), encoding="utf-8") as fh:
            config_text = fh.read()
    with open(os.path.join(target, "adapter_config.json"), "w", encoding="utf-8") as fh:
        fh.write(config_text)
    return str(target)


def recorded_with_tokenizer(directory, tmp_path):
    text = open(os.path.join(directory, "adapter_config.json")).read()
    return _rewrite(directory, tmp_path / "tokenizer", config_text=text.replace(
        '"base_model": {', '"base_model": {"tokenizer_sha256": "%s", ' % ("a" * 64), 1))


def test_mismatched_adapters_are_refused_with_one_line(mc, saved, tmp_path):
    from megatron_slmoe.lora.adapter import AdapterError, load_adapter

    _, base_state, directory = saved
    model = _fresh(mc, base_state)
    tensors = _file_tensors(directory)
    qkv = "decoder.layers.0.self_attention.linear_qkv.lora_A.weight"
    wrong_shape = dict(tensors, **{qkv: torch.zeros(4, 31)})
    missing = {k: v for k, v in tensors.items() if k != qkv}
    extra = dict(tensors, **{"decoder.layers.7.mlp.router.lora_A.weight": torch.zeros(4, 32)})
    config_text = open(os.path.join(directory, "adapter_config.json")).read()
    cases = [
        (_rewrite(directory, tmp_path / "shape", wrong_shape), "has shape \\[4, 31\\]"),
        (_rewrite(directory, tmp_path / "missing", missing), f"has no tensor {qkv}"),
        (_rewrite(directory, tmp_path / "extra", extra), "holds 39 tensors but this model.s adapters use 38"),
        (_rewrite(directory, tmp_path / "rank", config_text=config_text.replace(
            '"rank": 4', '"rank": 8')), "lora.rank 8"),
        (_rewrite(directory, tmp_path / "version", config_text=config_text.replace(
            '"format_version": 1', '"format_version": 9')), "format_version 9"),
        (str(tmp_path / "nowhere"), "cannot read"),
    ]
    for bad_dir, needle in cases:
        with pytest.raises(AdapterError, match=needle) as err:
            load_adapter(model, bad_dir)
        assert "\n" not in str(err.value), needle
    corrupt = _rewrite(directory, tmp_path / "corrupt")
    with open(os.path.join(corrupt, "adapter_model.safetensors"), "wb") as fh:
        fh.write(b"\x80\x04not safetensors")
    with pytest.raises(AdapterError, match="not a readable safetensors file"):
        load_adapter(model, corrupt)
    # The base is compared by architecture and tokenizer (an adapter without a record of
    # either is checked by its tensors alone, above).
    from megatron_slmoe.lora.adapter import base_identity
    from megatron_slmoe.model.model_file import load_model_config

    identity = base_identity(mc)
    recorded = _rewrite(directory, tmp_path / "recorded", config_text=config_text.replace(
        '"base_model": {', '"base_model": {"model_fingerprint": "%s", ' % identity[
            "model_fingerprint"], 1))
    load_adapter(model, recorded, base_info=identity)  # its own model, under any name
    with pytest.raises(AdapterError, match="trained on another model .* than 'tiny'"):
        load_adapter(model, recorded, base_info=base_identity(load_model_config("tiny")))
    with pytest.raises(AdapterError, match="another tokenizer than this tokenizer"):
        load_adapter(model, recorded_with_tokenizer(directory, tmp_path),
                     base_info={"tokenizer_sha256": "b" * 64})


def test_merge_equals_the_model_with_its_adapter(mc, saved):
    from megatron_slmoe.lora.adapter import load_adapter, merge_lora
    from megatron_slmoe.lora.inject import lora_modules

    model, base_state, directory = saved
    other = _fresh(mc, base_state)
    load_adapter(other, directory)
    expected = logits(other)
    qkv = other.decoder.layers[0].self_attention.linear_qkv
    delta = qkv.lora_scaling * qkv.lora_B.weight @ qkv.lora_A.weight
    w0 = qkv.weight.detach().clone()
    experts = other.decoder.layers[1].mlp.experts
    e_delta = experts.lora_scaling * experts.fc2_lora_B[3] @ experts.fc2_lora_A[3]
    e0 = experts.fc2_weight[3].detach().clone()
    merged = merge_lora(other)
    assert len(merged) == 12 and not lora_modules(other)
    torch.testing.assert_close(logits(other), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qkv.weight, w0 + delta)
    torch.testing.assert_close(experts.fc2_weight[3], e0 + e_delta)
    assert type(qkv).__name__ == "ColumnParallelLinear"
    assert type(experts).__name__ == "LatentSwiGLUExperts"
    assert type(other.decoder.layers[1].mlp.router).__name__ == "SLMoERouter"
    assert sorted(other.state_dict()) == sorted(build_model(mc).state_dict())
    assert not any("lora" in k for k in other.sharded_state_dict())


def test_lora_sharded_state_dict_holds_only_the_adapter(saved):
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    from megatron_slmoe.lora.adapter import lora_sharded_state_dict

    model, _, _ = saved
    sharded = lora_sharded_state_dict(model)
    assert len(sharded) == 2 * 11 + 4
    assert all("lora" in k for k in sharded)
    # the gated fc1's B is split into gate and up halves like the base weight
    assert isinstance(sharded["decoder.layers.0.mlp.linear_fc1.lora_B.weight"], ShardedTensorFactory)
    experts_a = sharded["decoder.layers.1.mlp.experts.fc1_lora_A"]
    assert experts_a.global_shape == (4, 4, 16)
