"""A model family is one folder: a new text family and a new multimodal family, each made as a
copy of a family folder in a scratch package (its classes and architecture renamed, its imports
pointed at the copy), work end to end once their registry entry exists, with no edit anywhere
else in the package. The copies are held to transformers' model of the family they were copied
from (logits, and LoRA on the tower and projector), so the test fails if generic code finds a
family by its module path, class or name rather than through the registry and the protocol
(the scratch names are new)."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import sys

import pytest
import torch

import megatron_slmoe.families as families
from tests.helpers import hf_models

pytestmark = pytest.mark.usefixtures("megatron_single_rank")

FAMILIES_DIR = os.path.dirname(families.__file__)


def _copy_family(source: str, name: str, classes: dict[str, str], architecture: str,
                 scratch) -> object:
    """Copy ``families/<source>/`` to ``<scratch>/scratch_families/<name>/``, renaming
    ``classes`` and pointing its own imports at the copy; return the copy's family (an
    instance) with ``architecture`` as its only architecture."""
    package = scratch / "scratch_families"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    shutil.copytree(os.path.join(FAMILIES_DIR, source), package / name)
    for path in (package / name).glob("*.py"):
        text = path.read_text().replace(f"megatron_slmoe.families.{source}.",
                                        f"scratch_families.{name}.")
        for old, new in classes.items():
            text = re.sub(rf"\b{old}\b", new, text)
        path.write_text(text)
    family_module = importlib.import_module(f"scratch_families.{name}.family")
    family_class = getattr(family_module, classes[next(k for k in classes if "Family" in k)])
    family = family_class()
    family.name, family.architectures = name, (architecture,)
    return family


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A scratch package on the path and a registry to add one entry to."""
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = dict(families._BY_ARCHITECTURE)
    monkeypatch.setattr(families, "_BY_ARCHITECTURE", registry)
    yield tmp_path, registry
    for module in [m for m in sys.modules if m.startswith("scratch_families")]:
        del sys.modules[module]


def _with_architecture(directory: str, architecture: str) -> str:
    path = os.path.join(directory, "config.json")
    config = json.load(open(path))
    config["architectures"] = [architecture]
    json.dump(config, open(path, "w"))
    return directory


def test_a_text_family_is_its_folder_and_one_registry_entry(scratch, tmp_path):
    root, registry = scratch
    family = _copy_family("qwen3_moe", "scratch_moe", {"Qwen3MoeFamily": "ScratchMoeFamily"},
                          "ScratchMoeForCausalLM", root)
    model = hf_models.build("qwen3_moe")
    directory = _with_architecture(hf_models.save(model, str(tmp_path / "ckpt")),
                                   "ScratchMoeForCausalLM")
    from megatron_slmoe.hf.loader import open_hf_checkpoint

    with pytest.raises(Exception, match="unknown architecture 'ScratchMoeForCausalLM'"):
        open_hf_checkpoint(directory, check_shapes=False)
    registry["ScratchMoeForCausalLM"] = family  # the registry entry
    assert open_hf_checkpoint(directory).family is family
    input_ids = hf_models.tokens()
    logits, report = hf_models.import_and_run(directory, input_ids)
    torch.testing.assert_close(logits, hf_models.hf_logits(model, input_ids), rtol=1e-5,
                               atol=1e-5)
    assert report.tensors > 0


def test_a_multimodal_family_is_its_folder_and_one_registry_entry(scratch, tmp_path):
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.inject import inject_lora

    root, registry = scratch
    family = _copy_family("kimi_k25", "scratch_vl",
                          {"KimiK25Family": "ScratchVLFamily", "KimiK25Vision": "ScratchVision"},
                          "ScratchVLForConditionalGeneration", root)
    registry["ScratchVLForConditionalGeneration"] = family  # the registry entry
    model = hf_models.build_kimi()
    directory = _with_architecture(hf_models.save(model, str(tmp_path / "ckpt"), layout="fused"),
                                   "ScratchVLForConditionalGeneration")
    inputs = hf_models.kimi_inputs()
    ours, built = hf_models.load_kimi(directory)
    assert type(ours.vision).__module__ == "scratch_families.scratch_vl.vision"
    extra = {k: inputs[k] for k in ("pixel_values", "image_grid_thw")}
    logits = hf_models.megatron_logits(ours, inputs["input_ids"], **extra)
    torch.testing.assert_close(logits, hf_models.kimi_hf_logits(model, inputs), rtol=1e-5,
                               atol=1e-5)
    # LoRA finds the copy's tower and projector by the regions it declares: as many adapted
    # linears as transformers' tower and projector hold of those kinds.
    adapted = inject_lora([ours], LoRAConfig(rank=2, targets=["vision_attention", "projector"]))
    tower = model.model.vision_tower
    attention = [n for n, m in tower.named_modules()
                 if type(m) is torch.nn.Linear and n.split(".")[-1] in ("q_proj", "k_proj",
                                                                          "v_proj", "proj")]
    projector = [n for n, m in model.model.mm_projector.named_modules()
                 if type(m) is torch.nn.Linear]
    assert len(adapted) == len(attention) + len(projector) > 0
    assert all(name.startswith("vision.") for name in adapted)
