"""The planner prices an image-text run's vision tower and projector: parameter and LoRA counts
against the modules Megatron-Core builds (CLIPViTModel, MultimodalProjector inside LLaVAModel), and
the first stage's estimate grows by exactly their weights, adapters and activations. A Hugging
Face checkpoint's own tower (Kimi-K2.5's MoonViT and projector) likewise: its counts against
transformers' model and PEFT's adapters, its activations against what autograd keeps."""

import pytest

from megatron_slmoe.data.config import ImageTextConfig
from megatron_slmoe.model.config import VisionConfig
from megatron_slmoe.plan import RunSettings, estimate_memory, load_shape
from megatron_slmoe.plan.devices import DeviceSpec
from megatron_slmoe.plan.vision import VisionShape, vision_lora_parameters, vision_parameters

CPU = DeviceSpec("cpu", memory_bytes=2**40, bf16_tflops=1.0, intra_node_gbps=1.0,
                 inter_node_gbps=1.0)
TINY_FP32 = dict(dtype="fp32", seq_length=64, global_batch_size=16, moe_imbalance=1.0)
VISIONS = {
    "clip-mlp": VisionConfig(),
    "siglip-affine": VisionConfig(model_type="siglip", drop_class_token=False, img_h=32, img_w=48,
                                  patch_dim=8, num_layers=1, hidden_size=32,
                                  projector_type="affine"),
}
VISION_TARGETS = ["vision_attention", "projector"]


def _built_counts(vision: VisionConfig) -> tuple[dict, int]:
    from megatron_slmoe.parallel.config import ParallelConfig
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.inject import inject_lora
    from megatron_slmoe.model.build import run_transformer_config
    from megatron_slmoe.model.model_file import load_model_config
    from megatron_slmoe.model.multimodal import build_multimodal_model

    mc = load_model_config("tiny")
    model = build_multimodal_model(mc, run_transformer_config(mc, ParallelConfig(), bf16=False),
                                   vision, seq_length=64)
    base = {"vision_tower": sum(p.numel() for p in model.vision_model.parameters()),
            "projector": sum(p.numel() for p in model.vision_projection.parameters())}
    before = {n for n, _ in model.named_parameters()}
    inject_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=VISION_TARGETS))
    lora = sum(p.numel() for n, p in model.named_parameters()
               if n not in before and n.startswith(("vision_model.", "vision_projection.")))
    return base, lora


@pytest.mark.parametrize("name", sorted(VISIONS))
def test_vision_counts_equal_the_built_modules(megatron_single_rank, name):
    vision = VISIONS[name]
    shape = VisionShape.from_config(vision, ImageTextConfig())
    base, lora = _built_counts(vision)
    assert vision_parameters(shape, load_shape("tiny").hidden) == base
    assert vision_lora_parameters(shape, 64, VISION_TARGETS, rank=4, tp=1) == lora > 0


def test_first_stage_carries_the_vision_tower():
    lm = load_shape("tiny")
    vision = VisionShape.from_config(VISIONS["clip-mlp"], ImageTextConfig())
    text = RunSettings(pp=2, micro_batch_size=4, **TINY_FP32)
    image = text.replace(vision=vision)
    text_stages = estimate_memory(lm, text, CPU).stages
    image_stages = estimate_memory(lm, image, CPU).stages
    # fp32: every tower and projector parameter is 4 bytes on the first stage, none on the last.
    assert (image_stages[0].weights - text_stages[0].weights
            == 4 * sum(vision_parameters(vision, lm.hidden).values()))
    assert image_stages[1] == text_stages[1]
    # Frozen tower and projector keep nothing for backward; LoRA on them does.
    assert image_stages[0].activations == text_stages[0].activations
    adapted = estimate_memory(lm, image.replace(lora_targets=text.lora_targets + tuple(
        VISION_TARGETS)), CPU).stages[0]
    assert (adapted.trainable_params - image_stages[0].trainable_params
            == vision_lora_parameters(vision, lm.hidden, VISION_TARGETS, 8, 1))
    assert adapted.activations > image_stages[0].activations


