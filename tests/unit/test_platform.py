"""Platform detection and its command line: overrides, unavailable platforms and backends give
one clear line (exit code 2 on the command line), never a traceback."""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_slmoe import platform as slmoe_platform
from megatron_slmoe.platform import PlatformError, detect


def _run_cli(**env):
    full_env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-m", "megatron_slmoe.platform"], env=full_env,
                          capture_output=True, text=True, timeout=120)


def test_detects_this_machine(monkeypatch):
    monkeypatch.delenv("SLMOE_PLATFORM", raising=False)
    monkeypatch.delenv("SLMOE_DIST_BACKEND", raising=False)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    chosen = detect()
    assert chosen.name == expected
    assert chosen.backend == {"cuda": "nccl", "cpu": "gloo"}[expected]


@pytest.mark.parametrize("value, message", [
    ("gpu", "SLMOE_PLATFORM='gpu' is not one of"),
    ("npu", "no Ascend NPU is usable"),
])
def test_bad_platform_override_is_one_clear_error(monkeypatch, value, message):
    monkeypatch.setenv("SLMOE_PLATFORM", value)
    with pytest.raises(PlatformError, match=message):
        detect()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_override_without_cuda(monkeypatch):
    monkeypatch.setenv("SLMOE_PLATFORM", "cuda")
    with pytest.raises(PlatformError, match="CUDA is not available"):
        detect()


@pytest.mark.parametrize("backend, message", [
    ("mpi2", "is not one of nccl, hccl, gloo"),
    ("hccl", "hccl needs platform npu"),
])
def test_bad_backend_override(monkeypatch, backend, message):
    monkeypatch.setenv("SLMOE_PLATFORM", "cpu")
    monkeypatch.setenv("SLMOE_DIST_BACKEND", backend)
    with pytest.raises(PlatformError, match=message):
        detect()


def test_cli_prints_json_with_patches():
    proc = _run_cli(SLMOE_PLATFORM="cpu")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["platform"] == "cpu" and report["backend"] == "gloo"
    assert report["kernels"]["lora_grouped_linear"] == ["cpu"]
    targets = {p["target"] for p in report["patches"]}
    assert "torch.cuda.current_device" in targets
    assert all(p["reason"] for p in report["patches"])


@pytest.mark.parametrize("env", [
    {"SLMOE_PLATFORM": "tpu"},
    {"SLMOE_PLATFORM": "cpu", "SLMOE_DIST_BACKEND": "nccl"},
])
def test_cli_rejects_bad_override_in_one_line(env):
    proc = _run_cli(**env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr


def test_current_platform_is_cached_and_matches_package():
    import megatron_slmoe

    assert slmoe_platform.current() is megatron_slmoe.PLATFORM


def test_apply_adaptor_is_idempotent():
    import warnings

    first = slmoe_platform.apply_adaptor()
    patches, filters = slmoe_platform.applied_patches(), list(warnings.filters)
    assert slmoe_platform.apply_adaptor() is first
    assert slmoe_platform.applied_patches() == patches and warnings.filters == filters
