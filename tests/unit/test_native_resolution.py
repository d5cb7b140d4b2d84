"""Images at their own resolution as a NaViT tower's patches (``data/native_resolution.py``), held
to transformers' Kimi-K2.5 image processor:

- the patches and grids of seven images (RGB noise and gradients, one over the patch budget, one
  over the per-side limit, grayscale, palette, images smaller than a patch) equal, bit for bit,
  what ``Kimi_K25ImageProcessor`` made of them under two settings. That processor is torchvision's
  and torchvision does not load with the CPU torch build here, so its output was recorded where
  it runs (``tools/kimi_processor_reference.py``, the versions in the file's metadata);
- decoding composites transparency onto white exactly as the installed transformers'
  ``convert_to_rgb`` does (the recorded processor, transformers 5.17, still dropped the alpha
  channel, so the RGBA image's patches are compared after that version's conversion);
- the settings are read from ``preprocessor_config.json``; a bad value is one line naming the
  file and the field;
- the image input of a dataset repeats each placeholder to one token per merged patch, and an
  image count that does not match is refused.
"""

import io
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from megatron_slmoe.data.errors import DataError
from megatron_slmoe.data.image import decode_image
from megatron_slmoe.data.image_inputs import ImageCountMismatch, NativeResolutionImages
from megatron_slmoe.data.native_resolution import NativeResolutionConfig, image_patches

REFERENCE = os.path.join(os.path.dirname(__file__), "..", "data",
                         "kimi_k25_processor_reference.safetensors")


@pytest.fixture(scope="module")
def reference():
    with safe_open(REFERENCE, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    pngs = [bytes(tensors[f"image{i}.png"].numpy())
            for i in range(sum(k.endswith(".png") for k in tensors))]
    return tensors, json.loads(metadata["settings"]), pngs


def _config(settings: dict, tmp_path) -> NativeResolutionConfig:
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps({"image_processor_type": "Kimi_K25ImageProcessor", "patch_size": 14,
                                "merge_size": 2, **settings}))
    return NativeResolutionConfig.from_preprocessor_config(str(path))


def test_patches_equal_the_processors(reference, tmp_path):
    tensors, settings, pngs = reference
    assert len(pngs) == 7 and set(settings) == {"patch_budget", "side_limit"}
    for name, values in settings.items():
        config = _config(values, tmp_path)
        ours = [image_patches(Image.open(io.BytesIO(png)).convert("RGB"), config) for png in pngs]
        grids = torch.tensor([grid for _, grid in ours])
        assert torch.equal(grids, tensors[f"{name}.image_grid_thw"]), name
        assert torch.equal(torch.cat([p for p, _ in ours]), tensors[f"{name}.pixel_values"]), name
    # The settings did what they are there for: a downscale by the budget and by the side limit.
    assert tensors["patch_budget.image_grid_thw"][1].tolist() == [1, 10, 8]
    assert tensors["side_limit.image_grid_thw"][1].tolist() == [1, 6, 6]


def test_decoding_converts_to_rgb_as_transformers_does(reference):
    from transformers.image_transforms import convert_to_rgb

    _, _, pngs = reference
    modes = []
    for png in pngs:
        image = Image.open(io.BytesIO(png))
        modes.append(image.mode)
        expected = convert_to_rgb(image, return_numpy=True)
        assert np.array_equal(np.array(decode_image(png)), expected), image.mode
    assert {"RGBA", "L", "P", "RGB"} <= set(modes)


def test_settings_from_preprocessor_config(tmp_path):
    config = _config({"max_patches": 100, "size": {"max_height": 7, "max_width": 7},
                      "image_mean": [0.1, 0.2, 0.3], "image_std": [0.5, 0.6, 0.7]}, tmp_path)
    assert (config.max_patches, config.max_side_patches, config.mean, config.std) == (
        100, 7, (0.1, 0.2, 0.3), (0.5, 0.6, 0.7))
    assert NativeResolutionConfig.from_preprocessor_config(
        str(tmp_path / "preprocessor_config.json")).tokens_per_merge == 4
    for bad, field in (({"patch_size": 0}, "patch_size"),
                       ({"image_std": [0.5, 0, 0.5]}, "image_std"),
                       ({"size": {"max_height": 4, "max_width": 8}}, "max_height"),
                       ({"do_normalize": False}, "do_normalize"),
                       ({"resample": 2}, "resample")):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({"merge_size": 2, **bad}))
        with pytest.raises(DataError) as err:
            NativeResolutionConfig.from_preprocessor_config(str(path))
        message = str(err.value)
        assert "\n" not in message and str(path) in message and field in message, message
    with pytest.raises(DataError, match="missing"):
        NativeResolutionConfig.from_preprocessor_config(str(tmp_path / "none.json"))


