"""slmoe-convert-hf import (tools/convert_hf.py): an HF checkpoint becomes a Megatron dist
checkpoint plus the model file to build it with, and that model (built and loaded the way
``--base-checkpoint`` loads it) gives transformers' logits. Bad input is one line naming the file
and the tensor, exit code 2, nothing left at the output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_slmoe.commands import convert_hf
from tests.helpers import hf_models

pytestmark = pytest.mark.usefixtures("megatron_single_rank")

TOOL = Path(__file__).resolve().parents[2] / "tools" / "convert_hf.py"


def _staging_left(directory) -> list[str]:
    """Staging directories of utils.atomic (hidden names) left in ``directory``."""
    return [p for p in os.listdir(directory) if p.startswith(".")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A DeepSeek-V3 checkpoint (with tokenizer files) and a Qwen3-MoE checkpoint in 3 indexed
    shards, with the reference models."""
    root = tmp_path_factory.mktemp("convert-hf")
    deepseek = hf_models.save_family("deepseek_v3", str(root / "deepseek"))
    (root / "deepseek" / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    qwen = hf_models.build("qwen3_moe")
    qwen.save_pretrained(str(root / "qwen"), max_shard_size="30KB")
    return root, {"deepseek": deepseek, "qwen": qwen}


def test_import_writes_a_base_checkpoint_that_gives_hf_logits(checkpoints, tmp_path):
    from megatron.core import dist_checkpointing

    from megatron_slmoe.model.build import build_gpt_model
    from megatron_slmoe.model.model_file import load_model_config

    root, models = checkpoints
    out = tmp_path / "converted"
    assert convert_hf.main(["import", "--hf-checkpoint", str(root / "deepseek"),
                         "--output", str(out)]) == 0
    assert (out / "tokenizer_config.json").exists() and (out / "model_config.txt").exists()
    assert not _staging_left(tmp_path)
    # What the fine-tuning entry point does with --model-config / --base-checkpoint.
    mc = load_model_config(str(out / "model_config.yaml"))
    model = build_gpt_model(mc, mc.transformer_config(use_cpu_initialization=True,
                                                      perform_initialization=False))
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(out)))
    input_ids = hf_models.tokens()
    torch.testing.assert_close(hf_models.megatron_logits(model, input_ids),
                               hf_models.hf_logits(models["deepseek"], input_ids),
                               rtol=1e-5, atol=1e-5)


