"""HF import on one rank: for every family and both expert layouts, the imported Megatron model's
logits equal transformers' on a tiny random checkpoint (fp32); block-scaled FP8 against the fp32
reference of the same weights; DeepSeek variants (no q LoRA, yarn RoPE), tied embeddings, pre-softmax
routing, non-gated squared-ReLU experts; the mapping pieces invert (export reads what import
wrote); a rank's reads touch only the slices it needs."""

import os

import pytest
import torch

from tests.helpers import hf_models

pytestmark = pytest.mark.usefixtures("megatron_single_rank")


def _check(hf_dir, reference_model):
    input_ids = hf_models.tokens()
    logits, report = hf_models.import_and_run(hf_dir, input_ids)
    torch.testing.assert_close(logits, hf_models.hf_logits(reference_model, input_ids),
                               rtol=1e-5, atol=1e-5)
    return report


@pytest.mark.parametrize("layout", ["original", "fused"])
@pytest.mark.parametrize("family", hf_models.FAMILY_NAMES)
def test_import_matches_transformers(tmp_path, family, layout):
    model = hf_models.save_family(family, str(tmp_path), layout=layout)
    _check(str(tmp_path), model)


@pytest.mark.parametrize("family, overrides", [
    ("deepseek_v3", dict(q_lora_rank=None)),
    ("deepseek_v3", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0})),
    ("qwen3_moe", dict(tie_word_embeddings=True)),
    ("nemotron_h", dict(n_shared_experts=0)),  # transformers builds the shared expert anyway
    ("qwen3_moe", dict(norm_topk_prob=False)),
    ("stable_latent_moe", dict(hidden_act="relu2", mlp_gated=False, router_expert_bias=False,
                               router_score_function="softmax", router_num_groups=None,
                               router_group_topk=None, qk_layernorm=False)),
], ids=["deepseek-no-q-lora", "deepseek-yarn", "qwen-tied", "nemotron-n-shared-0",
        "qwen-pre-softmax",
        "slmoe-relu2-softmax"])
def test_variants_match_transformers(tmp_path, family, overrides):
    model = hf_models.save_family(family, str(tmp_path), **overrides)
    _check(str(tmp_path), model)


