"""The planner prices an image-text run's vision tower and projector: parameter and LoRA counts
against the modules Megatron-Core builds (CLIPViTModel, MultimodalProjector inside LLaVAModel), and
the first stage's estimate grows by exactly their weights, adapters and activations."""

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

    run = build_run_config({"data": {"task": "image-text"},
                            "vision": {"num_layers": 3, "num_attention_heads": 1}})
    settings = RunSettings.from_run_config(run, world_size=2, dtype="fp32")
    assert settings.vision.layers == 3 and settings.vision.patches == 4
    text = RunSettings.from_run_config(build_run_config({}), world_size=2, dtype="fp32")
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
