"""Layout planner: the pure-config census against the meta census, the memory model's parts against
hand counts and against the tensors autograd really saves, all-to-all bytes by the dispatcher's
rules, the flagship on three clusters, an infeasible cluster with the smallest that fits, the
start-up check, and one-line bad input."""

import json
import math
from pathlib import Path

import pytest
import torch

from megatron_slmoe.plan import (
    DEVICES,
    RunSettings,
    census,
    check_layout,
    estimate_memory,
    format_oom_report,
    generic_device,
    load_shape,
    plan,
)
from megatron_slmoe.plan.__main__ import main as plan_main
from megatron_slmoe.plan.devices import DeviceSpec, GiB
from megatron_slmoe.plan.traffic import alltoall_bytes_per_layer
from tests.helpers.autograd import saved_activation_bytes

CPU = DeviceSpec("cpu", memory_bytes=2**40, bf16_tflops=1.0, intra_node_gbps=1.0,
                 inter_node_gbps=1.0)
TINY_FP32 = dict(dtype="fp32", seq_length=128, global_batch_size=16, moe_imbalance=1.0)


@pytest.mark.parametrize("name", ["tiny", "small", "flagship_2p8t"])
def test_census_from_config_equals_meta_census(megatron_single_rank, name):
    from megatron_slmoe.model.census import count_parameters
    from megatron_slmoe.model.model_file import load_model_config

    assert census(load_shape(name)) == count_parameters(load_model_config(name))


# Imported Hugging Face families bring multi-latent attention (with and without the q compression)
# and non-gated squared-ReLU experts; shapes as DeepSeek-V3 / NemotronH give them.
_HF_SHAPED = """\
model:
  num_layers: 3
  moe_layer_freq: [0, 1, 1]
  hidden_size: 32
  ffn_hidden_size: 48
  num_attention_heads: 4
  normalization: RMSNorm
  gated_linear_unit: {gated}
  activation_func: {activation}
  num_moe_experts: 4
  moe_router_topk: 2
  moe_ffn_hidden_size: 16
  moe_shared_expert_intermediate_size: 24
  vocab_size: 64
  max_sequence_length: 64
{attention}"""
_MLA = """\
  multi_latent_attention: true
  q_lora_rank: {q_lora_rank}
  kv_lora_rank: 8
  qk_head_dim: 8
  qk_pos_emb_head_dim: 4
  v_head_dim: 6
  qk_layernorm: true
  rope_type: rope
"""


@pytest.mark.parametrize("case", ["mla-q-lora", "mla-no-q-lora", "squared-relu-experts"])
def test_census_of_hf_shaped_configs_equals_meta_census(megatron_single_rank, tmp_path, case):
    from megatron_slmoe.model.census import count_parameters
    from megatron_slmoe.model.model_file import load_model_config

    if case == "squared-relu-experts":
        fields = dict(gated="false", activation="squared_relu",
                      attention="  num_query_groups: 2\n  kv_channels: 8\n  qk_layernorm: true\n"
                                "  moe_latent_size: 16\n")
    else:
        q_lora_rank = 16 if case == "mla-q-lora" else "null"
        fields = dict(gated="true", activation="silu",
                      attention=_MLA.format(q_lora_rank=q_lora_rank))
    path = tmp_path / f"{case}.yaml"
    path.write_text(_HF_SHAPED.format(**fields))
    assert census(load_shape(path)) == count_parameters(load_model_config(path))
    # The planner's LoRA parameters (every target the model has) equal the adapted model's.
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.inject import inject_lora
    from megatron_slmoe.model.build import build_gpt_model

    targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "shared_experts",
               "router"] + (["latent"] if case == "squared-relu-experts" else [])
    mc = load_model_config(path)
    model = build_gpt_model(mc, mc.transformer_config(use_cpu_initialization=True))
    inject_lora([model], LoRAConfig(rank=4, targets=targets))
    adapted = sum(p.numel() for p in model.parameters() if p.requires_grad)
    settings = RunSettings(lora_rank=4, lora_targets=tuple(targets), **TINY_FP32)
    assert estimate_memory(load_shape(path), settings, CPU).stages[0].trainable_params == adapted


