"""Routed experts held packed (``--expert-weights packed``): the same tiny checkpoint, Kimi K3 as
released (MXFP4 experts), Kimi-K2.5 as released (INT4 pack-quantized, made by compressed-tensors'
own compressor) and DeepSeek-V3 with block-FP8 experts, gives the same logits and LoRA gradients with its experts
held packed as dequantised, while each rank holds only the packed bytes (counted from the
buffers, against the bytes the checkpoint stores); a run's checkpoint never holds them, and the
settings that cannot keep experts packed are one line each."""

import pytest
import torch

from tests.helpers import hf_models
from tests.helpers import kimi_k3_reference as k3ref
from tests.helpers import packed_experts as pe

pytestmark = pytest.mark.usefixtures("megatron_single_rank")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: (directory, input ids)}: a 4-layer K3 release checkpoint and Kimi-K2.5 with INT4
    experts (text input: the image placeholder replaced)."""
    root = tmp_path_factory.mktemp("packed-experts")
    config = k3ref.tiny_config(num_hidden_layers=4, full_attn_layers=[2, 4], kda_layers=[1, 3])
    k3 = hf_models.save_kimi_k3(k3ref.round_experts_to_mxfp4_(k3ref.build(config)), root / "k3")
    kimi = hf_models.build_kimi(text_overrides=dict(moe_intermediate_size=32))
    hf_models.save(kimi, str(root / "k25"), layout="original")
    hf_models.pack_experts_int4(str(root / "k25"), str(root / "k25-decoded"))
    ids = hf_models.kimi_inputs()["input_ids"]
    ids = torch.where(ids == hf_models.KIMI_IMAGE_TOKEN, torch.ones_like(ids), ids)
    hf_models.save_fp8(hf_models.build("deepseek_v3"), str(root / "dsv3"), block=(16, 16))
    return {"k3-mxfp4": (str(k3), hf_models.tokens(batch=2, seq=12) % config.vocab_size),
            "k25-int4": (str(root / "k25"), ids), "k25-decoded": (str(root / "k25-decoded"), ids),
            "dsv3-fp8": (str(root / "dsv3"), hf_models.tokens())}


@pytest.fixture(scope="module")
def lora_step(checkpoints):
    """``pe.run_lora_step`` of a checkpoint and mode, run once per module."""
    done = {}

    def run(name, mode):
        if (name, mode) not in done:
            directory, ids = checkpoints[name]
            done[name, mode] = pe.run_lora_step(directory, mode, ids)
        return done[name, mode]
    return run


def stored_expert_bytes(directory: str) -> int:
    """Bytes of the packed (or FP8) routed-expert tensors and their scales in the checkpoint's
    files."""
    from megatron_slmoe.hf.checkpoint import HFCheckpoint

    tensors = HFCheckpoint.open(directory).tensors
    return sum(tensors[info.packed].nbytes + tensors[info.scale].nbytes if info.packed
               else info.nbytes + tensors[key + "_scale_inv"].nbytes
               for key, info in tensors.items()
               if ".experts." in key and (info.packed or info.is_fp8))


@pytest.mark.parametrize("name", ["k3-mxfp4", "k25-int4", "dsv3-fp8"])
def test_packed_experts_give_the_dequantized_logits_and_gradients(checkpoints, lora_step, name):
    from megatron_slmoe.training.checkpointing import trainable_sharded_state_dict

    directory, _ = checkpoints[name]
    logits, grads, model = lora_step(name, "auto")  # auto: packed
    expected_logits, expected_grads, dense = lora_step(name, "dequantize")
    torch.testing.assert_close(logits, expected_logits, rtol=1e-6, atol=1e-6)
    assert grads.keys() == expected_grads.keys() and any(".experts." in k for k in grads)
    for key, grad in expected_grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-6, atol=1e-6, msg=key)
    # Memory: the experts hold the checkpoint's packed bytes, nothing dense beside them.
    assert all(m.packed is not None for m in pe.expert_modules(model))
    assert pe.expert_weight_bytes(model) == stored_expert_bytes(directory)
    bf16 = pe.expert_weight_bytes(dense) // dense.config.params_dtype.itemsize * 2
    assert pe.expert_weight_bytes(model) <= (0.55 if name == "dsv3-fp8" else 0.30) * bf16
    assert not any(".experts.fc" in n and "lora" not in n for n, _ in model.named_parameters())
    # A run's checkpoint holds what is trained, never the packed base.
    saved = trainable_sharded_state_dict([model])
    assert saved and all("lora" in key for key in saved)
    assert not any("_packed" in key or "weight_scale" in key for key in model.state_dict())


def test_expert_weights_that_cannot_be_packed_are_one_line(checkpoints):
    from megatron_slmoe.config.errors import ConfigError
    from megatron_slmoe.model.config import ModelSection
    from megatron_slmoe.runtime.model import open_model

    decoded, _ = checkpoints["k25-decoded"]
    with pytest.raises(ConfigError, match=r"--expert-weights packed: .*its routed experts are "
                                          r"not packed; use --expert-weights dequantize$"):
        open_model(ModelSection(hf_checkpoint=decoded, expert_weights="packed"))
    model_config, _ = open_model(ModelSection(hf_checkpoint=decoded))  # auto: as stored
    assert model_config.slmoe.expert_weights is None
    packed, _ = checkpoints["k25-int4"]
    with pytest.raises(ConfigError, match=r"--expert-weights.*--finetune-mode full trains them"):
        ModelSection(hf_checkpoint=packed, expert_weights="packed", finetune_mode="full")
    model_config, _ = open_model(ModelSection(hf_checkpoint=packed, finetune_mode="full"))
    assert model_config.slmoe.expert_weights is None  # auto: full fine-tuning dequantises
    model_config, _ = open_model(ModelSection(hf_checkpoint=packed, expert_weights="dequantize"))
    assert not model_config.slmoe.expert_weights.held  # known to the planner, held dense


def test_nan_scale_in_packed_experts_is_one_line(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    from megatron_slmoe.families.errors import HFCheckpointError

    directory, ids = checkpoints["k25-int4"]
    tensors = load_file(f"{directory}/model.safetensors")
    key = next(k for k in sorted(tensors) if k.endswith("experts.1.down_proj.weight_scale"))
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(open(f"{directory}/config.json").read())
    weight = key[:-len("_scale")].replace(".", "[.]")
    with pytest.raises(HFCheckpointError, match=rf"model.safetensors: tensor {weight}: "
                                                rf"pack-quantized: scale is NaN or inf at "
                                                rf"\[0, 0\]$") as err:
        pe.run_lora_step(str(tmp_path), "packed", ids)
    assert "\n" not in str(err.value)


def test_planner_prices_the_packed_bytes_and_the_scratch_tile(checkpoints, lora_step):
    """The planner's saving from packed experts is what the built models hold: the dequantised
    experts' bytes less the packed buffers' bytes, less one expert's largest projection decoded
    and one decode step (the scratch of an NPU run's pure-torch twin, which decodes expert by
    expert into one tile, in fp32 the binding's too); the OOM report of a dequantised run names
    the lever."""
    import dataclasses

    from megatron_slmoe.ops.quantized_weights import decode_chunk_bytes
    from megatron_slmoe.plan import ModelShape, RunSettings
    from megatron_slmoe.plan.check import check_layout, format_oom_report
    from megatron_slmoe.plan.devices import DEVICES, GiB
    from megatron_slmoe.plan.memory import stage_weight_bytes
    from megatron_slmoe.model.config import ModelSection
    from megatron_slmoe.runtime.model import open_model

    directory, _ = checkpoints["k3-mxfp4"]
    _, _, packed = lora_step("k3-mxfp4", "auto")
    _, _, dense = lora_step("k3-mxfp4", "dequantize")
    experts = pe.expert_modules(dense)
    tile = max(max(m.fc1_weight[0].numel(), m.fc2_weight[0].numel()) for m in experts) * 4
    step = max(decode_chunk_bytes(*w[0].shape) for m in experts
               for w in (m.fc1_weight, m.fc2_weight))
    held_saving = pe.expert_weight_bytes(dense) - pe.expert_weight_bytes(packed) - tile - step

    model_config, _ = open_model(ModelSection(hf_checkpoint=directory))
    shape = ModelShape.from_config(model_config)
    assert shape.experts_packed and shape.packed_expert_bytes == 0.5 + 1 / 32
    settings = RunSettings(dtype="fp32", seq_length=12, global_batch_size=2)
    npu = DEVICES["910b"]
    assert stage_weight_bytes(shape, settings.replace(expert_weights="dequantize"), npu) \
        - stage_weight_bytes(shape, settings, npu) == held_saving

    # A dequantised flagship that packed experts would fit: the report names the lever.
    from megatron_slmoe.model.model_file import load_model_config

    flagship = dataclasses.replace(ModelShape.from_config(load_model_config("flagship_2p8t")),
                                   packed_expert_bytes=0.5 + 1 / 32)
    settings = RunSettings(tp=8, pp=8, ep=64, dp=8, global_batch_size=512, micro_batch_size=1,
                           recompute="full", expert_weights="dequantize")
    gpu = DEVICES["h100"]  # check_layout's device of a memory size: H100-class, CUDA kernels
    saving = (stage_weight_bytes(flagship, settings, gpu)
              - stage_weight_bytes(flagship, settings.replace(expert_weights="packed"), gpu)) / GiB
    check = check_layout(flagship, settings, device_memory_bytes=int(
        check_layout(flagship, settings, device_memory_bytes=10**15).verdict.peak_bytes
        - saving * GiB / 2))
    assert not check.fits
    report = format_oom_report(check)
    assert f"next step: hold the experts packed: --expert-weights packed saves {saving:.3g} " \
           f"GiB/rank -> predicted" in report and "(fits)" in report


def test_generation_runs_on_the_packed_experts(lora_step):
    """The generator (KDA state and MLA cache) answers on the packed K3 model, LoRA on, as on
    the dequantised one, greedy token for token."""
    from megatron_slmoe.inference import TextGenerator

    _, _, packed = lora_step("k3-mxfp4", "auto")
    _, _, dense = lora_step("k3-mxfp4", "dequantize")
    assert all(m.packed is not None for m in pe.expert_modules(packed))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 127, (n,), generator=gen).tolist() for n in (5, 8)]
    answers = TextGenerator(packed, 127, 128).generate(prompts, 6)
    assert answers == TextGenerator(dense, 127, 128).generate(prompts, 6)
    assert all(answers) and answers[0] != answers[1]


def test_an_expert_stored_dense_among_packed_ones_is_one_line(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    from megatron_slmoe.families.errors import HFCheckpointError

    directory, ids = checkpoints["k25-int4"]
    tensors = load_file(f"{directory}/model.safetensors")
    stem = next(k for k in sorted(tensors) if k.endswith("experts.2.up_proj.weight_packed"))[
        :-len("_packed")]
    decoded = load_file(f"{checkpoints['k25-decoded'][0]}/model.safetensors")[stem]
    for suffix in ("_packed", "_scale", "_shape"):
        del tensors[stem + suffix]
    tensors[stem] = decoded
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(open(f"{directory}/config.json").read())
    with pytest.raises(HFCheckpointError, match=rf"tensor {stem.replace('.', '[.]')} is \w+ "
                                                r"\[\d+, \d+\]; the experts are held packed as "
                                                r"pack-quantized .* in groups of 32 "
                                                r"\(--expert-weights dequantize reads it as any "
                                                r"weight\)$") as err:
        pe.run_lora_step(str(tmp_path), "packed", ids)
    assert "\n" not in str(err.value)


def test_merged_export_rewrites_int4_experts_and_reports_their_error(checkpoints, lora_step,
                                                                     tmp_path):
    # The adapter of the packed Kimi-K2.5 run merged into its INT4 checkpoint (each adapted expert
    # re-encoded as pack-quantized) and into the checkpoint of compressed-tensors' decompression
    # of the same bytes (the BF16 merge, through the unpacked path): the report's error of every
    # expert is that of compressed-tensors' own decompression of what was written.
    import json

    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file

    from megatron_slmoe.hf.merged_export import REQUANTIZATION_REPORT, export_merged
    from megatron_slmoe.lora.adapter import save_adapter
    from megatron_slmoe.lora.config import LoRAConfig

    _, _, model = lora_step("k25-int4", "auto")
    save_adapter([model], str(tmp_path / "adapter"),
                 LoRAConfig(rank=4, alpha=8.0, targets=["linear_fc1", "linear_fc2"]))
    packed_dir = export_merged(str(tmp_path / "adapter"), checkpoints["k25-int4"][0],
                               str(tmp_path / "packed"))
    bf16_dir = export_merged(str(tmp_path / "adapter"), checkpoints["k25-decoded"][0],
                             str(tmp_path / "bf16"))
    written, merged = load_file(f"{packed_dir}/model.safetensors"), load_file(f"{bf16_dir}/model.safetensors")
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
    errors = []
    for stem in sorted(k[:-len("weight_packed")] for k in written if k.endswith(".weight_packed")):
        decoded = PackedQuantizationCompressor.decompress(
            {name: written[stem + name] for name in ("weight_packed", "weight_scale", "weight_shape")},
            scheme)["weight"]
        want = merged[stem + "weight"].to(torch.bfloat16).double()
        errors.append(float((decoded.double() - want).norm() / want.norm()))
    report = json.loads(open(f"{packed_dir}/{REQUANTIZATION_REPORT}").read())
    stats = report["formats"]["pack-quantized"]
    assert list(report["formats"]) == ["pack-quantized"] and stats["weights"] == len(errors) > 0
    assert stats["max_rel"] == pytest.approx(max(errors), rel=1e-9)
    assert stats["mean_rel"] == pytest.approx(sum(errors) / len(errors), rel=1e-9)
    assert 0 < stats["max_rel"] < 0.2
    # The checkpoint keeps its quantisation settings; the unpacked base writes no report.
    assert json.loads(open(f"{packed_dir}/config.json").read()) == json.loads(
        open(f"{checkpoints['k25-int4'][0]}/config.json").read())
    assert not (tmp_path / "bf16" / REQUANTIZATION_REPORT).exists()


def test_merged_export_writes_block_fp8_weights_back_in_their_blocks(checkpoints, lora_step,
                                                                     tmp_path):
    # DeepSeek-V3's block-FP8 checkpoint with the adapter of a LoRA run on its MLPs merged: every
    # adapted FP8 weight is re-encoded in the checkpoint's 16x16 blocks (decoded here by hand, it
    # is within FP8's rounding of the merge into the dequantised copy of the same checkpoint, and
    # the report holds exactly those errors), every other FP8 weight is its stored bytes, and the
    # config keeps its FP8 settings (transformers expects every quantised weight in FP8).
    import json

    from safetensors.torch import load_file

    from megatron_slmoe.hf.merged_export import REQUANTIZATION_REPORT, export_merged
    from megatron_slmoe.lora.adapter import save_adapter
    from megatron_slmoe.lora.config import LoRAConfig

    base_dir = checkpoints["dsv3-fp8"][0]
    _, _, model = lora_step("dsv3-fp8", "auto")
    save_adapter([model], str(tmp_path / "adapter"),
                 LoRAConfig(rank=4, alpha=8.0, targets=["linear_fc1", "linear_fc2"]))
    fp8_dir = export_merged(str(tmp_path / "adapter"), base_dir, str(tmp_path / "fp8"))
    bf16_dir = export_merged(str(tmp_path / "adapter"), base_dir + "-dequantized",
                             str(tmp_path / "bf16"))
    written, merged = load_file(f"{fp8_dir}/model.safetensors"), load_file(f"{bf16_dir}/model.safetensors")
    base = load_file(f"{base_dir}/model.safetensors")
    fp8_keys = sorted(k for k, t in base.items() if t.dtype == torch.float8_e4m3fn)
    assert sorted(k for k, t in written.items() if t.dtype == torch.float8_e4m3fn) == fp8_keys
    reference = load_file(f"{base_dir}-dequantized/model.safetensors")
    errors, kept = [], []
    for key in fp8_keys:
        values, scales = written[key], written[key + "_scale_inv"]
        assert scales.shape == base[key + "_scale_inv"].shape
        if torch.equal(merged[key], reference[key]):  # no LoRA there: the stored bytes
            assert torch.equal(values.view(torch.uint8), base[key].view(torch.uint8)), key
            assert torch.equal(scales, base[key + "_scale_inv"]), key
            kept.append(key)
            continue
        blocks = scales.repeat_interleave(16, 0).repeat_interleave(16, 1)
        decoded = values.double() * blocks[:values.shape[0], :values.shape[1]].double()
        want = merged[key].to(torch.bfloat16).double()
        errors.append(float((decoded - want).norm() / want.norm()))
    assert all(".mlp." in key for key in set(fp8_keys) - set(kept))
    report = json.loads(open(f"{fp8_dir}/{REQUANTIZATION_REPORT}").read())
    stats = report["formats"]["block-fp8"]
    assert list(report["formats"]) == ["block-fp8"] and stats["weights"] == len(errors) > 0
    # (the export decodes in fp32, this test in fp64)
    assert kept and stats["max_rel"] == pytest.approx(max(errors), rel=1e-6)
    assert stats["mean_rel"] == pytest.approx(sum(errors) / len(errors), rel=1e-6)
    assert 0 < stats["max_rel"] < 0.05  # e4m3 keeps 3 mantissa bits
    assert json.loads(open(f"{fp8_dir}/config.json").read()) == json.loads(
        open(f"{base_dir}/config.json").read())
