"""Qwen3-VL-MoE import on one rank: a tiny random Qwen3VLMoeForConditionalGeneration saved by
transformers (Qwen3-VL tower with DeepStack, Qwen3-MoE language model with interleaved M-RoPE):
its logits equal transformers' (fp32, 1e-5) on text and on image+text batches (two images of
different patch grids; DeepStack's features change transformers' logits, so ours carry them), in
transformers' expert layout and the published transposed one (and for square experts, read as
transformers reads them); LoRA on the language model, the tower's fused q/k/v and projections
and the mergers exports as a PEFT adapter and a merged checkpoint with our logits; greedy
answers equal ``generate``; placeholders that do not match the images are one line; a trained
tower keeps its gradients without images."""

import pytest
import torch

from tests.helpers import hf_models

pytestmark = pytest.mark.usefixtures("megatron_single_rank")


def test_text_logits_match_transformers(tmp_path):
    model = hf_models.build_qwen3_vl_moe()
    hf_models.save(model, str(tmp_path / "qwen3vl"), layout="fused")
    input_ids = hf_models.tokens()
    ours = hf_models.megatron_logits(hf_models.load_kimi(str(tmp_path / "qwen3vl"))[0],
                                     input_ids)
    with torch.no_grad():
        theirs = model(input_ids=input_ids).logits.float()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_image_text_logits_match_transformers(tmp_path):
    model = hf_models.build_qwen3_vl_moe()
    hf_models.save(model, str(tmp_path / "qwen3vl"), layout="fused")
    inputs = hf_models.qwen3_vl_inputs()
    ours, _ = hf_models.kimi_import_and_run(str(tmp_path / "qwen3vl"), inputs)
    mm_types = (inputs["input_ids"] == hf_models.QWEN3_VL_IMAGE_TOKEN).int()
    with torch.no_grad():
        theirs = model(**inputs, mm_token_type_ids=mm_types).logits.float()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # DeepStack matters: without its features the logits differ.
    with torch.no_grad():
        for merger in model.model.visual.deepstack_merger_list:
            merger.linear_fc2.weight.zero_()
            merger.linear_fc2.bias.zero_()
        assert not torch.allclose(model(**inputs, mm_token_type_ids=mm_types).logits, theirs,
                                  atol=1e-3)


