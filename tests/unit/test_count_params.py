"""Parameter census on the meta device: the tiny model's counts equal those of the real model and
of a computation from the config alone; the flagship is 2.8e12 parameters and takes no memory;
tools/count_params.py answers bad input with one line and exit code 2."""

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_slmoe.model.census import build_meta_model, count_parameters, meta_device
from megatron_slmoe.model.build import build_gpt_model
from megatron_slmoe.model.model_file import load_model_config

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "count_params.py"


def _moe_layers(t: dict) -> int:
    freq = t.get("moe_layer_freq", 1)
    if isinstance(freq, list):
        return sum(freq)
    return sum(1 for i in range(t["num_layers"]) if i % freq == 0)


def _routed_params_per_expert(t: dict) -> int:
    """fc1 (gate and up) and fc2 of one SwiGLU expert in the latent width."""
    width = t.get("moe_latent_size") or t["hidden_size"]
    return 3 * t["moe_ffn_hidden_size"] * width


def test_meta_device_rewrites_explicit_devices():
    with meta_device():
        tensors = [torch.empty(3, device="cpu"), torch.zeros(2, 2, device=torch.device("cpu")),
                   torch.ones(4), torch.arange(5), torch.tensor([1.0, 2.0]),
                   torch.empty(2).to("cpu")]
    assert all(t.is_meta for t in tensors)
    assert not torch.empty(1).is_meta  # only inside


def test_tiny_census_equals_real_model_and_config(megatron_single_rank):
    mc = load_model_config("tiny")
    census = count_parameters(mc)
    real = build_gpt_model(mc, mc.transformer_config(use_cpu_initialization=True))
    assert not any(p.is_meta for p in real.parameters())
    # Parameters and the routers' correction biases (buffers a checkpoint holds as weights).
    real_total = sum(p.numel() for p in real.parameters()) + sum(
        b.numel() for n, b in real.named_buffers() if n.endswith("router.expert_bias"))
    assert census["breakdown"]["router_bias"] == _moe_layers(dict(mc.transformer)) * dict(
        mc.transformer)["num_moe_experts"]
    assert census["total_params"] == real_total
    assert sum(census["breakdown"].values()) == real_total

    t = dict(mc.transformer)
    experts, topk, layers = t["num_moe_experts"], t["moe_router_topk"], _moe_layers(t)
    per_expert = _routed_params_per_expert(t)
    assert census["breakdown"]["routed_experts"] == layers * experts * per_expert
    assert census["active_params_per_token"] == real_total - layers * (experts - topk) * per_expert
    assert census["active_fraction"] == census["active_params_per_token"] / real_total
    assert (census["num_moe_experts"], census["moe_router_topk"]) == (experts, topk)
    d, latent = t["hidden_size"], t["moe_latent_size"]
    assert census["breakdown"]["latent"] == layers * 2 * d * latent
    assert census["breakdown"]["router"] == layers * experts * d
    assert census["breakdown"]["shared_experts"] == (
        layers * 3 * d * t["moe_shared_expert_intermediate_size"])
    assert census["breakdown"]["embedding"] == mc.vocab_size * d


def test_meta_model_holds_no_storage(megatron_single_rank):
    model = build_meta_model(load_model_config("tiny"))
    assert all(p.is_meta for p in model.parameters())


def _run_tool(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # This checkout's package, whatever is installed.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": path, **(env or {})},
                          timeout=300)


def test_flagship_is_2p8_trillion_on_meta():
    proc = _run_tool("--model-config", "flagship_2p8t", "--json")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    census = json.loads(lines[0])
    assert abs(census["total_params"] - 2.8e12) <= 0.02 * 2.8e12
    assert (census["num_moe_experts"], census["moe_router_topk"]) == (896, 16)
    # Active: the 16/896 routed share plus the always-on attention, embeddings and shared expert.
    assert 16 / 896 < census["active_fraction"] < 0.025
    assert census["active_params_per_token"] < census["total_params"]
    assert sum(census["breakdown"].values()) == census["total_params"]
    assert census["peak_rss_mib"] < 2048  # 2.8e12 real parameters would be terabytes


def _load_tool():
    spec = importlib.util.spec_from_file_location("count_params_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("content,expected", [
    (None, "cannot read"),
    ("model:\n  num_layers: [1\n", "invalid YAML"),
    ("model:\n  num_layers: 2\n  bogus_field: 1\n", "bogus_field"),
])
def test_tool_bad_input_in_process(tmp_path, capsys, content, expected):
    path = tmp_path / "model.yaml"
    if content is not None:
        path.write_text(content)
    assert _load_tool().main(["--model-config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and expected in err


def test_tool_table_output(megatron_single_rank, capsys):
    megatron_logger = logging.getLogger("megatron")
    level = megatron_logger.level
    try:
        assert _load_tool().main(["--model-config", "tiny"]) == 0
    finally:
        megatron_logger.setLevel(level)  # the tool quiets Megatron's construction chatter
    out = capsys.readouterr().out
    assert "total parameters" in out and "active per token" in out and "routed_experts" in out


def test_tool_invalid_config_exits_2_with_one_line(tmp_path):
    text = (ROOT / "megatron_slmoe" / "model" / "configs" / "tiny.yaml").read_text()
    path = tmp_path / "bad.yaml"
    path.write_text(text.replace("moe_router_topk: 2", "moe_router_topk: 9"))
    proc = _run_tool("--model-config", str(path), "--json")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "--moe-router-topk" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_tool_platform_error_exits_2_with_one_line():
    proc = _run_tool("--model-config", "tiny", env={"SLMOE_PLATFORM": "nonsense"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "SLMOE_PLATFORM" in proc.stderr
