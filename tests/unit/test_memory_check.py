"""The fine-tuning entry point asks the memory planner about its own layout before anything starts:
a layout predicted not to fit is refused in one line with the nearest layout that fits (or only
warned about with --memory-check warn), and no process group or model is made on the way."""

import logging

import pytest
import torch
from tests.helpers.entry_point import stand_in_base

FLAGSHIP = ["--validate-only", "--model-config", "flagship_2p8t", "--seq-length", "4096",
            "--global-batch-size", "512", "--micro-batch-size", "1", "--device-memory-gb", "64",
            "--bf16"]
BAD_LAYOUT = ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "1",
              "--expert-model-parallel-size", "8"]


@pytest.fixture
def world_512(monkeypatch, tmp_path):
    """512 ranks; the flagship's flags with a base named (LoRA needs one; the check loads none),
    its output on a cluster's file system (the flagship's checkpoints do not fit this machine)."""
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**50, 0, 2**50))
    monkeypatch.setenv("WORLD_SIZE", "512")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    return [*FLAGSHIP, "--base-checkpoint", str(stand_in_base(tmp_path / "base"))]


def test_infeasible_layout_is_refused_with_the_nearest_that_fits(world_512, capsys):
    from megatron_slmoe.training.finetune import main

    initialised = torch.distributed.is_initialized()
    assert main([*world_512, *BAD_LAYOUT]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "layout tp8 pp1 ep8 dp64" in err and "does not fit" in err
    assert "nearest layout that fits: tp" in err and "--memory-check warn" in err
    assert torch.distributed.is_initialized() == initialised  # nothing was started


def test_warn_lets_it_through_with_the_same_verdict(world_512, caplog):
    from megatron_slmoe.training.finetune import main

    with caplog.at_level(logging.WARNING):
        assert main([*world_512, *BAD_LAYOUT, "--memory-check", "warn"]) == 0
    assert any("does not fit" in r.getMessage() for r in caplog.records)


def test_a_layout_that_fits_passes(world_512):
    from megatron_slmoe.training.finetune import main

    fitting = ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "8",
               "--expert-model-parallel-size", "64", "--recompute-granularity", "selective",
               "--recompute-modules", "core_attn"]  # the planner's best for 512 x 64 GiB
    assert main([*world_512, *fitting]) == 0


def test_no_device_memory_no_check():
    from megatron_slmoe.training.config import RunConfig
    from megatron_slmoe.model.model_file import load_model_config
    from megatron_slmoe.training.inputs import memory_check

    import megatron_slmoe

    assert megatron_slmoe.PLATFORM.device_memory_bytes() is None  # the CPU
    assert memory_check(RunConfig(), 1, megatron_slmoe.PLATFORM, load_model_config("tiny")) is None
