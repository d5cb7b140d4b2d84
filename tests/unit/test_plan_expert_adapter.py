"""The planner prices the routed experts' LoRA at their own rank and layout (issue 42 item 3):
``--expert-lora-rank``, ``--moe-rank-scaling`` and ``--expert-lora-layout`` in ``RunSettings``,
per-rank adapter weights, gradients and optimizer state in ``plan.memory`` (through
``plan.adapter_state``), and the OOM report naming the expert adapter's levers with what each
saves per rank.

References: the trainable parameters of the small Stable Latent MoE GPT built with LoRA injected
(every rank and layout, fc1/fc2 alone too); for Kimi K3 the saving written out here from the
shape's sizes (an expert's fc1 LoRA r (l + 2f), fc2's r (f + l); 18 bytes per bf16 parameter:
the weight, an fp32 gradient, Adam's two fp32 moments and the fp32 main copy)."""

import pytest

from tests.helpers import lora_models

pytestmark = pytest.mark.usefixtures("megatron_single_rank")

TINY_FP32 = dict(dtype="fp32", seq_length=16, global_batch_size=2, moe_imbalance=1.0)


@pytest.fixture(scope="module")
def mc(tmp_path_factory):
    return lora_models.model_config(tmp_path_factory)


@pytest.mark.parametrize("layout, lora", [
    ("per-expert", dict(moe_rank_scaling=True)),  # 4 // top-2
    ("per-expert", dict(expert_rank=3)),
    ("shared-outer", dict(expert_rank=2)),
    ("shared-outer", dict(targets=["linear_qkv", "linear_fc1"])),
    ("shared-outer", dict(targets=["linear_fc2", "router"])),
], ids=["per-expert-scaled", "per-expert-r3", "shared-outer-r2", "shared-outer-fc1",
        "shared-outer-fc2"])
def test_planned_trainable_parameters_equal_the_built_models(mc, layout, lora):
    from megatron_slmoe.lora.inject import inject_lora
    from megatron_slmoe.plan import ModelShape, RunSettings
    from megatron_slmoe.plan.devices import DeviceSpec
    from megatron_slmoe.plan.memory import estimate_memory

    config = lora_models.lora_config(expert_layout=layout, **lora)
    model = lora_models.build_model(mc)
    inject_lora([model], config)
    adapted = sum(p.numel() for p in model.parameters() if p.requires_grad)
    settings = RunSettings(lora_rank=config.rank, lora_targets=tuple(config.targets),
                           expert_lora_rank=config.expert_rank,
                           moe_rank_scaling=config.moe_rank_scaling, expert_lora_layout=layout,
                           **TINY_FP32)
    cpu = DeviceSpec("cpu", memory_bytes=2**40, bf16_tflops=1.0, intra_node_gbps=1.0,
                     inter_node_gbps=1.0)
    stage = estimate_memory(ModelShape.from_config(mc), settings, cpu).stages[0]
    assert stage.trainable_params == adapted
    assert stage.lora_params + stage.grad_buffers + stage.optimizer == 16 * adapted  # fp32


def test_kimi_k3_oom_report_names_the_expert_rank_and_layout_levers():
    from megatron_slmoe.plan import RunSettings
    from megatron_slmoe.plan.check import LayoutCheck, format_oom_report
    from megatron_slmoe.plan.devices import DEVICES, GiB
    from megatron_slmoe.plan.model_shape import load_shape
    from megatron_slmoe.plan.planner import evaluate

    shape = load_shape("kimi-k3")
    settings = RunSettings(tp=8, ep=64, dp=64, lora_rank=32, recompute="full",
                           global_batch_size=512)
    assert settings.layout_error(shape) is None and settings.expert_rank(shape) == 32
    scaled = settings.replace(moe_rank_scaling=True)
    assert scaled.expert_rank(shape) == 2  # 32 // top-16

    # The experts' adapter state on a rank: rank 32 -> 2, per expert r (l + 2f) + r (f + l).
    l, f = shape.expert_width, shape.expert_ffn
    assert shape.num_moe_layers * shape.experts == 82_432
    saved = ((32 - 2) * (l + 2 * f + f + l) * shape.experts // settings.ep
             * shape.num_moe_layers * 18 / GiB)
    device = DEVICES["h200"]

    check = LayoutCheck(evaluate(shape, settings, device), None, device, shape)
    report = format_oom_report(check, RuntimeError("CUDA out of memory"))
    (levers,) = [line for line in report.splitlines() if line.startswith("expert adapter levers")]
    assert f"--moe-rank-scaling (experts at rank 2) saves {saved:.3g} GiB/rank" in levers, levers
    assert "--expert-lora-layout shared-outer" in levers
    # Already scaled and shared-outer: no expert lever is left to name.
    done = settings.replace(moe_rank_scaling=True, expert_lora_layout="shared-outer")
    report = format_oom_report(LayoutCheck(evaluate(shape, done, device), None, device, shape))
    assert "expert adapter levers" not in report


