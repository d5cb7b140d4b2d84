"""Model configs: the packaged YAML files load, every invalid combination is one ConfigError line
naming the Megatron flag, and the tiny config builds a GPTModel that runs forward and backward."""

import math
import textwrap

import pytest
import torch
import torch.nn.functional as F

from megatron_slmoe.platform import current as current_platform
from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.model.build import build_gpt_model
from megatron_slmoe.model.model_file import (
    ModelConfig,
    dump_model_config,
    load_model_config,
    packaged_configs,
)
from megatron_slmoe.model.validation import flag, validate_moe_config
from megatron_slmoe.moe.config import SLMoEConfig


def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message and message.strip() == message and message
    return message


def _write(tmp_path, text: str, name: str = "model.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# --- packaged configs ------------------------------------------------------------------------


def test_packaged_configs_are_shipped():
    assert {"tiny", "flagship_2p8t"} <= set(packaged_configs())


@pytest.mark.parametrize("name", ["tiny", "flagship_2p8t"])
def test_packaged_config_loads(name):
    mc = load_model_config(name)
    assert isinstance(mc, ModelConfig) and mc.name == name
    assert isinstance(mc.slmoe, SLMoEConfig)
    t = mc.transformer
    assert t["moe_router_score_function"] == "sigmoid" and t["moe_router_enable_expert_bias"]
    assert 1 <= t["moe_latent_size"] < t["hidden_size"]
    assert t["moe_shared_expert_intermediate_size"] > 0
    assert t["num_query_groups"] < t["num_attention_heads"]  # GQA
    assert t["normalization"] == "RMSNorm" and t["gated_linear_unit"]
    assert mc.position_embedding_type == "rope"
    with pytest.raises(TypeError):
        t["num_layers"] = 1  # read-only


def test_tiny_config_is_what_the_tests_and_demo_expect():
    mc = load_model_config("tiny")
    t = mc.transformer
    assert 2 <= t["num_layers"] <= 4
    assert (t["hidden_size"], t["moe_latent_size"], t["moe_ffn_hidden_size"]) == (64, 32, 32)
    assert (t["num_moe_experts"], t["moe_router_topk"]) == (8, 2)
    assert t["moe_router_load_balancing_type"] == "seq_aux_loss"
    assert (mc.vocab_size, mc.max_sequence_length) == (512, 128)
    assert t["num_layers"] % 2 == 0  # the PP=2 tests split it in two stages


def test_flagship_routing():
    t = load_model_config("flagship_2p8t").transformer
    assert (t["num_moe_experts"], t["moe_router_topk"]) == (896, 16)
    assert (t["moe_router_num_groups"], t["moe_router_group_topk"]) == (8, 4)
    assert 160_000 <= load_model_config("flagship_2p8t").vocab_size <= 200_000


def test_flagship_takes_a_production_layout():
    config = load_model_config("flagship_2p8t").transformer_config(
        tensor_model_parallel_size=8, sequence_parallel=True, expert_model_parallel_size=64,
        pipeline_model_parallel_size=8, bf16=True, perform_initialization=False)
    assert config.params_dtype == torch.bfloat16 and config.pipeline_dtype == torch.bfloat16
    assert config.expert_tensor_parallel_size == 1
    assert config.activation_func is F.silu and not config.add_bias_linear
    assert config.moe_layer_freq[0] == 0 and all(config.moe_layer_freq[1:])


# --- the flag map ------------------------------------------------------------------------------


@pytest.mark.parametrize("field,expected", [
    ("num_moe_experts", "--num-experts"),
    ("moe_router_topk", "--moe-router-topk"),
    ("moe_latent_size", "--moe-latent-size"),
    ("layernorm_epsilon", "--norm-epsilon"),  # Megatron's own argparse name
    ("gated_linear_unit", "--swiglu"),
])
def test_flag_spelling(field, expected):
    assert flag(field) == expected


# --- invalid combinations ------------------------------------------------------------------------


def _tiny_fields() -> dict:
    return dict(load_model_config("tiny").transformer)


GROUPS = dict(moe_router_num_groups=4, moe_router_group_topk=2)  # 4 groups of 2 experts
SOFTMAX = dict(moe_router_score_function="softmax", moe_router_enable_expert_bias=False)

INVALID = [
    # (id, field changes (None deletes), parallel sizes, flag the message must name)
    ("topk-above-experts", dict(moe_router_topk=9), {}, "--moe-router-topk"),
    ("topk-zero", dict(moe_router_topk=0), {}, "--moe-router-topk"),
    ("topk-not-int", dict(moe_router_topk="2"), {}, "--moe-router-topk"),
    ("experts-zero", dict(num_moe_experts=0), {}, "--num-experts"),
    ("latent-equals-hidden", dict(moe_latent_size=64), {}, "--moe-latent-size"),
    ("latent-above-hidden", dict(moe_latent_size=128), {}, "--moe-latent-size"),
    ("latent-zero", dict(moe_latent_size=0), {}, "--moe-latent-size"),
    ("experts-vs-ep", {}, dict(expert_parallel=3), "--expert-model-parallel-size"),
    ("expert-tp", {}, dict(expert_tensor_parallel=2), "--expert-tensor-parallel-size"),
    ("groups-without-group-topk", dict(moe_router_num_groups=4), {}, "--moe-router-group-topk"),
    ("group-topk-without-groups", dict(moe_router_group_topk=2), {}, "--moe-router-num-groups"),
    ("experts-vs-groups", dict(moe_router_num_groups=3, moe_router_group_topk=1), {},
     "--moe-router-num-groups"),
    ("group-topk-above-groups", dict(moe_router_num_groups=2, moe_router_group_topk=4,
                                     moe_router_topk=4), {}, "--moe-router-group-topk"),
    ("topk-above-reachable", dict(GROUPS, moe_router_topk=5), {}, "--moe-router-topk"),
    ("group-topk-above-topk", dict(moe_router_num_groups=4, moe_router_group_topk=3), {},
     "--moe-router-group-topk"),
    ("expert-bias-with-softmax", dict(moe_router_score_function="softmax"), {},
     "--moe-router-enable-expert-bias"),
    ("pre-softmax-with-sigmoid", dict(moe_router_pre_softmax=True), {},
     "--moe-router-pre-softmax"),
    ("topk-1-softmax", dict(SOFTMAX, moe_router_topk=1), {}, "--moe-router-pre-softmax"),
    ("unknown-score-function", dict(moe_router_score_function="relu"), {},
     "--moe-router-score-function"),
    ("coeffs-shorter-than-types", dict(moe_router_load_balancing_type=["seq_aux_loss", "aux_loss"],
                                       moe_aux_loss_coeff=[1e-3]), {}, "--moe-aux-loss-coeff"),
    ("coeff-list-for-one-type", dict(moe_aux_loss_coeff=[1e-3, 1e-3]), {}, "--moe-aux-loss-coeff"),
    ("unknown-load-balancing", dict(moe_router_load_balancing_type="switch"), {},
     "--moe-router-load-balancing-type"),
    ("unknown-load-balancing-in-list", dict(moe_router_load_balancing_type=["aux_loss", "x"],
                                            moe_aux_loss_coeff=[0.1, 0.1]), {},
     "--moe-router-load-balancing-type"),
    ("negative-aux-coeff", dict(moe_aux_loss_coeff=-1e-3), {}, "--moe-aux-loss-coeff"),
    ("negative-aux-coeff-in-list", dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                                        moe_aux_loss_coeff=[1e-3, -1e-3]), {},
     "--moe-aux-loss-coeff"),
    ("sinkhorn-with-aux-coeff", dict(moe_router_load_balancing_type="sinkhorn"), {},
     "--moe-aux-loss-coeff"),
    ("negative-z-loss", dict(moe_z_loss_coeff=-1.0), {}, "--moe-z-loss-coeff"),
    ("scaling-factor-zero", dict(moe_router_topk_scaling_factor=0.0), {},
     "--moe-router-topk-scaling-factor"),
    ("scaling-factor-negative", dict(moe_router_topk_scaling_factor=-2.5), {},
     "--moe-router-topk-scaling-factor"),
    ("negative-bias-update-rate", dict(moe_router_bias_update_rate=-1e-3), {},
     "--moe-router-bias-update-rate"),
    ("router-dtype", dict(moe_router_dtype="bf16"), {}, "--moe-router-dtype"),
    ("moe-ffn-missing", dict(moe_ffn_hidden_size=None), {}, "--moe-ffn-hidden-size"),
    ("moe-ffn-zero", dict(moe_ffn_hidden_size=0), {}, "--moe-ffn-hidden-size"),
    ("layers-vs-pp", {}, dict(pipeline_parallel=3), "--pipeline-model-parallel-size"),
    ("tp-without-sp", {}, dict(tensor_parallel=2), "--sequence-parallel"),
    ("shared-expert-zero", dict(moe_shared_expert_intermediate_size=0), {},
     "--moe-shared-expert-intermediate-size"),
    ("layer-freq-length", dict(moe_layer_freq=[0, 1]), {}, "--moe-layer-freq"),
    ("layer-freq-all-dense", dict(moe_layer_freq=[0, 0, 0]), {}, "--moe-layer-freq"),
    ("layer-freq-zero", dict(moe_layer_freq=0), {}, "--moe-layer-freq"),
]