def test_settings_in_the_published_layout(tmp_path):
    """The published checkpoints nest their settings under ``media_proc_cfg`` with their own
    names; they mean the same as transformers' (the reference's side-limit setting, here)."""
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps({"media_proc_cfg": {
        "in_patch_limit": 1000, "patch_limit_on_one_side": 6, "patch_size": 14,
        "merge_kernel_size": [2, 2], "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "fixed_output_tokens": None, "temporal_merge_kernel_size": 4}}))
    assert NativeResolutionConfig.from_preprocessor_config(str(path)) == _config(
        {"max_patches": 1000, "size": {"max_height": 6, "max_width": 6}}, tmp_path)
    for bad, field in (({"media_proc_cfg": {"fixed_output_tokens": 64}}, "fixed_output_tokens"),
                       ({"media_proc_cfg": {"merge_kernel_size": [2, 3]}}, "merge_kernel_size"),
                       ({"image_processor_type": "CLIPImageProcessor", "crop_size": 224},
                        "media_proc_cfg")):
        path.write_text(json.dumps(bad))
        with pytest.raises(DataError, match=field):
            NativeResolutionConfig.from_preprocessor_config(str(path))


def test_placeholders_become_one_token_per_merged_patch(reference):
    _, _, pngs = reference
    images = NativeResolutionImages(NativeResolutionConfig(), "<|media_pad|>", 7,
                                    "<a><|media_pad|><b>")
    messages = images.messages([{"role": "user", "content": "<image>\nwhat?"}])
    assert messages[0]["content"] == "<a><|media_pad|><b>\nwhat?"
    pixels = images.pixels([pngs[0], pngs[2]])  # grids 4x4 and 4x6: 4 and 6 tokens
    assert pixels["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 6]]
    assert pixels["pixel_values"].shape == (16 + 24, 3, 14, 14)
    ids, targets = images.expand([1, 7, 2, 7, 3], [0, 0, 1, 0, 1], pixels)
    assert ids == [1] + [7] * 4 + [2] + [7] * 6 + [3]
    assert targets == [0] * 5 + [1] + [0] * 6 + [1]
    with pytest.raises(ImageCountMismatch, match="1 image placeholder"):
        images.expand([1, 7, 2], [0, 0, 1], pixels)


KIMI_PROCESSOR = {"image_processor_type": "Kimi_K25ImageProcessor", "patch_size": 14,
                  "merge_size": 2, "max_patches": 16384,
                  "size": {"max_height": 512, "max_width": 512}}
QWEN_PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16,
                  "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 4096,
                  "max_pixels": 65536, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}


def _checkpoint_config(family: str, directory):
    """A checkpoint folder's config.json (a tiny model of the family: Kimi-K2.5's tower cuts
    14-pixel patches merged 2x2, Qwen3-VL's 16-pixel ones merged 2x2) and its family."""
    from megatron_slmoe.families import family_for
    from tests.helpers import hf_models

    config = (hf_models.kimi_config() if family == "kimi" else
              hf_models.build_qwen3_vl_moe().config)
    config.architectures = [{"kimi": "Kimi_K25ForConditionalGeneration",
                             "qwen": "Qwen3VLMoeForConditionalGeneration"}[family]]
    config.save_pretrained(str(directory))
    return family_for(config.to_dict(), "config.json")


@pytest.mark.parametrize("family, change, needle", [
    ("kimi", {}, None),
    ("kimi", {"merge_size": 3}, "merge_size 3 does not fit the checkpoint's tower (merge_size 2"),
    ("kimi", {"patch_size": 16}, "patch_size 16 does not fit the checkpoint's tower (patch_size "
                                 "14"),  # this one trained, on wrongly cut images
    ("qwen", {}, None),
    ("qwen", {"patch_size": 14}, "patch_size 14 does not fit the checkpoint's tower (patch_size "
                                 "16"),
])
def test_an_image_processor_that_disagrees_with_its_tower_is_refused(tmp_path, family, change,
                                                                     needle):
    """The checkpoint's preprocessor_config.json against its config.json's tower, when the run
    takes its image input (before start-up): one line naming the file and the setting (a merge
    of 3 failed inside the tower, 'index 8 is out of bounds'; Qwen's 14-pixel patches in a
    reshape)."""
    fam = _checkpoint_config(family, tmp_path)
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps({**(KIMI_PROCESSOR if family == "kimi" else QWEN_PROCESSOR),
                                **change}))
    if needle is None:
        assert fam.image_patches(str(path)).tokens_per_merge == 4
        return
    with pytest.raises(DataError) as err:
        fam.image_patches(str(path))
    assert str(err.value).startswith(f"{path}: {needle}") and "\n" not in str(err.value)


def test_an_image_qwens_processor_refuses_is_a_bad_sample(tmp_path):
    """A 3x900 image (aspect ratio 300, over Qwen2-VL's 200): an undecodable image, which the
    dataset counts and skips (it was an exception)."""
    from megatron_slmoe.data.image import ImageDecodeError
    from megatron_slmoe.families.qwen3_vl_moe.processor import Qwen2VLPatches

    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps(QWEN_PROCESSOR))
    images = NativeResolutionImages(Qwen2VLPatches.from_preprocessor_config(str(path)),
                                    "<|image_pad|>", 7, "<|image_pad|>")
    png = io.BytesIO()
    Image.new("RGB", (3, 900), (10, 200, 10)).save(png, format="PNG")
    with pytest.raises(ImageDecodeError, match="refuses the 3x900 image: absolute aspect ratio"):
        images.pixels([png.getvalue()])