def test_image_text_run_settings_name_the_tower():
    from megatron_slmoe.training.cli import build_run_config
    from megatron_slmoe.training.inputs import run_settings

    run = build_run_config({"data": {"task": "image-text"},
                            "vision": {"num_layers": 3, "num_attention_heads": 1}})
    settings = run_settings(run, world_size=2, dtype="fp32")
    assert settings.vision.layers == 3 and settings.vision.patches == 4
    text = run_settings(build_run_config({}), world_size=2, dtype="fp32")
    assert text.vision is None
    assert settings.layout_error(load_shape("tiny")) is None
    assert text.replace(tp=2).layout_error(load_shape("tiny")) is None
    assert "1 vision attention heads" in settings.replace(tp=2).layout_error(load_shape("tiny"))


@pytest.mark.parametrize("targets", [["vision_attention"], ["projector"], VISION_TARGETS],
                         ids=["attention", "projector", "both"])
@pytest.mark.parametrize("name", sorted(VISIONS))
def test_vision_activations_equal_what_autograd_saves(megatron_single_rank, name, targets):
    """The tower and projector run as LLaVAModel runs them (class token dropped, [s, b, h] into
    the projector); the storages autograd keeps for backward, parameters excluded, are what the
    planner says the first stage keeps for one micro-batch's images."""
    import torch

    from megatron_slmoe.parallel.config import ParallelConfig
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.inject import inject_lora
    from megatron_slmoe.model.build import run_transformer_config
    from megatron_slmoe.model.model_file import load_model_config
    from megatron_slmoe.model.multimodal import build_multimodal_model
    from megatron_slmoe.plan.vision import vision_activations
    from tests.helpers.autograd import saved_activation_bytes

    vision, micro_batch = VISIONS[name], 2
    mc = load_model_config("tiny")
    model = build_multimodal_model(mc, run_transformer_config(mc, ParallelConfig(), bf16=False),
                                   vision, seq_length=64)
    inject_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=targets))
    shape = VisionShape.from_config(vision, ImageTextConfig())
    images = torch.randn(micro_batch * shape.tiles_per_sample, 3, vision.img_h, vision.img_w)

    def forward():  # as LLaVAModel runs them
        embeddings = model.vision_model(images)
        if shape.class_token and vision.drop_class_token:
            embeddings = embeddings[:, 1:]
        model.vision_projection(embeddings.permute(1, 0, 2).contiguous())

    predicted, _ = vision_activations(shape, load_shape("tiny").hidden, targets, rank=4, tp=1,
                                      micro_batch_size=micro_batch, element_size=4)
    assert predicted == saved_activation_bytes(model, forward)


# --- a Hugging Face checkpoint's own tower (Kimi-K2.5's MoonViT and projector) ------------------

KIMI_VARIANTS = {"tiny": {}, "wider": dict(num_hidden_layers=3, hidden_size=32,
                                           num_attention_heads=4, intermediate_size=48)}


def _kimi_config(variant: str):
    from tests.helpers import hf_models

    vision = KIMI_VARIANTS[variant]
    config = hf_models.kimi_config(projection_hidden_size=vision.get("hidden_size", 16))
    for name, value in vision.items():
        setattr(config.vision_config, name, value)
    return config


@pytest.mark.parametrize("targets", [["vision_attention"], ["projector"], VISION_TARGETS],
                         ids=["attention", "projector", "both"])