@pytest.mark.parametrize("changes,parallel,expected_flag", [c[1:] for c in INVALID],
                         ids=[c[0] for c in INVALID])
def test_invalid_combination_names_the_flag(changes, parallel, expected_flag):
    fields = _tiny_fields()
    for name, value in changes.items():
        if value is None:
            fields.pop(name, None)
        else:
            fields[name] = value
    with pytest.raises(ConfigError) as err:
        validate_moe_config(fields, **parallel)
    assert expected_flag in _one_line(err)


def test_valid_group_limited_routing_passes():
    validate_moe_config({**_tiny_fields(), **GROUPS, "moe_router_topk": 4})


@pytest.mark.parametrize("overrides,expected_flag", [
    (dict(tensor_model_parallel_size=2), "--sequence-parallel"),
    (dict(expert_tensor_parallel_size=2), "--expert-tensor-parallel-size"),
    (dict(expert_model_parallel_size=3), "--expert-model-parallel-size"),
    (dict(pipeline_model_parallel_size=3), "--pipeline-model-parallel-size"),
    (dict(moe_router_topk=9), "--moe-router-topk"),
    (dict(no_such_field=1), "--no-such-field"),
])
def test_transformer_config_overrides_are_validated(overrides, expected_flag):
    with pytest.raises(ConfigError) as err:
        load_model_config("tiny").transformer_config(**overrides)
    assert expected_flag in _one_line(err)


