"""Kimi K3 at full scale (issue 40 item 6): the packaged model file ``kimi-k3`` is what the K3
family reads from the release's config.json (written here from KIMI_K3.md's fields);
``slmoe-count-params --model-config kimi-k3`` builds it on the meta device and counts the release
tensor table's 2,779,484,476,000 text parameters (the table summed here, tensor by tensor); the
planner's pure-config census equals it; the planner prices K3's blocks."""

import json

import pytest

H, P, L, I, V = 7168, 12288, 3584, 3072, 163840
LAYERS, MLA_LAYERS = 93, [*range(4, 93, 4), 93]  # 1-based, as linear_attn_config gives them
KDA_LAYERS = [i for i in range(1, LAYERS + 1) if i not in MLA_LAYERS]


def release_config() -> dict:
    """The release's config.json (KIMI_K3.md, "config.json (raw file)"), without the vision
    config, the quantization config and auto_map (the text import reads neither)."""
    text = {
        "model_type": "kimi_linear", "hidden_size": H, "num_hidden_layers": LAYERS,
        "vocab_size": V, "intermediate_size": 33792, "rms_norm_eps": 1e-5, "hidden_act": "situ",
        "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 12,
        "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "mla_use_nope": True, "mla_use_output_gate": True,
        "linear_attn_config": {"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                               "full_attn_layers": MLA_LAYERS, "kda_layers": KDA_LAYERS},
        "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
        "moe_intermediate_size": I, "routed_expert_hidden_size": L, "latent_moe_use_norm": True,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True, "routed_scaling_factor": 1.0, "topk_method": "noaux_tc",
        "num_expert_group": 1, "topk_group": 1,
    }
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
            "media_placeholder_token_id": 163605, "tie_word_embeddings": False,
            "dtype": "bfloat16", "text_config": text}


def tensor_table() -> dict[str, int]:
    """Parameters of the release's text tensors (KIMI_K3.md, "Tensors"), by the census's
    categories; A_log counted at the 96 heads used (its 32 zero pads are storage)."""
    kda, mla, moe = len(KDA_LAYERS), len(MLA_LAYERS), LAYERS - 1
    return {
        "embedding": V * H, "output_layer": V * H,
        "norms": H + LAYERS * 2 * H + kda * 128 + mla * (1536 + 512),  # + o_norm, q/kv_a norms
        "attention_residuals": 2 * H + LAYERS * 4 * H,  # output mix, two mixes per layer
        "attention": LAYERS * (P * H + H * P)  # g_proj, o_proj on every layer
        + kda * (3 * P * H + 3 * P * 4 + 128 * H + P * 128 + 96 + P + 96 * H)
        + mla * (1536 * H + 96 * 192 * 1536 + 576 * H + 96 * 256 * 512),
        "dense_mlp": 2 * 33792 * H + H * 33792,
        "router": moe * 896 * H, "router_bias": moe * 896,
        "latent": moe * (L * H + H * L + L),
        "shared_experts": moe * (2 * 6144 * H + H * 6144),
        "routed_experts": moe * 896 * (2 * I * L + L * I),
    }


def test_model_file_is_what_the_family_reads_from_the_release_config(tmp_path):
    from megatron_slmoe.families import family_for
    from megatron_slmoe.model.model_file import load_model_config

    path = tmp_path / "Kimi-K3" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(release_config()))
    config = json.loads(path.read_text())
    family = family_for(config, str(path))
    assert family.name == "kimi_k3"
    read = family.model_config(config, str(path))
    packaged = load_model_config("kimi-k3")
    assert dict(packaged.transformer) == dict(read.transformer)
    assert packaged.blocks == read.blocks and packaged.slmoe == read.slmoe
    assert packaged.gpt_kwargs() == read.gpt_kwargs()
    assert packaged.fingerprint == read.fingerprint
    assert [i + 1 for i in packaged.blocks.kda_layers] == KDA_LAYERS
    # The check can fail: one field changed in the release config changes the reading.
    config["text_config"]["linear_attn_config"]["gate_lower_bound"] = -4.0
    assert family.model_config(config, str(path)).blocks != packaged.blocks


@pytest.fixture(scope="module")
def counted(megatron_single_rank):
    """``slmoe-count-params --model-config kimi-k3 --json``, run as the command runs."""
    import contextlib
    import io

    from megatron_slmoe.commands.count_params import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--model-config", "kimi-k3", "--json"]) == 0
    return json.loads(out.getvalue())


def test_count_params_counts_the_release_tensor_table(counted):
    table = tensor_table()
    assert sum(table.values()) == 2_779_484_476_000
    assert counted["breakdown"] == table
    assert counted["total_params"] == 2_779_484_476_000
    assert (counted["num_layers"], counted["num_moe_layers"]) == (93, 92)
    # Active per token: all but 880 of 896 experts' weights in each MoE layer.
    inactive = 92 * (896 - 16) * (2 * I * L + L * I)
    assert counted["active_params_per_token"] == counted["total_params"] - inactive