def test_a_run_states_its_experts_rank_and_layout_to_the_planner():
    from megatron_slmoe.training.cli import parse_command_line
    from megatron_slmoe.training.inputs import run_settings

    run = parse_command_line(["--lora-rank", "8", "--moe-rank-scaling",
                              "--expert-lora-layout", "shared-outer"], prog="t", description="",
                             world_size=1).run
    settings = run_settings(run, 1, "bf16")
    assert (settings.lora_rank, settings.moe_rank_scaling, settings.expert_lora_rank,
            settings.expert_lora_layout) == (8, True, 0, "shared-outer")


def test_a_rank_scaling_that_gives_no_whole_rank_is_one_line():
    from megatron_slmoe.plan import RunSettings
    from megatron_slmoe.plan.model_shape import load_shape

    error = RunSettings(lora_rank=8, moe_rank_scaling=True, ep=8, dp=8).layout_error(
        load_shape("kimi-k3"))
    assert error.startswith("--moe-rank-scaling: --lora-rank 8 // top-k 16 is below 1"), error
    with pytest.raises(ValueError, match="--expert-lora-layout must be one of"):
        RunSettings(expert_lora_layout="fused").validate()


def test_the_nearest_layout_that_fits_keeps_the_experts_rank_and_layout():
    from megatron_slmoe.plan import RunSettings
    from megatron_slmoe.plan.check import check_layout
    from megatron_slmoe.plan.devices import DEVICES
    from megatron_slmoe.plan.model_shape import load_shape

    shape = load_shape("kimi-k3")
    settings = RunSettings(tp=8, ep=64, dp=64, lora_rank=32, moe_rank_scaling=True,
                           expert_lora_layout="shared-outer", global_batch_size=512)
    check = check_layout(shape, settings, device=DEVICES["h100"])
    assert not check.fits and check.nearest is not None
    nearest = check.nearest.settings
    assert (nearest.moe_rank_scaling, nearest.expert_lora_layout) == (True, "shared-outer")


def test_the_planner_command_takes_the_experts_rank_and_layout(tmp_path, capsys):
    import json

    from megatron_slmoe.commands.plan import main

    common = ["--model-config", "tiny", "--num-devices", "2", "--device-memory-gb", "1",
              "--devices-per-node", "2", "--seq-length", "128", "--global-batch-size", "16",
              "--framework-overhead-gb", "0", "--fragmentation", "0", "--micro-batch-sizes", "1",
              "--lora-rank", "8"]
    adapters = {}
    for name, extra in (("plain", []), ("scaled", ["--moe-rank-scaling"]),
                        ("shared", ["--expert-lora-layout", "shared-outer"])):
        path = tmp_path / f"{name}.json"
        assert main([*common, *extra, "--json", str(path)]) == 0
        adapters[name] = {(v["tp"], v["pp"], v["ep"], v["distributed_optimizer"],
                           v["recompute"], tuple(v["recompute_modules"])):
                          v["breakdown"]["lora_params"]
                          for v in json.loads(path.read_text())["layouts"]}
    assert adapters["plain"].keys() == adapters["scaled"].keys() == adapters["shared"].keys()
    for layout, plain in adapters["plain"].items():
        assert adapters["scaled"][layout] < plain and adapters["shared"][layout] < plain, layout
    capsys.readouterr()
    assert main([*common[:-1], "3", "--moe-rank-scaling"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: --moe-rank-scaling: --lora-rank 3 does not divide by the top-k 2; "
                   "take a multiple of 2 or give --expert-lora-rank"), err