def test_nemotron_h_without_n_shared_experts_keeps_its_shared_expert(tmp_path):
    """config.json without the key: transformers' default (1) and its shared expert."""
    import json

    model = hf_models.save_family("nemotron_h", str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("n_shared_experts", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    _check(str(tmp_path), model)


def test_kimi_k2_config_maps_as_deepseek_v3(tmp_path):
    """Kimi-K2 ships DeepseekV3ForCausalLM weights with its own model_type, remote-code auto_map
    and no group limit; config.json is read as it is."""
    import json

    model = hf_models.save_family("deepseek_v3", str(tmp_path), n_group=1, topk_group=1)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="kimi_k2", scoring_func="sigmoid", topk_method="noaux_tc",
                  auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    from megatron_slmoe.hf import open_hf_checkpoint

    assert open_hf_checkpoint(str(tmp_path)).family.name == "deepseek_v3"
    _check(str(tmp_path), model)


def test_block_fp8_matches_fp32_reference_of_the_same_weights(tmp_path):
    model = hf_models.build("deepseek_v3")
    reference = hf_models.save_fp8(model, str(tmp_path / "fp8"), block=(16, 16))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "pt") as f:
        fp8 = [k for k in f.keys() if f.get_slice(k).get_dtype() == "F8_E4M3"]
    assert len(fp8) > 10  # the projections really are FP8 on disk
    _check(str(tmp_path / "fp8"), reference)
    # The FP8 rounding matters: the original fp32 weights give visibly different logits.
    input_ids = hf_models.tokens()
    assert (hf_models.hf_logits(model, input_ids)
            - hf_models.hf_logits(reference, input_ids)).abs().max() > 1e-3


def test_sharded_checkpoint_with_index(tmp_path):
    model = hf_models.build("qwen3_moe")
    model.save_pretrained(str(tmp_path), max_shard_size="20KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 3
    _check(str(tmp_path), model)


# --- mapping pieces, both directions ---------------------------------------------------------------


def _shard_boxes(shape, tp):
    """TP shards of dim 0, as Megatron's column-parallel linears hold them."""
    rows = shape[0] // tp
    return [((r * rows, (r + 1) * rows), *((0, n) for n in shape[1:])) for r in range(tp)]


@pytest.mark.parametrize("kind_name", ["qkv", "stack", "experts"])
def test_pieces_export_what_they_import(kind_name):
    """Filling TP shards from HF tensors and writing them back gives the HF tensors bitwise, and
    the Megatron tensor has the layout Megatron documents (q heads of a group, then k, then v)."""
    from megatron_slmoe.families.kinds import Direct, GroupedQKV, PerExpert, Stack

    gen = torch.Generator().manual_seed(0)
    if kind_name == "qkv":
        kind, shape = GroupedQKV("q", "k", "v", heads=4, groups=2, head_dim=3), (24, 5)
        hf = {"q": torch.randn(12, 5, generator=gen), "k": torch.randn(6, 5, generator=gen),
              "v": torch.randn(6, 5, generator=gen)}
        q, k, v = (hf[n].view(-1, 3, 5) for n in "qkv")
        expected = torch.cat([torch.cat([q[2 * g:2 * g + 2].reshape(-1, 5), k[g], v[g]])
                              for g in range(2)])
    elif kind_name == "stack":
        kind, shape = Stack("gate", "up"), (8, 3)
        hf = {"gate": torch.randn(4, 3, generator=gen), "up": torch.randn(4, 3, generator=gen)}
        expected = torch.cat([hf["gate"], hf["up"]])
    else:
        kind, shape = PerExpert(Direct("e{expert}")), (4, 2, 3)
        hf = {f"e{e}": torch.randn(2, 3, generator=gen) for e in range(4)}
        expected = torch.stack([hf[f"e{e}"] for e in range(4)])
    pieces = kind.pieces(shape, {})
    boxes = _shard_boxes(shape, 2)
    shards = [torch.zeros([b - a for a, b in box]) for box in boxes]
    for box, shard in zip(boxes, shards):
        for piece in pieces:
            overlap = piece.within(box)
            if overlap is not None:
                overlap.to_megatron(hf[piece.hf_key][overlap.hf_index], shard)
    torch.testing.assert_close(torch.cat(shards), expected, rtol=0, atol=0)
    exported = {name: torch.full_like(t, float("nan")) for name, t in hf.items()}
    for box, shard in zip(boxes, shards):
        for piece in pieces:
            overlap = piece.within(box)
            if overlap is not None:
                exported[piece.hf_key][overlap.hf_index] = overlap.to_hf(shard)
    for name in hf:
        assert torch.equal(exported[name], hf[name]), name


def test_fp8_slices_at_any_offset_dequantise_like_the_whole(tmp_path):
    """TP and EP shards read FP8 weights at offsets that are not block-aligned."""
    import json

    from safetensors.torch import save_file

    from megatron_slmoe.hf.checkpoint import HFCheckpoint, SliceReader

    weight = torch.randn(40, 56, generator=torch.Generator().manual_seed(3))
    values, scale, reference = hf_models.quantize_block_fp8(weight, (16, 16))
    save_file({"w.weight": values, "w.weight_scale_inv": scale},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [16, 16]}}))
    with SliceReader(HFCheckpoint.open(tmp_path)) as reader:
        for rows, cols in ((slice(0, 40), slice(0, 56)), (slice(5, 37), slice(9, 50)),
                           (slice(17, 18), slice(31, 33))):
            torch.testing.assert_close(reader.read("w.weight", (rows, cols)),
                                       reference[rows, cols], rtol=0, atol=0)