def test_megatron_own_errors_become_one_line_config_errors():
    # 4 attention heads cannot be split over 3 tensor-parallel ranks: Megatron's own check.
    with pytest.raises(ConfigError) as err:
        load_model_config("tiny").transformer_config(tensor_model_parallel_size=3,
                                                     sequence_parallel=True)
    assert _one_line(err).startswith("--num-attention-heads")


# --- bad files -----------------------------------------------------------------------------------


def _tiny_yaml(drop=(), **model_changes) -> str:
    import yaml

    mc = load_model_config("tiny")
    model = {**dict(mc.transformer), **mc.gpt_kwargs(), **model_changes}
    for name in drop:
        del model[name]
    return yaml.safe_dump({"model": model, "slmoe": {"dispatcher": "allgather"}})


def test_a_file_path_loads(tmp_path):
    path = _write(tmp_path, _tiny_yaml(), "mine.yaml")
    mc = load_model_config(path)
    assert mc.name == "mine" and mc.source == str(path)
    assert dict(mc.transformer) == dict(load_model_config("tiny").transformer)
    assert mc.slmoe.dispatcher == "allgather"


def test_unknown_key_names_key_and_file(tmp_path):
    path = _write(tmp_path, _tiny_yaml(moe_router_topkk=2))
    with pytest.raises(ConfigError) as err:
        load_model_config(path)
    message = _one_line(err)
    assert "moe_router_topkk" in message and str(path) in message


@pytest.mark.parametrize("text,expected", [
    ("model: {num_layers: 2}\nextra: {}\n", "'extra'"),
    ("slmoe: {}\n", "'model' section is missing"),
    ("- a\n- b\n", "mapping"),
    ("model:\n  num_layers: [1\n", "invalid YAML at line"),
    ("model:\n  num_layers: 2\n  num_layers: 3\n", "given twice"),
])
def test_malformed_file(tmp_path, text, expected):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_model_config(path)
    message = _one_line(err)
    assert expected in message and str(path) in message


@pytest.mark.parametrize("changes,expected", [
    (dict(tensor_model_parallel_size=2), "run setting"),
    (dict(num_layers="three"), "--num-layers"),
    (dict(hidden_dropout="0.1"), "model.hidden_dropout"),
    (dict(attention_backend="flash"), "cannot be set in a model file"),
    (dict(activation_func="relu6"), "model.activation_func must be one of silu, squared_relu"),
    (dict(moe_router_topk=9), "--moe-router-topk"),
])
def test_bad_model_field(tmp_path, changes, expected):
    path = _write(tmp_path, _tiny_yaml(**changes))
    with pytest.raises(ConfigError) as err:
        load_model_config(path)
    message = _one_line(err)
    assert expected in message and str(path) in message