def test_export_weights_writes_an_imported_checkpoint_back_bitwise(checkpoints, tmp_path,
                                                                    capsys):
    """import -> Megatron dist checkpoint -> export-weights: every tensor bitwise as
    save_pretrained wrote it (what a full fine-tune's --save-base goes back to HF through); a
    checkpoint of another model is one line, exit 2, nothing written."""
    root, _ = checkpoints
    megatron = tmp_path / "megatron"
    assert convert_hf.main(["import", "--hf-checkpoint", str(root / "qwen"),
                            "--output", str(megatron)]) == 0
    out = tmp_path / "hf-out"
    assert convert_hf.main(["export-weights", "--checkpoint", str(megatron), "--hf-checkpoint",
                            str(root / "qwen"), "--output", str(out),
                            "--max-shard-size-mib", "1"]) == 0
    hf_models.assert_same_tensors(root / "qwen", out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"
    capsys.readouterr()
    other = tmp_path / "other"
    assert convert_hf.main(["export-weights", "--checkpoint", str(megatron), "--hf-checkpoint",
                            str(root / "deepseek"), "--output", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not load into the model of" in err, err
    assert not other.exists() and not _staging_left(tmp_path)


# --- bad input -------------------------------------------------------------------------------------


def _copy(root, name, tmp_path) -> Path:
    target = tmp_path / name
    shutil.copytree(root / name, target)
    return target


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _shards(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix == ".safetensors")


def _missing_shard(d):
    shard = _shards(d)[1]
    shard.unlink()
    return [shard.name, "missing shard", "places tensor model."]


def _missing_shard_without_index(d):
    (d / "model.safetensors.index.json").unlink()
    _shards(d)[-1].unlink()
    return ["is in no shard", "tensor model."]


def _truncated_shard(d):
    shard = _shards(d)[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    return [shard.name, "truncated: tensor "]


def _index_names_absent_file(d):
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = "model-99999-of-99999.safetensors"
    index_path.write_text(json.dumps(index))
    return ["model-99999-of-99999.safetensors", "missing shard", key]


def _sizes_disagree(d):
    _edit_config(d, moe_intermediate_size=24)
    return ["has shape", "config.json implies", "experts.0.gate_proj.weight"]


def _unknown_architecture(d):
    _edit_config(d, architectures=["FooMoeForCausalLM"])
    return ["config.json", "unknown architecture 'FooMoeForCausalLM'", "Qwen3MoeForCausalLM"]


def _config_not_json(d):
    (d / "config.json").write_text("{not json")
    return ["config.json", "not valid JSON"]


BAD = {
    "missing-shard": _missing_shard,
    "missing-shard-no-index": _missing_shard_without_index,
    "truncated-shard": _truncated_shard,
    "index-names-absent-file": _index_names_absent_file,
    "sizes-disagree": _sizes_disagree,
    "unknown-architecture": _unknown_architecture,
    "config-not-json": _config_not_json,
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_is_one_line_and_exit_2(checkpoints, tmp_path, capsys, case):
    root, _ = checkpoints
    directory = _copy(root, "qwen", tmp_path)
    expected = BAD[case](directory)
    out = tmp_path / "out"
    assert convert_hf.main(["import", "--hf-checkpoint", str(directory), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in expected:
        assert fragment in lines[0], (fragment, lines[0])
    assert not out.exists() and not _staging_left(tmp_path)


def test_nemotron_h_with_mamba_blocks_is_refused(tmp_path, capsys):
    directory = tmp_path / "nemotron"
    hf_models.save_family("nemotron_h", str(directory))
    _edit_config(directory, layers_block_type=["mamba", "moe", "full_attention", "mlp"])
    assert convert_hf.main(["import", "--hf-checkpoint", str(directory),
                         "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "layers_block_type[0] is a Mamba block" in err and len(err.strip().splitlines()) == 1


def test_fp8_weight_without_its_scale(tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import save_file

    model = hf_models.build("deepseek_v3")
    hf_models.save_fp8(model, str(tmp_path / "fp8"))
    path = tmp_path / "fp8" / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    dropped = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    del tensors[dropped]
    save_file(tensors, str(path))
    assert convert_hf.main(["import", "--hf-checkpoint", str(tmp_path / "fp8"),
                         "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "tensor model.layers.1.self_attn.o_proj.weight is FP8" in err and dropped in err


def test_vocab_not_divisible_and_existing_output(checkpoints, tmp_path, capsys):
    root, _ = checkpoints
    directory = _copy(root, "qwen", tmp_path)
    _edit_config(directory, vocab_size=63)
    assert convert_hf.main(["import", "--hf-checkpoint", str(directory), "--output",
                         str(tmp_path / "out"), "--tensor-model-parallel-size", "2",
                         "--no-hf-shape-check"]) == 2
    assert "does not divide the model's vocab_size 63" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    assert convert_hf.main(["import", "--hf-checkpoint", str(directory), "--output", str(busy)]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert (busy / "keep.txt").read_text() == "x"


def test_command_line_exit_code_without_traceback(checkpoints, tmp_path):
    root, _ = checkpoints
    directory = _copy(root, "qwen", tmp_path)
    _unknown_architecture(directory)
    proc = subprocess.run([sys.executable, str(TOOL), "import", "--hf-checkpoint", str(directory),
                           "--output", str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "SLMOE_PLATFORM": "cpu"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "Traceback" not in proc.stderr and "unknown architecture" in proc.stderr


def test_import_adapter_warns_when_the_adapter_names_another_base(checkpoints, tmp_path, caplog):
    """Its shapes fit, so it is converted, but it was made for another model: a warning names
    both (it was accepted without a word)."""
    import logging

    from peft import LoraConfig, get_peft_model

    from megatron_slmoe.hf.peft_import import peft_to_adapter

    root, models = checkpoints
    peft = get_peft_model(hf_models.build("qwen3_moe"),
                          LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"]))
    peft.peft_config["default"].base_model_name_or_path = "someone/another-model"
    peft.save_pretrained(tmp_path / "peft")
    caplog.set_level(logging.WARNING)
    peft_to_adapter(str(tmp_path / "peft"), str(root / "qwen"), str(tmp_path / "out"))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'someone/another-model'" in m and str(root / "qwen") in m for m in warned), warned