def test_hf_tower_census_equals_transformers_and_peft(megatron_single_rank, tmp_path, targets):
    """Parameters: transformers' Kimi_K25ForConditionalGeneration's tower and projector;
    adapter parameters: PEFT's LoRA on the same linears."""
    from peft import LoraConfig, get_peft_model

    from megatron_slmoe.hf.loader import open_hf_checkpoint
    from megatron_slmoe.hf.tower_model import vision_census
    from tests.helpers import hf_models

    model = hf_models.build_kimi()
    hf_models.save(model, str(tmp_path / "kimi"), layout="fused")
    hf = open_hf_checkpoint(str(tmp_path / "kimi"))
    built, build = [], hf.family.vision_module

    def spy(*args, **kwargs):  # the census holds no real storage (Kimi-K2.5's is 1.8 GB)
        module = build(*args, **kwargs)
        built.append({p.device.type for p in module.parameters()})
        return module

    hf.family.vision_module = spy
    census = vision_census(hf, targets, lora_rank=4)
    assert built == [{"meta"}]
    vision = model.model.vision_tower, model.model.mm_projector
    assert census.parameters == sum(p.numel() for m in vision for p in m.parameters())
    patterns = {"vision_attention": r"vision_tower\..*\.attn\.(q_proj|k_proj|v_proj|proj)",
                "projector": r"mm_projector\.(in_proj|out_proj)"}
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=r".*(" + "|".join(
        patterns[t] for t in targets) + r")$"))
    assert census.lora_parameters == sum(
        p.numel() for n, p in peft.named_parameters() if "lora_" in n) > 0
    assert (census.layers, census.hidden, census.heads, census.ffn_hidden,
            census.patches_per_position) == (2, 16, 2, 24, 4)
    assert vision_census(None, targets, 4) is None


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("targets", [["vision_attention"], ["projector"], VISION_TARGETS],
                         ids=["attention", "projector", "both"])
@pytest.mark.parametrize("variant", sorted(KIMI_VARIANTS))
def test_hf_tower_activations_equal_what_autograd_saves(megatron_single_rank, variant, targets,
                                                        dtype):
    """Two images of different patch grids through MoonViT and the projector with LoRA on
    ``targets``: the storages autograd keeps for backward are what the planner says. In bf16
    the planner prices LayerNorm's mean and rstd in fp32, as CUDA keeps them; CPU keeps them
    in bf16, 2 bytes less each."""
    import torch

    from megatron_slmoe.families.kimi_k25.vision import KimiK25Vision
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.inject import inject_lora
    from megatron_slmoe.plan.vision import ReplicatedTower, tower_activations
    from tests.helpers.autograd import saved_activation_bytes

    torch_dtype, size = {"fp32": (torch.float32, 4), "bf16": (torch.bfloat16, 2)}[dtype]
    torch.manual_seed(0)
    vision = KimiK25Vision(_kimi_config(variant)).to(torch_dtype)
    vision.requires_grad_(False)
    inject_lora(vision, LoRAConfig(rank=4, alpha=8.0, targets=targets))
    grid = torch.tensor([[1, 8, 8], [1, 4, 8]])
    patches = int(grid.prod(-1).sum())
    pixels = torch.randn(patches, 3, 14, 14, dtype=torch_dtype)
    tower = ReplicatedTower(parameters=0, lora_parameters=0, **vision.layer_shape(),
                            attention_adapted="vision_attention" in targets,
                            projector_adapted="projector" in targets)
    predicted, _ = tower_activations(tower, patches, rank=4, element_size=size)
    stats = 0
    if tower.attention_adapted and size < 4:  # two LayerNorms a layer and the projector's
        stats = (4 * tower.layers + 2) * (4 - size) * patches
    assert predicted - stats == saved_activation_bytes(vision, lambda: vision(pixels, grid))


def test_first_stage_carries_an_hf_checkpoints_tower():
    from megatron_slmoe.plan.vision import ReplicatedTower, tower_activations

    lm = load_shape("tiny")
    text = RunSettings(pp=2, micro_batch_size=2, **TINY_FP32)
    tower = ReplicatedTower(parameters=10_000, lora_parameters=500, layers=2, hidden=16,
                            heads=2, ffn_hidden=24, patches_per_position=4,
                            attention_adapted=True)
    plain, with_tower = (estimate_memory(lm, s, CPU).stages
                         for s in (text, text.replace(vision=tower)))
    assert with_tower[0].weights - plain[0].weights == 4 * 10_000  # fp32, whole on the stage
    assert with_tower[0].trainable_params - plain[0].trainable_params == 500
    assert with_tower[1] == plain[1]  # the last stage has no tower
    kept, _ = tower_activations(tower, tower.patches(64, 2), 8, 4)
    assert kept > 0 and with_tower[0].activations > plain[0].activations
    assert text.replace(vision=tower, tp=2).layout_error(lm) is None  # replicated: not split