def test_missing_gpt_field(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_model_config(_write(tmp_path, _tiny_yaml(drop=["vocab_size"])))
    assert "vocab_size" in _one_line(err)


@pytest.mark.parametrize("slmoe,expected", [
    ("{dispatcher: carrier_pigeon}", "carrier_pigeon"),
    ("{freeze_routr: true}", "slmoe.freeze_routr"),
    ("{freeze_router: 1}", "slmoe.freeze_router"),
])
def test_bad_slmoe_section(tmp_path, slmoe, expected):
    text = _tiny_yaml().split("slmoe:")[0] + f"slmoe: {slmoe}\n"
    with pytest.raises(ConfigError) as err:
        load_model_config(_write(tmp_path, text))
    assert expected in _one_line(err)


def test_missing_file_and_unknown_name(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_model_config(tmp_path / "absent.yaml")
    assert "absent.yaml" in _one_line(err)
    with pytest.raises(ConfigError) as err:
        load_model_config("no_such_model")
    assert "no_such_model" in _one_line(err) and "tiny" in str(err.value)


@pytest.mark.parametrize("name", ["tiny", "flagship_2p8t"])
def test_dump_reads_back_as_the_same_config(tmp_path, name):
    mc = load_model_config(name)
    again = load_model_config(_write(tmp_path, dump_model_config(mc), f"{name}.yaml"))
    assert dict(again.transformer) == dict(mc.transformer)
    assert again.gpt_kwargs() == mc.gpt_kwargs() and again.slmoe == mc.slmoe


@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_squared_relu_by_name_and_mla_fields(tmp_path, q_lora_rank):
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    path = _write(tmp_path, _tiny_yaml(gated_linear_unit=False, activation_func="squared_relu",
                                       multi_latent_attention=True, q_lora_rank=q_lora_rank,
                                       kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4,
                                       v_head_dim=8, rope_type="rope", qk_layernorm=True))
    mc = load_model_config(path)
    assert mc.transformer["activation_func"] == "squared_relu"  # the name, so it dumps back
    config = mc.transformer_config()
    assert isinstance(config, MLATransformerConfig) and config.kv_lora_rank == 8
    assert config.q_lora_rank == q_lora_rank  # None: q is not compressed
    assert config.activation_func is squared_relu and not config.gated_linear_unit
    assert config.rotary_base == mc.rotary_base  # MLA's own rotary embedding reads it here
    assert dict(load_model_config(_write(tmp_path, dump_model_config(mc), "again.yaml"))
                .transformer) == dict(mc.transformer)


def test_vocab_not_divisible_by_tensor_parallel_size(tmp_path):
    mc = load_model_config(_write(tmp_path, _tiny_yaml(vocab_size=511)))
    with pytest.raises(ConfigError) as err:
        mc.transformer_config(tensor_model_parallel_size=2, sequence_parallel=True)
    assert _one_line(err).startswith("--tensor-model-parallel-size 2 does not divide")


# --- the tiny model runs -------------------------------------------------------------------------


def test_tiny_model_forward_backward(megatron_single_rank):
    from megatron.core.transformer.mlp import MLP

    from megatron_slmoe.moe.layer import StableLatentMoELayer

    mc = load_model_config("tiny")
    model = build_gpt_model(mc, mc.transformer_config(use_cpu_initialization=True))
    mlps = [layer.mlp for layer in model.decoder.layers]
    assert type(mlps[0]) is MLP and all(isinstance(m, StableLatentMoELayer) for m in mlps[1:])
    assert mlps[1].latent_down.weight.shape == (32, 64)

    batch, seq = 2, 16
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, mc.vocab_size, (batch, seq + 1), generator=gen)
    position_ids = torch.arange(seq).expand(batch, seq)
    loss_BS = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:])
    assert loss_BS.shape == (batch, seq)
    # Small initial weights: close to uniform over the vocabulary.
    assert abs(loss_BS.mean().item() - math.log(mc.vocab_size)) < 0.5
    loss_BS.mean().backward()
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert param.grad is not None, name
            assert torch.isfinite(param.grad).all(), name
    assert mlps[1].experts.fc1_weight.grad.abs().sum() > 0
    assert mlps[1].router.weight.grad.abs().sum() > 0


def test_a_model_built_for_loading_has_the_initialised_models_tensor_parallel_marks(
        megatron_single_rank):
    """Megatron marks tensor-parallel weights only while initialising them; a model built to be
    loaded (no initialisation) must carry the same marks, or the grad norm under TP counts its
    shards on TP rank 0 only."""
    from megatron_slmoe.parallel.config import ParallelConfig
    from megatron_slmoe.runtime.model import build_model

    def marks(initialize):
        model, _ = build_model(load_model_config("tiny"), ParallelConfig(), False,
                               current_platform(), initialize=initialize)
        return {name: (getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", -1))
                for name, p in model.named_parameters()}

    initialised = marks(True)
    assert sum(tp for tp, _ in initialised.values()) >= 10  # embedding, linears, experts
    assert marks(False) == initialised
