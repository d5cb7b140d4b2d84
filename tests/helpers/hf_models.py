"""Tiny random Hugging Face MoE models for the import tests, built with transformers' own config
and model classes and saved with ``save_pretrained`` (nothing is downloaded).

``save_family(name, directory, layout)`` writes one family's model and returns it (fp32, eval)
for reference logits: ``layout="original"`` is what ``save_pretrained`` writes by default
(per-expert keys, a family's historical prefix), ``"fused"`` transformers 5's in-memory layout
(``save_original_format=False``: 3D expert tensors). Every weight is drawn at a scale where the
routing and every block matter (norm weights around 1, biases non-zero).
"""

from __future__ import annotations

import math
import os
import re

import torch
from transformers.utils import logging as _transformers_logging

_transformers_logging.disable_progress_bar()  # no "Writing model shards" bars in test output

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 32, 4, 2, 8
EXPERTS, TOPK = 4, 2
FAMILY_NAMES = ("qwen3_moe", "deepseek_v3", "nemotron_h", "stable_latent_moe")


def _config(name: str, **overrides):
    import transformers

    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**{**dict(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
            head_dim=HEAD_DIM, num_experts=EXPERTS, num_experts_per_tok=TOPK, norm_topk_prob=True,
            mlp_only_layers=[0], max_position_embeddings=64, rope_theta=10000.0,
            tie_word_embeddings=False), **overrides})
    if name == "deepseek_v3":
        return transformers.DeepseekV3Config(**{**dict(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=HEADS,
            n_routed_experts=EXPERTS, num_experts_per_tok=TOPK, n_shared_experts=1, n_group=2,
            topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=16,
            kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
            max_position_embeddings=64, tie_word_embeddings=False), **overrides})
    if name == "nemotron_h":
        return transformers.NemotronHConfig(**{**dict(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48,
            layers_block_type=["full_attention", "moe", "full_attention", "mlp"],
            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
            n_routed_experts=EXPERTS, num_experts_per_tok=TOPK, moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=24, moe_latent_size=16, n_group=2, topk_group=1,
            routed_scaling_factor=1.5, max_position_embeddings=64), **overrides})
    if name == "stable_latent_moe":
        from megatron_slmoe.families.slmoe.modeling import StableLatentMoeConfig

        return StableLatentMoeConfig(**{**dict(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
            qk_layernorm=True, num_experts=EXPERTS, num_experts_per_tok=TOPK,
            moe_intermediate_size=16, moe_latent_size=16, shared_expert_intermediate_size=24,
            moe_layers=[0, 1], router_score_function="sigmoid", router_expert_bias=True,
            router_num_groups=2, router_group_topk=1, router_topk_scaling_factor=2.0,
            max_position_embeddings=64), **overrides})
    raise ValueError(name)


def build(name: str, seed: int = 0, **overrides):
    """The HF model of family ``name`` with random weights (fp32, eval mode)."""
    from transformers import AutoModelForCausalLM

    config = _config(name, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if not tensor.is_floating_point() or "inv_freq" in pname or "rotary" in pname:
                continue
            noise = torch.randn(tensor.shape, generator=gen)
            if "norm" in pname:
                tensor.copy_(1.0 + 0.2 * noise)
            elif tensor.dim() == 1:  # score-correction bias
                tensor.copy_(0.2 * noise)
            else:
                tensor.copy_(noise / math.sqrt(tensor.shape[-1]))
    return model


def save(model, directory: str, layout: str = "original") -> str:
    model.save_pretrained(directory, save_original_format=(layout == "original"))
    return directory


def save_family(name: str, directory: str, layout: str = "original", **overrides):
    model = build(name, **overrides)
    save(model, directory, layout)
    return model


def tokens(batch: int = 2, seq: int = 8, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


# --- a tokenizer with a chat template -----------------------------------------------------------

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def save_chatml_tokenizer(path, special_tokens=(), **config):
    """A byte-level BPE ``tokenizer.json`` (about 300 tokens, then a model's ``special_tokens``)
    and a ``tokenizer_config.json`` with ChatML's special tokens and template (``config``
    overrides its entries) in ``path``, as a checkpoint directory holds them."""
    import json

    import tokenizers

    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(["Answer in digits. two one 2 1 nine 9 assistant user system"] * 5,
                                trainer=trainer)
    backend.add_special_tokens(list(special_tokens))
    path.mkdir(exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML,
        **config}))
    return path


