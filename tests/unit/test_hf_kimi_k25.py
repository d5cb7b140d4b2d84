"""Kimi-K2.5 import on one rank: a tiny random Kimi_K25ForConditionalGeneration (MoonViT tower,
projector, DeepSeek-V3 language model) saved by transformers, imported into our model (the tower
and projector transformers' own modules, the language model Megatron-Core's with our MoE layers):
its logits on image+text batches (two images of different patch grids) equal transformers'
(fp32, 1e-5), in both checkpoint layouts of the language model; without images the model is the
text model; a batch whose image tokens do not match its images is refused in one line. Out: LoRA
on the language model's attention, experts, shared experts and router, and on the tower's
attention and the projector (transformers' modules), exported by
``slmoe-convert-hf export`` as a PEFT adapter that ``PeftModel.from_pretrained`` loads on
``Kimi_K25ForConditionalGeneration`` with our image+text logits, and merged into a full
checkpoint that ``Kimi_K25ForConditionalGeneration.from_pretrained`` loads with them."""

import json

import pytest
import torch

from tests.helpers import hf_models

pytestmark = pytest.mark.usefixtures("megatron_single_rank")


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kimi")
    model = hf_models.build_kimi()
    hf_models.save(model, str(directory / "fused"), layout="fused")
    return model, directory


def test_image_text_logits_match_transformers(kimi):
    model, directory = kimi
    inputs = hf_models.kimi_inputs()
    assert inputs["image_grid_thw"].shape[0] == 2 and inputs["pixel_values"].shape[0] > 24
    logits, report = hf_models.kimi_import_and_run(str(directory / "fused"), inputs)
    torch.testing.assert_close(logits, hf_models.kimi_hf_logits(model, inputs),
                               rtol=1e-5, atol=1e-5)
    # The images matter: the same tokens with other pixels give other logits.
    other = dict(inputs, pixel_values=inputs["pixel_values"].flip(0))
    assert not torch.allclose(hf_models.kimi_hf_logits(model, other), logits, atol=1e-3)
    vision = [n for n, _ in model.model.vision_tower.named_parameters()]
    assert report.tensors > len(vision)


def test_hub_layout_of_the_language_model(kimi, tmp_path):
    """The published layout holds the language model as ``language_model.model.*`` and
    ``language_model.lm_head``; the tower in transformers 5's names."""
    from safetensors.torch import load_file, save_file

    model, directory = kimi
    tensors = load_file(str(directory / "fused" / "model.safetensors"))
    renamed = {}
    for key, tensor in tensors.items():
        if key.startswith("model.language_model."):
            key = "language_model.model." + key[len("model.language_model."):]
        elif key.startswith("lm_head."):
            key = "language_model." + key
        renamed[key] = tensor
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((directory / "fused" / "config.json").read_text())
    inputs = hf_models.kimi_inputs()
    logits, _ = hf_models.kimi_import_and_run(str(tmp_path), inputs)
    torch.testing.assert_close(logits, hf_models.kimi_hf_logits(model, inputs),
                               rtol=1e-5, atol=1e-5)


def test_original_format_as_transformers_writes_it(kimi, tmp_path):
    """``save_pretrained``'s default: MoonViT's original names (``vision_tower.encoder.blocks.N``
    with q/k/v fused as ``wqkv``, rotary rows interleaved per head; ``mm_projector.proj.0``),
    written by transformers' own inverse of its loading conversion."""
    from safetensors import safe_open

    model, _ = kimi
    hf_models.save(model, str(tmp_path), layout="original")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in keys
    assert "mm_projector.proj.0.weight" in keys
    inputs = hf_models.kimi_inputs()
    logits, _ = hf_models.kimi_import_and_run(str(tmp_path), inputs)
    torch.testing.assert_close(logits, hf_models.kimi_hf_logits(model, inputs),
                               rtol=1e-5, atol=1e-5)
    # Written back (the base alone) in the names transformers 5 holds: it loads with the logits.
    from transformers import Kimi_K25ForConditionalGeneration

    from megatron_slmoe.commands.convert_hf import main as convert_hf

    assert convert_hf(["export", "--hf-checkpoint", str(tmp_path), "--output",
                       str(tmp_path / "written"), "--merged"]) == 0
    written = Kimi_K25ForConditionalGeneration.from_pretrained(
        str(tmp_path / "written"), dtype=torch.float32, attn_implementation="eager").eval()
    torch.testing.assert_close(hf_models.kimi_hf_logits(written, inputs), logits,
                               rtol=1e-5, atol=1e-5)


