"""Record what transformers' Kimi-K2.5 image processor makes of a fixed set of images, as the
reference ``tests/unit/test_native_resolution.py`` holds our image pipeline to.

Why a recorded file: the processor is torchvision's (``Kimi_K25ImageProcessor`` is a
``TorchvisionBackend``), and no torchvision wheel loads with the CPU torch build the tests run on.
Run this where torchvision works (torch, torchvision and a transformers with Kimi-K2.5)::

    python tools/kimi_processor_reference.py tests/data/kimi_k25_processor_reference.safetensors

The file holds each image as its PNG bytes (what the data pipeline decodes) and, for each
processor setting below, ``pixel_values`` and ``image_grid_thw`` of all images in one call, with
the versions that made it in the metadata. (The recorded file was made with transformers 5.17,
whose processor drops an image's alpha channel; 5.25 composites it onto white, as
``data/image.decode_image`` does: the test checks that conversion against the installed
transformers' ``convert_to_rgb``, and the patches against this file.)
"""

from __future__ import annotations

import io
import json
import sys

import numpy as np

# name -> the processor's settings (those of preprocessor_config.json)
SETTINGS = {
    "patch_budget": dict(max_patches=64, size={"max_height": 512, "max_width": 512},
                         image_mean=[0.48145466, 0.4578275, 0.40821073],
                         image_std=[0.26862954, 0.26130258, 0.27577711]),
    "side_limit": dict(max_patches=1000, size={"max_height": 6, "max_width": 6}),  # mean 0.5
}


def images() -> list:
    """PIL images of the shapes and modes the pipeline meets: RGB noise and gradients (one
    larger than the patch budget), grayscale, RGBA with varying transparency, palette, and
    images smaller than one patch."""
    from PIL import Image

    rng = np.random.default_rng(20261204)
    out = []

    def rgb(h, w):
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([xx * 255 / max(w - 1, 1), yy * 255 / max(h - 1, 1),
                         (xx + yy) * 127 / max(h + w - 2, 1)], -1)
        return np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)

    out.append(Image.fromarray(rgb(45, 30), "RGB"))
    out.append(Image.fromarray(rgb(200, 150), "RGB"))
    out.append(Image.fromarray(rgb(33, 70)[..., 0], "L"))
    rgba = np.concatenate([rgb(40, 52), rng.integers(0, 256, (40, 52, 1), dtype=np.uint8)], -1)
    out.append(Image.fromarray(rgba, "RGBA"))
    out.append(Image.fromarray(rgb(61, 100), "RGB").convert("P", palette=Image.ADAPTIVE))
    out.append(Image.fromarray(rgb(9, 5), "RGB"))
    out.append(Image.fromarray(rgb(14, 14), "RGB"))
    return out


def main(path: str) -> None:
    import torch
    import torchvision
    import transformers
    from PIL import Image
    from safetensors.torch import save_file
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor

    tensors, pngs = {}, []
    for i, image in enumerate(images()):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        data = buffer.getvalue()
        tensors[f"image{i}.png"] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        pngs.append(Image.open(io.BytesIO(data)))  # the processor sees the decoded PNG
    for name, settings in SETTINGS.items():
        out = Kimi_K25ImageProcessor(**settings)(pngs, return_tensors="pt")
        tensors[f"{name}.pixel_values"] = out["pixel_values"].contiguous()
        tensors[f"{name}.image_grid_thw"] = out["image_grid_thw"].contiguous()
        print(name, tuple(out["pixel_values"].shape), out["image_grid_thw"].tolist())
    metadata = {"settings": json.dumps(SETTINGS), "transformers": transformers.__version__,
                "torch": torch.__version__, "torchvision": torchvision.__version__,
                "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    save_file(tensors, path, metadata=metadata)
    print(metadata)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/kimi_processor_reference.py OUTPUT.safetensors")
    main(sys.argv[1])