# --- block-scaled FP8 -----------------------------------------------------------------------------


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int]):
    """(fp8 values, fp32 scale_inv per block) with ``weight ~ values * scale_inv`` per block, and
    the fp32 weight those represent (the reference), computed here independently of the importer."""
    rows, cols = weight.shape
    br, bc = block
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    scale = torch.empty(nr, nc)
    values = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    dequant = torch.empty(rows, cols)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    for i in range(nr):
        for j in range(nc):
            tile = weight[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            s = tile.abs().max().clamp_min(1e-12) / fp8_max
            q = (tile / s).to(torch.float8_e4m3fn)
            scale[i, j] = s
            values[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = q
            dequant[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = q.float() * s
    return values, scale, dequant


def save_fp8(model, directory: str, block=(16, 16)) -> None:
    """Save ``model`` as a block-scaled FP8 checkpoint (2-D projection weights in FP8 with their
    ``_scale_inv``, as DeepSeek-V3 ships), and set the model's weights to the dequantised values:
    its logits are then the fp32 reference of the same weights."""
    from safetensors.torch import save_file

    model.save_pretrained(directory)
    path = os.path.join(directory, "model.safetensors")
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    out = {}
    for key, tensor in stored.items():
        if tensor.dim() == 2 and key.endswith("proj.weight") and "embed" not in key:
            values, scale, dequant = quantize_block_fp8(tensor.float(), block)
            out[key], out[key + "_scale_inv"] = values, scale
            stored[key] = dequant
        else:
            out[key] = tensor
    save_file(out, path, metadata={"format": "pt"})
    # The reference model: the dequantised weights, loaded the way transformers loads them.
    from transformers import AutoModelForCausalLM

    reference_dir = directory + "-dequantized"
    os.makedirs(reference_dir, exist_ok=True)
    model.config.save_pretrained(reference_dir)
    save_file(stored, os.path.join(reference_dir, "model.safetensors"), metadata={"format": "pt"})
    import json

    config_path = os.path.join(directory, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    return AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32,
                                                attn_implementation="eager").eval()


# --- the imported Megatron model -----------------------------------------------------------------


def megatron_logits(model, input_ids: torch.Tensor, **forward_kwargs):
    """Full-vocabulary logits ``[B, S, V]`` of this rank's Megatron model chunk, run through
    Megatron's forward-only schedule (pipeline stages exchange activations as in training); the
    vocabulary shards of tensor parallelism are gathered. None on all but the last stage.
    ``forward_kwargs``: the model's further inputs (images)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from megatron_slmoe.model.attention_residuals import pipeline_seq_length

    batch, seq = input_ids.shape
    position_ids = torch.arange(seq).expand(batch, seq)

    def step(data_iterator, chunk):
        output = chunk(next(data_iterator), position_ids, None, **forward_kwargs)

        def collect(output_tensor):
            if parallel_state.get_tensor_model_parallel_world_size() > 1:
                output_tensor = gather_from_tensor_model_parallel_region(output_tensor)
            return output_tensor.sum() * 0.0, {"logits": output_tensor.detach().clone()}

        return output, collect

    model.eval()
    with torch.no_grad():
        results = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter([input_ids]), model=[model],
            num_microbatches=1, seq_length=pipeline_seq_length(model, seq),
            micro_batch_size=batch, forward_only=True)
    return results[0]["logits"].float() if parallel_state.is_pipeline_last_stage() else None


def import_and_run(hf_dir: str, input_ids: torch.Tensor):
    """Build this rank's Megatron model from ``hf_dir``, load it rank-locally, return its logits
    (None on non-last pipeline stages) and the load report."""
    from megatron_slmoe.hf.convert import build_model_in_layout
    from megatron_slmoe.hf.loader import load_hf_weights, open_hf_checkpoint

    hf = open_hf_checkpoint(hf_dir, check_shapes=False)
    model, _ = build_model_in_layout(hf.model_config)
    report = load_hf_weights([model], hf_dir, hf)
    return megatron_logits(model, input_ids), report


# --- LoRA on the imported model ------------------------------------------------------------------


def import_with_lora(hf_dir: str, targets, rank: int = 4, alpha: float = 8.0, seed: int = 0):
    """(model, LoRAConfig): this rank's imported Megatron model with LoRA on ``targets``, every
    LoRA factor drawn at random (B too, so the adapter changes the logits), as after training."""
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.hf.convert import build_model_in_layout
    from megatron_slmoe.hf.loader import load_hf_weights, open_hf_checkpoint
    from megatron_slmoe.lora.inject import inject_lora

    hf = open_hf_checkpoint(hf_dir, check_shapes=False)
    model, _ = build_model_in_layout(hf.model_config)
    load_hf_weights([model], hf_dir, hf)
    lora_config = LoRAConfig(rank=rank, alpha=alpha, targets=list(targets))
    inject_lora([model], lora_config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if getattr(param, "is_lora", False):
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    return model, lora_config


def assert_same_tensors(expected_dir, actual_dir):
    """Every tensor of the safetensors files of two HF checkpoint directories, bitwise."""
    from safetensors import safe_open

    read = {}
    for name, directory in (("expected", expected_dir), ("actual", actual_dir)):
        read[name] = {}
        for file in sorted(os.listdir(directory)):
            if file.endswith(".safetensors"):
                with safe_open(os.path.join(directory, file), "pt") as f:
                    read[name].update({k: f.get_tensor(k) for k in f.keys()})
    assert read["actual"].keys() == read["expected"].keys()
    for key, tensor in read["expected"].items():
        assert torch.equal(read["actual"][key], tensor), key


# --- Kimi-K2.5: a MoonViT tower and projector in front of a DeepSeek-V3 language model ----------

KIMI_IMAGE_TOKEN = 60  # inside the tiny vocabulary; the processor's placeholder id


def kimi_config(text_overrides: dict | None = None, **overrides):
    """A tiny ``Kimi_K25Config``: the DeepSeek-V3 test model as its language model
    (``text_overrides`` change it), a 2-layer MoonViT (patch 14, 2x2 merge, an 8x8 position
    table so small images resample it)."""
    import transformers

    text = _config("deepseek_v3", **(text_overrides or {})).to_dict()
    vision = dict(patch_size=14, pos_emb_height=8, pos_emb_width=8, pos_emb_time=2,
                  num_attention_heads=2, num_hidden_layers=2, hidden_size=16,
                  intermediate_size=24)
    return transformers.Kimi_K25Config(**{**dict(
        text_config=text, vision_config=vision, projection_hidden_size=16,
        image_token_id=KIMI_IMAGE_TOKEN, video_token_id=61, vision_start_token_id=62,
        vision_end_token_id=63, tie_word_embeddings=False), **overrides})


def build_kimi(seed: int = 0, text_overrides: dict | None = None, **overrides):
    """The Kimi-K2.5 model with random weights at the scales ``build`` uses (fp32, eval)."""
    from transformers import Kimi_K25ForConditionalGeneration

    config = kimi_config(text_overrides, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Kimi_K25ForConditionalGeneration(config).float().eval()
    _randomise(model, seed)
    return model


def _randomise(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, tensor in model.named_parameters():
            noise = torch.randn(tensor.shape, generator=gen)
            if "norm" in pname:
                tensor.copy_(1.0 + 0.2 * noise)
            elif tensor.dim() == 1:  # biases, the score-correction bias
                tensor.copy_(0.2 * noise)
            elif "position_embeddings" in pname:
                tensor.copy_(0.5 * noise)
            else:
                fan_in = tensor[0].numel() if tensor.dim() > 1 else tensor.numel()
                tensor.copy_(noise / math.sqrt(fan_in))


def kimi_inputs(batch: int = 2, seed: int = 7) -> dict:
    """An image+text batch in the form Kimi-K2.5's image processor gives: images of different
    patch grids (one per row; 4x6 and 6x4 patches of 14x14), their patches flattened in raster
    order ``pixel_values`` [patches, 3, 14, 14] with ``image_grid_thw`` [images, 3]; each row
    ``text, one placeholder per merged 2x2 patch, text``, padded to one length with ordinary
    tokens. (The processor itself needs torchvision, whose wheels do not load with the CPU torch
    build here; the model's parity does not depend on where the pixels come from.)"""
    gen = torch.Generator().manual_seed(seed)
    grids = [(1, 4, 6), (1, 6, 4), (1, 4, 4)][:batch]
    grid = torch.tensor(grids)
    patches = int(sum(t * h * w for t, h, w in grids))
    pixel_values = torch.randn(patches, 3, 14, 14, generator=gen)
    rows = []
    for _, h, w in grids:
        text = torch.randint(0, KIMI_IMAGE_TOKEN, (6,), generator=gen)  # rows of 12: TP=2 divides
        rows.append(torch.cat([text[:2], torch.full((h * w // 4,), KIMI_IMAGE_TOKEN), text[2:]]))
    length = max(len(r) for r in rows)
    input_ids = torch.stack([torch.cat([r, torch.randint(0, KIMI_IMAGE_TOKEN, (length - len(r),),
                                                         generator=gen)]) for r in rows])
    return dict(input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=grid)


def kimi_hf_logits(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits.float()


def load_kimi(hf_dir: str):
    """(model, load report): this rank's Kimi-K2.5 built from ``hf_dir`` in the current layout
    (the run's builder), its weights read rank-locally."""
    from megatron_slmoe.hf.convert import build_model_in_layout
    from megatron_slmoe.hf.loader import load_hf_weights, open_hf_checkpoint
    from megatron_slmoe.hf.tower_model import hf_model_builder

    hf = open_hf_checkpoint(hf_dir, check_shapes=True)
    model, _ = build_model_in_layout(hf.model_config, build=hf_model_builder(hf))
    return model, load_hf_weights([model], hf_dir, hf)


def kimi_image_input(hf_dir: str, tokenizer):
    """The image input a run makes for the checkpoint in ``hf_dir`` (its processor settings)."""
    from megatron_slmoe.data.config import ImageTextConfig
    from megatron_slmoe.hf.loader import open_hf_checkpoint
    from megatron_slmoe.model.config import VisionConfig
    from megatron_slmoe.training.tasks.image_text import image_input

    return image_input(VisionConfig(), ImageTextConfig(),
                       open_hf_checkpoint(hf_dir, check_shapes=False), tokenizer)


def kimi_import_and_run(hf_dir: str, inputs: dict):
    """This rank's Kimi-K2.5 built from ``hf_dir`` in the current layout, loaded rank-locally;
    its logits on ``inputs`` (None on non-last pipeline stages) and the load report."""
    model, report = load_kimi(hf_dir)
    extra = {k: inputs[k] for k in ("pixel_values", "image_grid_thw")}
    return megatron_logits(model, inputs["input_ids"], **extra), report


# --- Qwen3-VL-MoE: a Qwen3-VL tower with DeepStack before a Qwen3-MoE language model ------------

QWEN3_VL_IMAGE_TOKEN = 60


def build_qwen3_vl_moe(seed: int = 0, image_token_id: int = QWEN3_VL_IMAGE_TOKEN, **text):
    """A tiny Qwen3VLMoeForConditionalGeneration: the Qwen3-MoE test model's sizes with
    interleaved M-RoPE (sections 2, 3, 3 of head_dim 16), a 2-layer tower with one DeepStack
    layer (fp32, eval, random weights); ``text`` overrides the language model's settings (the
    tower's output follows its ``hidden_size``)."""
    import transformers

    text_config = {**dict(
        # moe_intermediate_size 12: neither it nor twice it equals the width, so the fused
        # experts' layout (transformers' or the transposed published one) shows in the shape.
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=12,
        num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=16, num_experts=EXPERTS, num_experts_per_tok=TOPK, mlp_only_layers=[0],
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": [2, 3, 3], "mrope_interleaved": True}), **text}
    vision_config = dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2,
                         out_hidden_size=text_config["hidden_size"], patch_size=16,
                         spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0])
    config = transformers.Qwen3VLMoeConfig(text_config=text_config, vision_config=vision_config,
                                           image_token_id=image_token_id, video_token_id=61,
                                           vision_start_token_id=62, vision_end_token_id=63,
                                           tie_word_embeddings=False)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Qwen3VLMoeForConditionalGeneration(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            noise = torch.randn(tensor.shape, generator=gen)
            if "norm" in name:
                tensor.copy_(1.0 + 0.2 * noise)
            elif tensor.dim() == 1:
                tensor.copy_(0.2 * noise)
            else:
                tensor.copy_(noise / math.sqrt(tensor.shape[-1]))
    return model


def qwen3_vl_inputs(seed: int = 7) -> dict:
    """Two rows, each text, one image's placeholders (one per merged 2x2 patch), text; pixels
    as Qwen's processor flattens them [patches, 3 * 2 * 16 * 16]."""
    gen = torch.Generator().manual_seed(seed)
    grids = [(1, 4, 6), (1, 6, 4)]
    patches = sum(t * h * w for t, h, w in grids)
    rows = []
    for _, h, w in grids:
        text = torch.randint(0, QWEN3_VL_IMAGE_TOKEN, (6,), generator=gen)
        image = torch.full((h * w // 4,), QWEN3_VL_IMAGE_TOKEN)
        rows.append(torch.cat([text[:2], image, text[2:]]))
    return dict(input_ids=torch.stack(rows), image_grid_thw=torch.tensor(grids),
                pixel_values=torch.randn(patches, 3 * 2 * 16 * 16, generator=gen))


def randomise_lora(model, seed: int = 0, scale: float = 0.3) -> None:
    """Every LoRA factor of ``model`` random (``scale`` N(0, 1)), as after training."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if getattr(param, "is_lora", False):
                param.copy_(scale * torch.randn(param.shape, generator=gen))


def imported_lora_model(hf_dir: str, lora_config, seed: int = 0):
    """Our one-rank model of the HF checkpoint ``hf_dir`` with its weights, and ``lora_config``'s
    LoRA (if given) random as after training."""
    from megatron_slmoe.hf.convert import build_model_in_layout
    from megatron_slmoe.hf.loader import load_hf_weights, open_hf_checkpoint
    from megatron_slmoe.lora.inject import inject_lora

    hf = open_hf_checkpoint(hf_dir, check_shapes=False)
    model, _ = build_model_in_layout(hf.model_config)
    load_hf_weights([model], hf_dir, hf)
    if lora_config is not None:
        inject_lora([model], lora_config)
        randomise_lora(model, seed)
    return model


# --- quantised experts, as compressed-tensors writes them ----------------------------------------

_EXPERT_WEIGHT = re.compile(r".*\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def pack_experts_int4(directory: str, reference_dir: str, group_size: int = 32) -> int:
    """Rewrite the routed experts of the checkpoint in ``directory`` (one ``model.safetensors``
    with per-expert keys) as Kimi-K2.5 ships them: compressed-tensors' ``pack-quantized`` INT4
    (``weight_packed`` int32, ``weight_scale`` bf16 per ``group_size`` inputs, ``weight_shape``),
    made by its own observer and compressor. ``reference_dir`` gets the same checkpoint with
    compressed-tensors' decompression of those bytes in place of the experts (what the packed
    checkpoint means, for transformers to load). Returns how many weights were packed."""
    import shutil

    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size))
    shutil.copytree(directory, reference_dir)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    packed, decoded = {}, dict(tensors)
    for key, weight in tensors.items():
        if not _EXPERT_WEIGHT.match(key):
            packed[key] = weight
            continue
        weight = weight.to(torch.bfloat16)
        groups = weight.unflatten(-1, (-1, group_size))
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        compressed = PackedQuantizationCompressor.compress(
            {"weight": weight, "weight_scale": scale, "weight_zero_point": zero}, scheme)
        stem = key[:-len("weight")]
        packed.update({stem + name: tensor for name, tensor in compressed.items()})
        decoded[key] = PackedQuantizationCompressor.decompress(compressed, scheme)["weight"].float()
    save_file(packed, path, metadata={"format": "pt"})
    save_file(decoded, os.path.join(reference_dir, "model.safetensors"), metadata={"format": "pt"})
    return sum(1 for key in tensors if _EXPERT_WEIGHT.match(key))


# --- Kimi K3: the release layout of the plain reference (tests/helpers/kimi_k3_reference.py) ------


K3_VISION_CONFIG = dict(vt_hidden_size=16, vt_num_hidden_layers=2, vt_num_attention_heads=2,
                        qkv_hidden_size=24, vt_intermediate_size=32, init_pos_emb_height=8,
                        init_pos_emb_width=8, init_pos_emb_time=4, patch_size=14,
                        merge_kernel_size=[2, 2], merge_type="sd2_tpool",
                        mm_projector_type="patchmergerv2", norm_type="rmsnorm",
                        pos_emb_interpolation_mode="bilinear")
"""A tiny K3 tower (MoonViT3D and its projector) as a release's ``vision_config`` writes it."""


def randomise_tower(module, seed: int = 0):
    """Every weight of a tower random at its fan-in's scale, norms near 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                fan_in = param[0].numel() if param.dim() > 1 else 1
                param.copy_(noise / fan_in ** 0.5)
    return module


def k3_tower(text_model, seed=5):
    """(tower, its MoonViT3DConfig): ``K3_VISION_CONFIG``'s tower for ``text_model``'s width,
    random (``seed``; None: as built)."""
    from megatron_slmoe.families.kimi_k3.vision import KimiK3Vision, MoonViT3DConfig

    config = MoonViT3DConfig.from_vision_config(
        {**K3_VISION_CONFIG, "text_hidden_size": text_model.config.hidden_size}, ValueError)
    tower = KimiK3Vision(config)
    return (tower if seed is None else randomise_tower(tower, seed)), config


def save_kimi_k3(model, directory, vision=None, vision_config: dict | None = None,
                 image_token_id: int = 100) -> str:
    """``model`` (a ``KimiK3Reference``) as the release stores it, in ``directory``: experts MXFP4
    (round them first with ``round_experts_to_mxfp4_`` for an exact checkpoint), fp32 tensors
    fp32, A_log padded, the release's config.json; with ``vision`` (a ``KimiK3Vision``) its tower
    and projector at the top level, ``vision_config`` and the placeholder id in config.json."""
    import json

    from safetensors.torch import save_file

    from tests.helpers import kimi_k3_reference as k3ref

    os.makedirs(directory, exist_ok=True)
    state = {k: v.contiguous() for k, v in k3ref.release_state_dict(model).items()}
    config = k3ref.release_config(model.config)
    if vision is not None:
        state.update({k: v.detach().contiguous() for k, v in vision.state_dict().items()})
        config.update(vision_config=vision_config, media_placeholder_token_id=image_token_id)
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return str(directory)