def test_planner_census_equals_the_built_model(counted):
    from megatron_slmoe.plan import census, load_shape

    planned = census(load_shape("kimi-k3"))
    assert planned == {k: counted[k] for k in planned}


def test_planner_prices_kda_state_and_the_attention_residual_stream():
    """Hand counts of what the planner adds for K3's blocks, at TP=2, one micro-batch of 256."""
    from megatron_slmoe.plan import RunSettings, load_shape
    from megatron_slmoe.plan import memory

    shape = load_shape("kimi-k3")
    assert shape.stream_slots == 9 and sum(shape.kda_layers) == 69 and shape.gated_mla
    s = RunSettings(tp=2, ep=8, dp=4, seq_length=256, global_batch_size=8, lora_rank=8,
                    lora_targets=("linear_qkv", "linear_proj"))
    # The chunk states: 4 chunks x 48 heads x 128 x 128 fp32.
    assert memory.kda_chunk_states(shape, s) == 4 * 48 * 128 * 128 * 4
    # Generation: per KDA layer the state [96, 128, 128] and 3 conv tails of 3 x 12288, fp32.
    assert memory.kda_generation_state(shape) == 69 * (96 * 128 * 128 + 3 * 3 * P) * 4
    t = memory._tokens(shape, s)
    # Layer 13: one bank vector per finished block (0, 12) and the embedding... enter it
    # (1 + ceil(13 / 12) = 3 slots in the stream); its mixes see 2 + 1 and 2 + 1 candidates.
    stream = memory._attention_residuals(shape, s, t, 13)
    assert stream == (3 * H * 2 + 6 * (H + 1) * 4) * 128
    # Layer 12 starts a block: the MLP mix also sees the vector the block just banked.
    assert memory._attention_residuals(shape, s, t, 12) == (2 * H * 2 + 5 * (H + 1) * 4) * 128
    # A KDA layer keeps no S^2 scores: it is cheaper than an MLA layer at 64k tokens.
    long = s.replace(seq_length=65536, global_batch_size=8)
    lt = memory._tokens(shape, long)
    assert memory._kda_attention(shape, long, lt, True) < memory._mla_attention(
        shape, long, lt, True)


def test_smallest_64gb_cluster_takes_a_pipeline_of_three():
    """93 layers split only into 3 or 31 stages and 896 experts into 7 x 2^k shares: on 64 GB
    devices no power-of-two cluster fits K3 (PP 1 holds every layer's replicated latent and
    router weights), so the smallest cluster the planner names is a multiple of 3 devices."""
    from megatron_slmoe.plan import DEVICES, evaluate, load_shape
    from megatron_slmoe.plan.planner import PlanOptions, smallest_cluster

    shape = load_shape("kimi-k3")
    options = PlanOptions()
    size, verdict = smallest_cluster(shape, DEVICES["910b"], 256, options)
    assert size == 384 and verdict.settings.pp == 3 and verdict.fits
    assert evaluate(shape, verdict.settings, DEVICES["910b"]).peak_bytes <= 64 * 2**30


def test_planner_lora_parameters_and_census_of_a_tiny_k3_equal_the_built_model(
        megatron_single_rank, tmp_path):
    """The tiny K3 (13 layers, KDA and gated MLA, AttnRes, latent MoE) as the family reads it:
    the planner's census and its LoRA parameters on every target equal the built, adapted model's
    (KDA's q/k/v/g/b/f_b column-parallel and f_a whole, MLA's output gate, o_proj)."""
    from megatron_slmoe.families import family_for
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.inject import inject_lora
    from megatron_slmoe.model.build import build_gpt_model
    from megatron_slmoe.model.census import count_parameters
    from megatron_slmoe.model.model_file import dump_model_config, load_model_config
    from megatron_slmoe.plan import RunSettings, census, estimate_memory, load_shape
    from tests.helpers import kimi_k3_reference as k3ref
    from tests.unit.test_plan import CPU, TINY_FP32

    config = k3ref.release_config(k3ref.tiny_config())
    path = tmp_path / "k3-tiny.yaml"
    path.write_text(dump_model_config(family_for(config, "config.json").model_config(
        config, "config.json")))
    mc = load_model_config(path)
    assert census(load_shape(path)) == count_parameters(mc)
    targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "shared_experts",
               "router", "latent"]
    model = build_gpt_model(mc, mc.transformer_config(use_cpu_initialization=True))
    inject_lora([model], LoRAConfig(rank=4, targets=targets))
    adapted = sum(p.numel() for p in model.parameters() if p.requires_grad)
    settings = RunSettings(lora_rank=4, lora_targets=tuple(targets), **TINY_FP32)
    assert estimate_memory(load_shape(path), settings, CPU).stages[0].trainable_params == adapted