def test_the_start_up_check_prices_the_checkpoints_tower(megatron_single_rank, tmp_path):
    import dataclasses

    import megatron_slmoe
    from megatron_slmoe.plan.vision import tower_activations
    from megatron_slmoe.hf.loader import open_hf_checkpoint
    from megatron_slmoe.training.cli import build_run_config
    from megatron_slmoe.training.inputs import hf_tower, memory_check
    from tests.helpers import hf_models

    hf_models.save(hf_models.build_kimi(), str(tmp_path / "kimi"), layout="fused")
    hf = open_hf_checkpoint(str(tmp_path / "kimi"))
    run = build_run_config({"model": {"hf_checkpoint": str(tmp_path / "kimi"),
                                      "precision": "fp32"},
                            "data": {"task": "image-text", "seq_length": 64},
                            "lora": {"targets": ["linear_qkv", "vision_attention"]},
                            "parallel": {"device_memory_gb": 1}})
    tower = hf_tower(run, hf)
    assert tower.attention_adapted and not tower.projector_adapted and tower.lora_parameters > 0
    first = [memory_check(run, 1, megatron_slmoe.PLATFORM, hf.model_config, opened)
             .verdict.memory.stages[0] for opened in (None, hf)]
    assert first[1].weights - first[0].weights == 4 * tower.parameters
    assert first[1].trainable_params - first[0].trainable_params == tower.lora_parameters
    micro_batch = run.schedule.micro_batch_size
    kept, _ = tower_activations(tower, tower.patches(64, micro_batch), 8, 4)
    assert tower.patches(64, micro_batch) == micro_batch * 64 * 4  # every position an image's
    assert first[1].activations - first[0].activations == kept
    # A text run on the checkpoint: the tower is there, and trains on one blank merged patch.
    text = dataclasses.replace(run, data=dataclasses.replace(run.data, task="text"))
    assert hf_tower(text, hf).patches(64, 1) == tower.patches_per_position
    first = [memory_check(text, 1, megatron_slmoe.PLATFORM, hf.model_config, opened)
             .verdict.memory.stages[0] for opened in (None, hf)]
    kept, _ = tower_activations(tower, tower.patches_per_position, 8, 4)
    assert first[1].activations - first[0].activations == kept


def test_qwen3_vl_tower_census_equals_transformers_and_peft(megatron_single_rank, tmp_path):
    """Qwen3-VL-MoE's tower and mergers: parameters as transformers' model holds them, adapter
    parameters as PEFT's LoRA on the fused q/k/v, the output projections and the mergers'
    linears (DeepStack's too)."""
    from peft import LoraConfig, get_peft_model

    from megatron_slmoe.hf.loader import open_hf_checkpoint
    from megatron_slmoe.hf.tower_model import vision_census
    from tests.helpers import hf_models

    model = hf_models.build_qwen3_vl_moe()
    hf_models.save(model, str(tmp_path / "qwen3vl"), layout="fused")
    census = vision_census(open_hf_checkpoint(str(tmp_path / "qwen3vl")), VISION_TARGETS,
                           lora_rank=4)
    assert census.parameters == sum(p.numel() for p in model.model.visual.parameters())
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=(
        r".*visual\.(blocks\.\d+\.attn\.(qkv|proj)"
        r"|(merger|deepstack_merger_list\.\d+)\.linear_fc[12])$")))
    assert census.lora_parameters == sum(
        p.numel() for n, p in peft.named_parameters() if "lora_" in n) > 0
    assert (census.layers, census.hidden, census.patches_per_position) == (2, 16, 4)
