"""The native extension is built, loads, and registers its CPU kernels; setup.py's switches."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from megatron_slmoe.ops import native_extension_error, native_kernels

ROOT = Path(__file__).resolve().parents[2]


def test_extension_imports():
    import megatron_slmoe._C  # noqa: F401

    assert native_extension_error() is None


def test_native_kernels_lists_cpu_for_lora_grouped_linear():
    report = native_kernels()
    assert report["extension"] is True
    assert "cpu" in report["lora_grouped_linear"]
    assert report["implementations"]["cpu"] == "ATen (csrc/cpu)"


def test_platform_report_names_the_ascendc_kernel_when_one_is_registered():
    # A CANN build registers csrc/ascendc's kernels under PrivateUse1, torch_npu's dispatch key. Stand
    # in for it with a Python registration (in a fresh interpreter) and read the platform report.
    script = """
import contextlib, io, json, torch
import megatron_slmoe
lib = torch.library.Library("slmoe", "IMPL", "PrivateUse1")
for name in ("lora_grouped_linear_fwd", "lora_grouped_linear_bwd"):
    lib.impl(name, lambda *args: None)
from megatron_slmoe.platform.__main__ import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    assert main() == 0
print(json.dumps(json.loads(out.getvalue())["kernels"]))
"""
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    kernels = json.loads(done.stdout.strip().splitlines()[-1])
    assert kernels["lora_grouped_linear"] == ["cpu", "npu"]
    assert kernels["implementations"] == {"cpu": "ATen (csrc/cpu)", "npu": "AscendC (csrc/ascendc)"}


def test_ops_are_declared_in_the_slmoe_namespace():
    assert torch.ops.slmoe.lora_grouped_linear_fwd.default._schema.name == "slmoe::lora_grouped_linear_fwd"
    assert torch.ops.slmoe.lora_grouped_linear_bwd.default._schema.name == "slmoe::lora_grouped_linear_bwd"


def setup_py(**env):
    """`python setup.py --version` under extra environment variables."""
    return subprocess.run(
        [sys.executable, "setup.py", "--version"],
        cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=120,
    )


def test_setup_version_comes_from_the_package_file():
    done = setup_py(SLMOE_BUILD_NATIVE="0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "0.1.0"


def test_setup_rejects_bad_switches():
    done = setup_py(SLMOE_BUILD_CUDA="yes")
    assert done.returncode != 0 and "SLMOE_BUILD_CUDA must be 0 or 1, got 'yes'" in done.stderr
    if torch.version.cuda is None:
        done = setup_py(SLMOE_BUILD_CUDA="1")
        assert done.returncode != 0 and "is not a CUDA build" in done.stderr


def test_setup_ascend_switch():
    done = setup_py(SLMOE_BUILD_ASCEND="yes")
    assert done.returncode != 0 and "SLMOE_BUILD_ASCEND must be 0 or 1, got 'yes'" in done.stderr
    # Forced on without CANN: one line naming what is missing.
    done = setup_py(SLMOE_BUILD_ASCEND="1", ASCEND_HOME_PATH="")
    assert done.returncode != 0 and "SLMOE_BUILD_ASCEND=1 but ASCEND_HOME_PATH is not set" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_setup_without_cann_builds_as_before(tmp_path):
    # A directory that is not a CANN toolkit (no AscendC CMake support): the default stays off.
    done = setup_py(ASCEND_HOME_PATH=str(tmp_path))
    assert done.returncode == 0, done.stderr


def test_ops_import_and_fall_back_without_the_extension():
    # A fresh interpreter where `import megatron_slmoe._C` fails, as in a SLMOE_BUILD_NATIVE=0 install.
    script = """
import sys
sys.modules["megatron_slmoe._C"] = None  # makes the import raise ImportError
import torch
from megatron_slmoe.ops import choose_backend, lora_grouped_linear, native_extension_error, native_kernels
assert native_kernels() == {"extension": False, "lora_grouped_linear": [], "lora_grouped_linear_packed": [],
                            "implementations": {}}, native_kernels()
assert "megatron_slmoe._C" in native_extension_error()
assert choose_backend("lora_grouped_linear", "cpu") == "reference"
y = lora_grouped_linear(torch.ones(3, 2), torch.ones(2, 4, 2), torch.ones(2, 1, 2), torch.ones(2, 4, 1),
                        torch.tensor([1, 2]), 0.5)
assert torch.equal(y, torch.full((3, 4), 3.0))
"""
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