def test_missing_or_misshapen_vision_tensor_is_one_line_before_start(kimi, tmp_path):
    from safetensors.torch import load_file, save_file

    from megatron_slmoe.hf import HFCheckpointError
    from megatron_slmoe.hf.loader import open_hf_checkpoint

    _, directory = kimi
    tensors = load_file(str(directory / "fused" / "model.safetensors"))
    (tmp_path / "config.json").write_text((directory / "fused" / "config.json").read_text())
    key = "model.vision_tower.layers.1.attn.k_proj.weight"
    for broken, message in ((lambda t: t.pop(key), f"tensor {key} .vision. is in no shard"),
                            (lambda t: t.__setitem__(key, t[key][:-2]), "has shape")):
        copy = dict(tensors)
        broken(copy)
        save_file(copy, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(HFCheckpointError, match=message):
            open_hf_checkpoint(str(tmp_path))


def test_text_only_batch_is_the_language_model(kimi):
    model, directory = kimi
    input_ids = hf_models.tokens()
    inputs = dict(input_ids=input_ids, pixel_values=None, image_grid_thw=None)
    logits, _ = hf_models.kimi_import_and_run(str(directory / "fused"), inputs)
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits.float()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_image_tokens_without_matching_images_are_one_line(kimi):
    from megatron_slmoe.model.tower_language import ImageTokenMismatch

    _, directory = kimi
    inputs = hf_models.kimi_inputs()
    inputs["input_ids"][0, 0] = hf_models.KIMI_IMAGE_TOKEN  # one token too many
    with pytest.raises(ImageTokenMismatch, match=r"^the batch has \d+ image tokens, its images "
                                                 r"\d+ embeddings$"):
        hf_models.kimi_import_and_run(str(directory / "fused"), inputs)
    # Text carrying the placeholder with no images (a text task's data): one line that says so.
    text_only = {"input_ids": inputs["input_ids"], "pixel_values": None, "image_grid_thw": None}
    with pytest.raises(ImageTokenMismatch, match=r"^the batch has \d+ image tokens \(id \d+\) "
                                                 r"and no images: text data must not contain"):
        hf_models.kimi_import_and_run(str(directory / "fused"), text_only)


def test_config_without_text_config_is_one_line(kimi, tmp_path):
    from megatron_slmoe.hf import HFCheckpointError
    from megatron_slmoe.hf.loader import open_hf_checkpoint

    _, directory = kimi
    config = json.loads((directory / "fused" / "config.json").read_text())
    del config["text_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(directory / "fused" / "model.safetensors")
    with pytest.raises(HFCheckpointError, match="text_config is missing"):
        open_hf_checkpoint(str(tmp_path))


def test_peft_adapter_on_kimi_gives_our_image_text_logits(kimi, tmp_path):

    from peft import PeftModel
    from safetensors import safe_open
    from transformers import Kimi_K25ForConditionalGeneration

    from megatron_slmoe.commands.convert_hf import main as convert_hf
    from megatron_slmoe.hf.convert import build_model_in_layout
    from megatron_slmoe.hf.loader import load_hf_weights, open_hf_checkpoint
    from megatron_slmoe.hf.tower_model import hf_model_builder
    from megatron_slmoe.lora.adapter import save_adapter
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.inject import inject_lora

    base, directory = kimi
    hf_dir = str(directory / "fused")
    hf = open_hf_checkpoint(hf_dir)
    model, _ = build_model_in_layout(hf.model_config, build=hf_model_builder(hf))
    load_hf_weights([model], hf_dir, hf)
    lora_config = LoRAConfig(rank=4, alpha=8.0, targets=[
        "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "shared_experts", "router",
        "vision_attention", "projector"])
    inject_lora([model], lora_config)
    hf_models.randomise_lora(model)  # every factor random, as after training
    inputs = hf_models.kimi_inputs()
    ours = hf_models.megatron_logits(model, inputs["input_ids"],
                                     pixel_values=inputs["pixel_values"],
                                     image_grid_thw=inputs["image_grid_thw"])
    save_adapter([model], str(tmp_path / "adapter"), lora_config)
    assert convert_hf(["export", "--adapter", str(tmp_path / "adapter"), "--hf-checkpoint",
                       hf_dir, "--output", str(tmp_path / "peft"),
                       "--expert-layout", "fused"]) == 0
    with safe_open(str(tmp_path / "peft" / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    prefixes = ("base_model.model.model.language_model.layers.",
                "base_model.model.model.vision_tower.layers.", "base_model.model.model.mm_projector.")
    assert all(k.startswith(prefixes) for k in keys)
    assert any(".mlp.experts.lora_A.weight" in k for k in keys)
    for module in ("vision_tower.layers.1.attn.q_proj", "vision_tower.layers.0.attn.proj",
                   "mm_projector.out_proj"):
        assert f"base_model.model.model.{module}.lora_B.weight" in keys, module
    assert not any(".mlp.fc1." in k for k in keys)  # the tower's MLP is not a target
    assert convert_hf(["export", "--adapter", str(tmp_path / "adapter"), "--hf-checkpoint",
                       hf_dir, "--output", str(tmp_path / "merged"), "--merged"]) == 0
    merged = Kimi_K25ForConditionalGeneration.from_pretrained(
        str(tmp_path / "merged"), dtype=torch.float32, attn_implementation="eager").eval()
    # W + s B A rounded once per weight, against the branch computed apart: with factors this
    # large (0.3 N(0, 1)) a logit or two in a thousand differs by up to ~3e-5.
    torch.testing.assert_close(hf_models.kimi_hf_logits(merged, inputs), ours,
                               rtol=1e-5, atol=1e-4)
    peft_model = PeftModel.from_pretrained(hf_models.build_kimi(), str(tmp_path / "peft")).eval()
    theirs = hf_models.kimi_hf_logits(peft_model, inputs)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=2e-5)
    assert (theirs - hf_models.kimi_hf_logits(base, inputs)).abs().max() > 0.1