def test_peft_adapter_gives_our_image_text_logits(tmp_path):
    """LoRA on the language model, the tower's fused q/k/v and output projections, and the
    mergers (DeepStack's too), every factor random: the exported PEFT adapter on transformers'
    model, and the merged checkpoint (experts fused, which transformers reads for this family),
    give our image+text logits."""
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import Qwen3VLMoeForConditionalGeneration

    from megatron_slmoe.commands.convert_hf import main as convert_hf
    from megatron_slmoe.lora.adapter import save_adapter
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.inject import inject_lora

    base = hf_models.build_qwen3_vl_moe()
    hf_dir = hf_models.save(base, str(tmp_path / "qwen3vl"), layout="fused")
    model, _ = hf_models.load_kimi(hf_dir)
    lora_config = LoRAConfig(rank=4, alpha=8.0, targets=[
        "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "router", "vision_attention",
        "projector"])
    inject_lora([model], lora_config)
    hf_models.randomise_lora(model)  # every factor random, as after training
    inputs = hf_models.qwen3_vl_inputs()
    ours = hf_models.megatron_logits(model, inputs["input_ids"],
                                     pixel_values=inputs["pixel_values"],
                                     image_grid_thw=inputs["image_grid_thw"])
    save_adapter([model], str(tmp_path / "adapter"), lora_config)
    assert convert_hf(["export", "--adapter", str(tmp_path / "adapter"), "--hf-checkpoint",
                       hf_dir, "--output", str(tmp_path / "peft"),
                       "--expert-layout", "fused"]) == 0
    with safe_open(str(tmp_path / "peft" / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    for module in ("visual.blocks.1.attn.qkv", "visual.blocks.0.attn.proj",
                   "visual.merger.linear_fc2", "visual.deepstack_merger_list.0.linear_fc1"):
        assert f"base_model.model.model.{module}.lora_B.weight" in keys, module
    mm_types = (inputs["input_ids"] == hf_models.QWEN3_VL_IMAGE_TOKEN).int()

    def logits_of(hf_model):
        with torch.no_grad():
            return hf_model(**inputs, mm_token_type_ids=mm_types).logits.float()

    peft_model = PeftModel.from_pretrained(hf_models.build_qwen3_vl_moe(),
                                           str(tmp_path / "peft")).eval()
    torch.testing.assert_close(logits_of(peft_model), ours, rtol=1e-5, atol=2e-5)
    assert (logits_of(peft_model) - logits_of(base)).abs().max() > 0.1
    assert convert_hf(["export", "--adapter", str(tmp_path / "adapter"), "--hf-checkpoint",
                       hf_dir, "--output", str(tmp_path / "merged"), "--merged"]) == 0
    merged = Qwen3VLMoeForConditionalGeneration.from_pretrained(
        str(tmp_path / "merged"), dtype=torch.float32, attn_implementation="eager").eval()
    torch.testing.assert_close(logits_of(merged), ours, rtol=1e-5, atol=1e-4)


def _transpose_experts(directory) -> None:
    """Rewrite a checkpoint saved by transformers into the published layout: each expert's
    fused tensors transposed (gate_up_proj [E, H, 2I], down_proj [E, I, H])."""
    from safetensors.torch import load_file, save_file

    for path in directory.glob("*.safetensors"):
        tensors = load_file(str(path))
        for key in tensors:
            if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                tensors[key] = tensors[key].transpose(1, 2).contiguous()
        save_file(tensors, str(path), metadata={"format": "pt"})


def test_the_published_transposed_expert_layout_loads_the_same(tmp_path):
    model = hf_models.build_qwen3_vl_moe()
    fused = hf_models.save(model, str(tmp_path / "fused"), layout="fused")
    published = hf_models.save(model, str(tmp_path / "published"), layout="fused")
    _transpose_experts(tmp_path / "published")
    inputs = hf_models.qwen3_vl_inputs()
    ours = [hf_models.kimi_import_and_run(d, inputs)[0] for d in (fused, published)]
    torch.testing.assert_close(ours[1], ours[0], rtol=0, atol=0)


def test_square_experts_load_as_transformers_reads_them(tmp_path):
    # moe_intermediate_size 16: gate_up_proj [E, 32, 32] fits either layout; transformers
    # reads it as it is stored, and so do we.
    model = hf_models.build_qwen3_vl_moe(moe_intermediate_size=16)
    directory = hf_models.save(model, str(tmp_path / "square"), layout="fused")
    inputs = hf_models.qwen3_vl_inputs()
    ours, _ = hf_models.kimi_import_and_run(directory, inputs)
    mm_types = (inputs["input_ids"] == hf_models.QWEN3_VL_IMAGE_TOKEN).int()
    with torch.no_grad():
        theirs = model(**inputs, mm_token_type_ids=mm_types).logits.float()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_image_placeholders_that_do_not_match_the_images_are_one_line(tmp_path):
    from megatron_slmoe.model.tower_language import ImageTokenMismatch

    hf_dir = hf_models.save(hf_models.build_qwen3_vl_moe(), str(tmp_path / "q"), layout="fused")
    model, _ = hf_models.load_kimi(hf_dir)
    inputs = hf_models.qwen3_vl_inputs()
    ids, grids = inputs["input_ids"], inputs["image_grid_thw"]
    for bad_ids, bad_grids in ((ids, None), (ids, grids[:1]), (ids[:, :5], grids)):
        with pytest.raises(ImageTokenMismatch) as err:
            model.positions(bad_ids, bad_grids)
        assert len(str(err.value).splitlines()) == 1
    with pytest.raises(ImageTokenMismatch, match="text data must not contain the model's image "
                                                 "placeholder .remove it from the text"):
        model.positions(ids, None)  # text alone, holding placeholders: what to fix
    shorter = ids.clone()
    shorter[0, 4] = 0  # splits the first image's run in two
    with pytest.raises(ImageTokenMismatch, match="runs of"):
        model.positions(shorter, grids)


def test_a_trained_tower_keeps_gradients_without_images(tmp_path):
    """A micro-batch without images still gives every trained adapter of the tower and of its
    mergers (DeepStack's too) a gradient (zero), as Megatron's DDP waits for."""
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.inject import inject_lora

    hf_dir = hf_models.save(hf_models.build_qwen3_vl_moe(), str(tmp_path / "q"), layout="fused")
    model, _ = hf_models.load_kimi(hf_dir)
    inject_lora([model], LoRAConfig(rank=2, targets=["linear_qkv", "vision_attention",
                                                     "projector"]))
    model.train()
    tokens = torch.randint(0, hf_models.QWEN3_VL_IMAGE_TOKEN, (2, 12))
    model.embed(tokens, torch.arange(12).expand(2, -1)).sum().backward()
    tower = {n: p for n, p in model.vision.named_parameters() if p.requires_grad}
    assert any("deepstack_merger_list" in n for n in tower) and any("attn.qkv" in n
                                                                    for n in tower)
    assert all(p.grad is not None and not p.grad.any() for p in tower.values())


def test_greedy_answers_equal_transformers_generate(tmp_path):
    """The package's generator (images in the KV cache with the prefill, the whole prefix's 3D
    positions each step, generated tokens continuing from the prompt's largest position) gives
    transformers' greedy ``generate`` on prompts of two lengths with images of two grids."""
    from megatron_slmoe.data.image_text import GenerationPrompt
    from megatron_slmoe.inference.generator import TextGenerator

    model = hf_models.build_qwen3_vl_moe()
    hf_dir = hf_models.save(model, str(tmp_path / "qwen3vl"), layout="fused")
    inputs = hf_models.qwen3_vl_inputs()
    patches = (inputs["image_grid_thw"].prod(-1)).tolist()
    pixels = inputs["pixel_values"].split(patches)
    grids = inputs["image_grid_thw"]
    prompts = [GenerationPrompt(tokens=inputs["input_ids"][row, :length].tolist(),
                                images=pixels[row], image_grid_thw=grids[row:row + 1])
               for row, length in enumerate((12, 10))]
    ours_model, _ = hf_models.load_kimi(hf_dir)
    eos = hf_models.VOCAB - 1
    answers = TextGenerator(ours_model, eos, hf_models.VOCAB).generate(prompts, 6)
    assert sum(len(a) for a in answers) > 4
    for prompt, answer in zip(prompts, answers):
        ids = torch.tensor([prompt.tokens])
        with torch.no_grad():
            out = model.generate(input_ids=ids, pixel_values=prompt.images,
                                 image_grid_thw=prompt.image_grid_thw,
                                 mm_token_type_ids=(ids == hf_models.QWEN3_VL_IMAGE_TOKEN).int(),
                                 max_new_tokens=6, do_sample=False, eos_token_id=eos,
                                 pad_token_id=eos)
        theirs = out[0, ids.shape[1]:].tolist()
        theirs = theirs[:theirs.index(eos)] if eos in theirs else theirs
        assert answer == theirs
