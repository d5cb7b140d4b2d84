"""tools/merge_lora.py: base dist checkpoint + adapter -> merged dist checkpoint whose model gives
the outputs of the base model with its adapter; bad input is one line and exit code 2."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from tests.helpers.lora_models import MODEL_YAML, build_model, logits, lora_config, randomize

pytestmark = pytest.mark.usefixtures("megatron_single_rank")

TOOL = Path(__file__).resolve().parents[2] / "tools" / "merge_lora.py"


def _tool():
    spec = importlib.util.spec_from_file_location("merge_lora_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A model config file, a base dist checkpoint, an adapter, and the adapted model's logits."""
    from megatron.core import dist_checkpointing

    from megatron_slmoe.lora.adapter import base_identity, save_adapter
    from megatron_slmoe.lora.inject import inject_lora
    from megatron_slmoe.model.model_file import load_model_config

    root = tmp_path_factory.mktemp("merge-tool")
    config_path = root / "merge_unit.yaml"
    config_path.write_text(MODEL_YAML)
    mc = load_model_config(str(config_path))
    model = build_model(mc)
    model.eval()
    (root / "base").mkdir()
    dist_checkpointing.save(model.sharded_state_dict(), str(root / "base"))
    base_logits = logits(model)
    inject_lora(model, lora_config())
    randomize(model)
    save_adapter(model, root / "adapter", lora_config(), base_identity(mc))
    return {"root": root, "config": str(config_path), "mc": mc, "logits": logits(model),
            "base_logits": base_logits}


def _args(inputs, **changes):
    root = inputs["root"]
    fields = {"--base-checkpoint": str(root / "base"), "--adapter": str(root / "adapter"),
              "--model-config": inputs["config"], "--output": str(root / "merged")}
    fields.update(changes)
    return [x for kv in fields.items() for x in kv]


def test_merged_checkpoint_reproduces_the_adapted_model(inputs, capsys):
    from megatron.core import dist_checkpointing

    assert _tool().main(_args(inputs)) == 0
    merged_dir = inputs["root"] / "merged"
    assert "merged" in capsys.readouterr().out
    assert not [p for p in os.listdir(inputs["root"]) if p.startswith(".")]
    model = build_model(inputs["mc"], seed=3)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(merged_dir)))
    model.eval()
    out = logits(model)
    torch.testing.assert_close(out, inputs["logits"], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, inputs["base_logits"], atol=1e-3)


@pytest.mark.parametrize("change, needle", [
    ({"--base-checkpoint": "/nonexistent/base"}, "--base-checkpoint /nonexistent/base: no such"),
    ({"--adapter": "/nonexistent/adapter"}, "--adapter /nonexistent/adapter: no such"),
    ({"--model-config": "no_such_model"}, "no model config named 'no_such_model'"),
    ({"--model-config": "tiny"}, "cannot load base checkpoint"),
    ({"--base-checkpoint": "{root}/adapter"}, "cannot load base checkpoint"),
    ({"--output": "{root}/adapter"}, "exists and is not an empty directory"),
], ids=["no-base", "no-adapter", "bad-config", "other-model", "not-a-checkpoint", "output-exists"])
def test_bad_input_is_one_line_and_exit_code_2(inputs, capsys, change, needle):
    change = {k: v.format(root=inputs["root"]) for k, v in change.items()}
    assert _tool().main(_args(inputs, **{"--output": str(inputs["root"] / "never"), **change})) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err, err
    assert err.count("\n") == 1, err
    assert not os.path.exists(inputs["root"] / "never")


def test_adapter_for_another_base_model_is_refused(inputs, capsys, tmp_path):
    """The adapter records its base model's architecture; one of another model is refused
    naming both, before anything is merged."""
    import json
    import shutil

    adapter = tmp_path / "adapter"
    shutil.copytree(inputs["root"] / "adapter", adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model"].update(model_config="someone_elses", model_fingerprint="0" * 64)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    assert _tool().main(_args(inputs, **{"--adapter": str(adapter),
                                         "--output": str(tmp_path / "out")})) == 2
    err = capsys.readouterr().err
    assert "was trained on another model ('someone_elses') than 'merge_unit'" in err, err
    assert not os.path.exists(tmp_path / "out")


def test_the_same_model_under_another_name_is_its_base(inputs, capsys, tmp_path):
    """An HF checkpoint's directory and the model file its import wrote name one model twice:
    the adapter belongs to it whatever its config file is called."""
    other_config = tmp_path / "other_name.yaml"
    other_config.write_text(MODEL_YAML)
    assert _tool().main(_args(inputs, **{"--model-config": str(other_config),
                                         "--output": str(tmp_path / "out")})) == 0, \
        capsys.readouterr().err


def test_the_model_config_comes_from_the_base(inputs, capsys, tmp_path):
    """A base that records its model (as a LoRA base or an import writes it) needs no --config;
    a --config of another model is refused before anything is built (not a 135 GB allocation)."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(inputs["root"] / "base", base)
    shutil.copyfile(inputs["config"], base / "model_config.yaml")
    args = _args(inputs, **{"--base-checkpoint": str(base), "--output": str(tmp_path / "out")})
    without_config = [a for i, a in enumerate(args)
                      if a != "--model-config" and (i == 0 or args[i - 1] != "--model-config")]
    assert _tool().main([*without_config, "--model-config", "flagship_2p8t"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds model" in err and "not 'flagship_2p8t'" in err, err
    assert not os.path.exists(tmp_path / "out")
    assert _tool().main(without_config) == 0
    assert (tmp_path / "out" / "metadata.json").is_file()