def test_flagship_weights_are_5p6_tb_in_bf16():
    total = census(load_shape("flagship_2p8t"))["total_params"]
    assert total == 2_802_090_168_320 + 55 * 896  # the routers' correction biases counted
    result = plan(load_shape("flagship_2p8t"), DEVICES["h200"], 256)
    norms = census(load_shape("flagship_2p8t"))["breakdown"]["norms"]
    fp32 = norms + 55 * 896
    assert result.weights_bytes_total == 2 * (total - fp32) + 4 * fp32
    assert 5.55e12 < result.weights_bytes_total < 5.65e12


def test_static_parts_by_hand_tiny_ep2():
    shape = load_shape("tiny")
    # LoRA r=8 on qkv/proj/fc1/fc2 (hand count): attention 4 x (8*64 + 128*8 + 8*64 + 64*8),
    # dense MLP 8*64 + 256*8 + 8*128 + 64*8, 3 MoE layers x 4 local experts x
    # (8*32 + 64*8 + 8*32 + 32*8).
    dense = 4 * 2560 + 4096
    expert = 3 * 4 * 1280
    s = RunSettings(ep=2, dp=2, micro_batch_size=4, **TINY_FP32)
    stage = estimate_memory(shape, s, CPU).stages[0]
    assert stage.trainable_params == dense + expert
    assert stage.lora_params == 4 * (dense + expert)
    assert stage.grad_buffers == 4 * (dense + expert)
    assert stage.optimizer == 8 * (dense + expert)  # fp32: Adam's two moments
    # Base weights: everything but half the routed experts; 2 x 8 fp32 router buffers per layer.
    total = census(shape)["total_params"]
    # (The census's router biases are those buffers.)
    assert stage.weights == 4 * (total - 73728 // 2 - 3 * 8) + 3 * 2 * 8 * 4
    distopt = estimate_memory(shape, s.replace(distributed_optimizer=True), CPU).stages[0]
    assert distopt.optimizer == 8 * dense // 2 + 8 * expert // 1  # dp 2; expert dp 2*1/2 = 1
    bf16 = estimate_memory(shape, s.replace(dtype="bf16"), CPU).stages[0]
    assert bf16.optimizer == 12 * (dense + expert)  # fp32 main copy + Adam
    assert bf16.weights_by_dtype == {"bf16": 2 * (total - 73728 // 2 - 576 - 3 * 8),
                                     "fp32": 4 * 576 + 3 * 2 * 8 * 4}


def test_pipeline_stages_split_layers_and_hold_in_flight_microbatches():
    shape = load_shape("tiny")
    s = RunSettings(pp=2, micro_batch_size=2, **TINY_FP32)  # 8 micro-batches
    first, last = estimate_memory(shape, s, CPU).stages
    assert (first.in_flight, last.in_flight) == (2, 1)  # 1F1B: pp - stage
    assert first.layers == (0, 2) and last.layers == (2, 4)
    one = estimate_memory(shape, s.replace(pp=1), CPU).stages[0]
    assert first.weights + last.weights == one.weights


@pytest.mark.parametrize("recompute", [None, "full"])
def test_activations_equal_what_autograd_saves(megatron_single_rank, recompute):
    """One rank, top-k routing fills k rows per token exactly (no imbalance without EP)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.inject import inject_lora
    from megatron_slmoe.model.build import build_gpt_model
    from megatron_slmoe.model.model_file import load_model_config

    model_parallel_cuda_manual_seed(7)
    mc = load_model_config("tiny")
    overrides = {"recompute_granularity": "full", "recompute_method": "uniform",
                 "recompute_num_layers": 1} if recompute else {}
    model = build_gpt_model(mc, mc.transformer_config(use_cpu_initialization=True, **overrides))
    inject_lora([model], LoRAConfig(rank=8))
    batch, seq = 2, 128
    tokens = torch.randint(0, mc.vocab_size, (batch, seq))
    positions = torch.arange(seq).expand(batch, seq)
    measured = saved_activation_bytes(
        model, lambda: model(tokens, positions, None, labels=tokens))
    s = RunSettings(micro_batch_size=batch, recompute=recompute or "none", **TINY_FP32)
    stage = estimate_memory(load_shape("tiny"), s, CPU).stages[0]
    predicted = (stage.activations + stage.moe_rows) / stage.in_flight
    assert abs(predicted - measured) / measured < 0.01, (predicted, measured)


def test_recomputation_and_distributed_optimizer_lower_the_flagship_peak():
    shape = load_shape("flagship_2p8t")
    base = RunSettings(tp=8, pp=8, ep=64, dp=8, global_batch_size=512)
    peaks = [estimate_memory(shape, base.replace(**c), DEVICES["h100"]).peak_bytes for c in (
        {}, {"recompute": "selective", "recompute_modules": ("core_attn", "moe")},
        {"recompute": "full"})]
    assert peaks[0] > peaks[1] > peaks[2]
    opt = estimate_memory(shape, base, DEVICES["h100"]).peak_stage.optimizer
    sharded = estimate_memory(shape, base.replace(distributed_optimizer=True),
                              DEVICES["h100"]).peak_stage.optimizer
    assert sharded < opt


def test_alltoall_bytes_follow_the_dispatcher_rules():
    shape = load_shape("flagship_2p8t")
    tokens = 512
    s = RunSettings(tp=8, pp=8, ep=16, dp=8, devices_per_node=8)
    intra, inter = alltoall_bytes_per_layer(shape, s, tokens)
    # A token goes once to each rank holding one of its 16 experts. A rank holds half of one of
    # the 8 groups; the token picks 4 groups, then its experts among their 448.
    p_rank = 4 / 8 * (1 - math.comb(448 - 56, 16) / math.comb(448, 16))
    rows_per_rank = tokens * p_rank
    row = 3072 * 2  # latent width, bf16
    # 7 other ranks on this node, 8 on the other node; dispatch and combine.
    assert intra == pytest.approx(2 * 7 * rows_per_rank * row)
    assert inter == pytest.approx(2 * 8 * rows_per_rank * row)
    hier = alltoall_bytes_per_layer(shape, s.replace(hierarchical_alltoall=True), tokens)
    assert hier[1] < inter  # each token crosses once per destination node


@pytest.mark.parametrize("devices,device", [
    (512, generic_device(64 * GiB)), (256, DEVICES["h200"]), (1024, DEVICES["h100"])])
def test_flagship_fits_the_three_clusters(devices, device):
    result = plan(load_shape("flagship_2p8t"), device, devices)
    best = result.best
    assert best is not None and best.fits
    peak = best.memory.peak_stage
    assert peak.peak <= device.memory_bytes
    assert sum(peak.breakdown().values()) == peak.peak
    assert peak.weights > 0 and peak.moe_rows + peak.activations > 0
    assert best.step_time_s > 0 and best.settings.world_size == devices
    assert all(v.step_time_s <= w.step_time_s for v, w in zip(result.feasible, result.feasible[1:]))


def test_small_cluster_is_refused_with_the_smallest_that_fits():
    shape = load_shape("flagship_2p8t")
    device = generic_device(64 * GiB)
    result = plan(shape, device, 64)
    assert not result.feasible
    assert result.smallest_fitting and result.smallest_fitting > 64
    assert result.smallest_layout.fits
    assert result.smallest_layout.settings.world_size == result.smallest_fitting
    fewer = plan(shape, device, result.smallest_fitting - device.devices_per_node)
    assert not fewer.feasible


def test_check_layout_refuses_with_the_nearest_fit_and_formats_the_oom_report():
    from megatron_slmoe.model.model_file import load_model_config

    settings = RunSettings(tp=8, pp=8, ep=64, dp=8, global_batch_size=512, micro_batch_size=2)
    check = check_layout(load_model_config("flagship_2p8t"), settings, device=DEVICES["910b"])
    assert not check.fits
    assert check.nearest is not None and check.nearest.fits
    assert check.nearest.settings.world_size == settings.world_size
    assert "does not fit" in check.message and "\n" not in check.message
    report = format_oom_report(check, RuntimeError("out of memory"))
    assert "next step: recompute" in report and "moe_rows" in report
    ok = check_layout(load_shape("flagship_2p8t"), check.nearest.settings,
                      device_memory_bytes=DEVICES["910b"].memory_bytes)
    assert ok.fits or ok.verdict.peak_bytes > 0  # a generic device has other overheads


def test_cli_writes_json_and_table(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert plan_main(["--model-config", "tiny", "--num-devices", "2", "--device-memory-gb", "1",
                      "--devices-per-node", "2", "--seq-length", "128",
                      "--framework-overhead-gb", "0", "--fragmentation", "0",
                      "--global-batch-size", "16", "--json", str(path)]) == 0
    document = json.loads(path.read_text())
    assert document["weights_bytes_total"] > 0 and document["layouts"]
    for layout in document["layouts"]:
        assert {"tp", "pp", "ep", "dp", "fits", "peak_bytes_per_rank", "step_time_s"} <= set(layout)
    assert "layouts fit" in capsys.readouterr().out


@pytest.mark.parametrize("argv,expected", [
    (["--model-config", "nope", "--num-devices", "8", "--device", "h100"], "no model config"),
    (["--model-config", "tiny", "--num-devices", "8"], "--device-memory-gb"),
    (["--model-config", "tiny", "--num-devices", "0", "--device", "h100"], "--num-devices"),
    (["--model-config", "tiny", "--num-devices", "8", "--device", "h100", "--lora-rank", "0"],
     "--lora-rank"),
    (["--model-config", "tiny", "--num-devices", "8", "--device", "tpu"], "--device"),
    (["--model-config", "tiny"], "--num-devices"),
    # what the model and the machine can tell (the plan went ahead: "408 of 408 fit")
    (["--model-config", "tiny", "--num-devices", "8", "--device", "h100", "--lora-target-modules",
      "linear_qkv", "vision_attention", "projector"],
     "--lora-target-modules linear_qkv vision_attention projector: 'vision_attention' matches "
     "nothing in --model-config tiny; targetable: linear_qkv, linear_proj, linear_fc1, "
     "linear_fc2, shared_experts, router, latent"),
    (["--model-config", "tiny", "--num-devices", "8", "--device", "h100", "--devices-per-node",
      "3"], "--num-devices 8 is not a whole number of nodes of 3 devices (--devices-per-node)"),
])
def test_cli_bad_input_is_one_line_exit_2(capsys, argv, expected):
    assert plan_main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and expected in err


def test_zero_stages_shard_what_they_name():
    """ZeRO-2 shards the gradient buffers, ZeRO-3 the weights (frozen base included) over data
    parallelism, at the price of one gathered layer (and the next, prefetched) in flight."""
    from megatron_slmoe.plan.devices import DEVICES
    from megatron_slmoe.plan.memory import estimate_memory, zero3_gather_bytes
    from megatron_slmoe.plan.model_shape import load_shape
    from megatron_slmoe.plan.settings import RunSettings

    shape = load_shape("tiny")
    device = DEVICES["h100"]
    base = RunSettings(ep=2, dp=4, seq_length=128, global_batch_size=16)
    stages = {name: estimate_memory(shape, base.replace(**changes), device).stages[0]
              for name, changes in (("none", {}), ("zero1", dict(distributed_optimizer=True)),
                                    ("zero2", dict(sharding="optim_grads")),
                                    ("zero3", dict(sharding="optim_grads_params")))}
    assert stages["zero1"].optimizer < stages["none"].optimizer
    assert stages["zero2"].optimizer == stages["zero1"].optimizer
    assert stages["zero2"].grad_buffers < stages["zero1"].grad_buffers
    assert stages["zero3"].weights < stages["zero2"].weights
    assert stages["zero3"].lora_params < stages["zero2"].lora_params
    gather = zero3_gather_bytes(shape, base.replace(sharding="optim_grads_params"))
    assert gather > 0 and stages["zero3"].transient >= gather


@pytest.mark.parametrize("dropped", ["", "  moe_latent_size: 32",
                                     "  moe_shared_expert_intermediate_size: 64"])
def test_the_planners_lora_targets_are_those_of_the_built_model(dropped, tmp_path,
                                                                 megatron_single_rank):
    """The targets a model config offers the planner (ModelShape.lora_targets) are those that
    match a module of the model built from it (lora.targets, on the meta device)."""
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.inject import check_targets
    from megatron_slmoe.lora.targets import TARGETS, LoRATargetError
    from megatron_slmoe.model.census import build_meta_model
    from megatron_slmoe.model.model_file import load_model_config
    from megatron_slmoe.plan.model_shape import ModelShape

    tiny = Path(__file__).resolve().parents[2] / "megatron_slmoe/model/configs/tiny.yaml"
    path = tmp_path / "model.yaml"
    path.write_text(tiny.read_text().replace(dropped, "") if dropped else tiny.read_text())
    config = load_model_config(str(path))
    model = build_meta_model(config)
    matched = []
    for target in TARGETS:
        try:
            check_targets([model], LoRAConfig(targets=[target]))
            matched.append(target)
        except LoRATargetError:
            pass
    assert ModelShape.from_config(config).lora_targets == tuple(matched)
