"""LoRA modules on one rank: unchanged model at step 0, every target equal to an explicit
``W + s B A`` reference (the experts' router probability before fc2), only LoRA parameters train,
Megatron's parallel attributes on every LoRA tensor, one-line target errors, dropout in training
only, and a layout-independent initialisation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.lora_models import (
    ALL_TARGETS,
    MODEL_YAML,
    batch,
    build_model,
    logits,
    lora_config,
    model_config,
    randomize,
)

pytestmark = pytest.mark.usefixtures("megatron_single_rank")

@pytest.fixture(scope="module")
def mc(tmp_path_factory):
    return model_config(tmp_path_factory)


@pytest.fixture(scope="module")
def adapted(mc):
    """A model with random adapters on every target, and what each LoRA module saw and gave."""
    from megatron_slmoe.lora.inject import inject_lora, lora_modules

    model = build_model(mc)
    model.eval()
    inject_lora(model, lora_config())
    randomize(model)
    records = {}

    def record(name):
        def hook(module, args, output):
            # clones: Megatron adds the residual in place into some outputs afterwards
            out = tuple(o.detach().clone() if torch.is_tensor(o) else o for o in output) \
                if isinstance(output, tuple) else output.detach().clone()
            records[name] = ([a.detach().clone() if torch.is_tensor(a) else a for a in args], out)
        return hook

    handles = [m.register_forward_hook(record(m.lora_name)) for m in lora_modules(model)]
    logits(model)
    for handle in handles:
        handle.remove()
    return model, records


def _target_modules(model, target):
    from megatron_slmoe.lora.inject import lora_modules

    suffixes = {
        "linear_qkv": ("self_attention.linear_qkv",),
        "linear_proj": ("self_attention.linear_proj",),
        "linear_fc1": ("0.mlp.linear_fc1", "mlp.experts"),
        "linear_fc2": ("0.mlp.linear_fc2", "mlp.experts"),
        "shared_experts": ("shared_experts.linear_fc1", "shared_experts.linear_fc2"),
        "router": ("mlp.router",),
        "latent": ("mlp.latent_down", "mlp.latent_up"),
    }[target]
    return [m for m in lora_modules(model) if m.lora_name.endswith(suffixes)]


def _merged(module):
    s = module.lora_scaling
    return module.weight + s * module.lora_B.weight @ module.lora_A.weight


def _expert_reference(experts, rows, tokens_per_expert, probs):
    s = experts.lora_scaling
    outs = []
    for e, (x, p) in enumerate(zip(rows.split(tokens_per_expert.tolist()),
                                   probs.split(tokens_per_expert.tolist()))):
        w1, w2 = experts.fc1_weight[e], experts.fc2_weight[e]
        if experts.fc1_lora_A is not None:
            w1 = w1 + s * experts.fc1_lora_B[e] @ experts.fc1_lora_A[e]
        if experts.fc2_lora_A is not None:
            w2 = w2 + s * experts.fc2_lora_B[e] @ experts.fc2_lora_A[e]
        h = x @ w1.T
        if experts.config.gated_linear_unit:
            gate, up = h.chunk(2, dim=-1)
            act = F.silu(gate) * up
        else:  # squared ReLU
            act = torch.relu(h) ** 2
        outs.append((act * p.unsqueeze(-1)) @ w2.T)
    return torch.cat(outs)


def _check_module(module, args, output):
    from megatron_slmoe.lora.experts import LoRALatentSwiGLUExperts
    from megatron_slmoe.lora.router import LoRARouterMixin

    with torch.no_grad():
        if isinstance(module, LoRALatentSwiGLUExperts):
            expected = _expert_reference(module, *args)
            actual = output
        elif isinstance(module, LoRARouterMixin):
            (x,) = args[:1]
            actual = module.gating(x)
            expected = x.float() @ _merged(module).float().T
        else:
            x = args[0]
            actual = output[0] if isinstance(output, tuple) else output
            expected = x @ _merged(module).T
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert all(p.abs().sum() > 0 for p in module.lora_parameters())  # the adapter matters


@pytest.mark.parametrize("target", ALL_TARGETS)
def test_random_adapter_equals_explicit_merged_weight_reference(adapted, target):
    model, records = adapted
    modules = _target_modules(model, target)
    assert modules, f"no LoRA module for {target}"
    for module in modules:
        args, output = records[module.lora_name]
        _check_module(module, args, output)


def test_experts_with_fc1_only_match_reference(mc):
    from megatron_slmoe.lora.experts import LoRALatentSwiGLUExperts
    from megatron_slmoe.lora.inject import inject_lora

    model = build_model(mc)
    inject_lora(model, lora_config(targets=["linear_fc1"]))
    randomize(model)
    experts = model.decoder.layers[1].mlp.experts
    assert isinstance(experts, LoRALatentSwiGLUExperts)
    assert experts.fc2_lora_A is None and experts.fc1_lora_A is not None
    gen = torch.Generator().manual_seed(5)
    counts = torch.tensor([3, 0, 2, 4])
    rows = torch.randn(9, 16, generator=gen)
    probs = torch.rand(9, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(experts(rows, counts, probs),
                                   _expert_reference(experts, rows, counts, probs),
                                   rtol=1e-5, atol=1e-5)


def test_nongated_squared_relu_experts_match_reference(tmp_path_factory):
    from megatron_slmoe.lora.experts import LoRALatentSwiGLUExperts
    from megatron_slmoe.lora.inject import inject_lora

    text = MODEL_YAML.replace("gated_linear_unit: true",
                              "gated_linear_unit: false\n  activation_func: squared_relu")
    model = build_model(model_config(tmp_path_factory, text, "nongated"))
    inject_lora(model, lora_config(targets=["linear_fc1", "linear_fc2", "shared_experts"]))
    randomize(model)
    experts = model.decoder.layers[1].mlp.experts
    assert isinstance(experts, LoRALatentSwiGLUExperts)
    assert experts.fc1_weight.shape[1] == 24  # F rows: no gate half
    gen = torch.Generator().manual_seed(5)
    counts = torch.tensor([3, 0, 2, 4])
    rows = torch.randn(9, 16, generator=gen)
    probs = torch.rand(9, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(experts(rows, counts, probs),
                                   _expert_reference(experts, rows, counts, probs),
                                   rtol=1e-5, atol=1e-5)


def test_forward_at_init_equals_base(mc):
    from megatron_slmoe.lora.inject import inject_lora

    model = build_model(mc)
    model.eval()
    before = logits(model)
    names = inject_lora(model, lora_config())
    assert len(names) == 12  # qkv, proj x2; dense fc1, fc2; router, latent x2, experts, shared x2
    torch.testing.assert_close(logits(model), before, rtol=0, atol=1e-6)


def test_only_lora_parameters_require_and_get_gradients(mc):
    from megatron_slmoe.lora.inject import inject_lora, lora_modules

    model = build_model(mc)
    inject_lora(model, lora_config())
    randomize(model)
    lora = {id(p) for m in lora_modules(model) for p in m.lora_parameters()}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(id(p) in lora for p in model.parameters() if p.requires_grad)
    assert all(".lora_" in n or "_lora_" in n for n in trainable)
    tokens, positions = batch()
    model(tokens, positions, None, labels=tokens).float().mean().backward()
    for name, param in model.named_parameters():
        if id(param) in lora:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None, name


def test_lora_tensors_carry_megatron_parallel_attributes(mc):
    from megatron_slmoe.lora.inject import inject_lora

    model = build_model(mc)
    inject_lora(model, lora_config())
    dense = model.decoder.layers[0]
    qkv, proj = dense.self_attention.linear_qkv, dense.self_attention.linear_proj
    assert qkv.lora_B.weight.tensor_model_parallel and qkv.lora_B.weight.partition_dim == 0
    assert not qkv.lora_A.weight.tensor_model_parallel
    assert not getattr(qkv.lora_A.weight, "sequence_parallel", False)  # full grads already
    assert dense.mlp.linear_fc1.lora_B.weight.partition_stride == 2  # gate|up, like the weight
    assert dense.mlp.linear_fc1.lora_glu
    assert proj.lora_A.weight.tensor_model_parallel and proj.lora_A.weight.partition_dim == 1
    assert not proj.lora_B.weight.tensor_model_parallel
    moe = model.decoder.layers[1].mlp
    for module in (moe.router, moe.latent_down, moe.latent_up):
        for param in module.lora_parameters():
            assert param.sequence_parallel == getattr(module.weight, "sequence_parallel", False)
    # Expert LoRA is marked as Megatron marks expert weights: reduced over expert-data-parallel
    # ranks, and no TP replica (the grad norm counts it on every TP rank).
    for param in [*moe.experts.lora_parameters(), moe.experts.fc1_weight]:
        assert param.allreduce is False and param.tensor_model_parallel


def test_lora_at_init_is_drawn_per_global_name(mc):
    from megatron_slmoe.lora.inject import inject_lora
    from megatron_slmoe.lora.base import init_lora_a

    model = build_model(mc)
    config = lora_config(init_seed=7)
    inject_lora(model, config)
    qkv = model.decoder.layers[1].self_attention.linear_qkv
    name = "decoder.layers.1.self_attention.linear_qkv.lora_A.weight"
    assert torch.equal(qkv.lora_A.weight, init_lora_a(tuple(qkv.lora_A.weight.shape), name, 7))
    assert qkv.lora_A.weight.abs().max() <= 1 / math.sqrt(qkv.lora_A.weight.shape[1])
    assert qkv.lora_B.weight.abs().sum() == 0
    experts = model.decoder.layers[1].mlp.experts
    expert_a = init_lora_a((4, 16), "decoder.layers.1.mlp.experts.2.linear_fc1.lora_A.weight", 7)
    assert torch.equal(experts.fc1_lora_A[2], expert_a)
    assert not torch.equal(experts.fc1_lora_A[1], experts.fc1_lora_A[2])


def test_target_that_matches_nothing_is_one_line_naming_what_exists(mc, tmp_path_factory):
    from megatron_slmoe.lora.inject import inject_lora
    from megatron_slmoe.lora.targets import LoRATargetError

    config = lora_config(targets=["linear_qkv"])
    object.__setattr__(config, "targets", ["linear_qkvx"])  # past validation: inject checks again
    with pytest.raises(LoRATargetError) as err:
        inject_lora(build_model(mc), config)
    message = str(err.value)
    assert message == ("lora target 'linear_qkvx' matches nothing; targetable: linear_qkv, "
                       "linear_proj, linear_fc1, linear_fc2, shared_experts, router, latent")
    plain = model_config(tmp_path_factory, MODEL_YAML.replace("  moe_latent_size: 16\n", "")
                         .replace("  moe_shared_expert_intermediate_size: 24\n", ""), "plain")
    model = build_model(plain)
    with pytest.raises(LoRATargetError, match=r"^lora target 'latent' matches nothing; "
                       r"targetable: linear_qkv, linear_proj, linear_fc1, linear_fc2, router$"):
        inject_lora(model, lora_config(targets=["linear_qkv", "latent"]))
    assert not any(p.__class__.__name__.startswith("LoRA") for p in model.modules())


def test_injecting_twice_or_into_ddp_is_refused(mc):
    from megatron_slmoe.lora.inject import inject_lora

    model = build_model(mc)
    inject_lora(model, lora_config(targets=["router"]))
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        inject_lora(model, lora_config(targets=["linear_qkv"]))


def test_dropout_acts_on_the_lora_input_in_training_only(mc):
    from megatron_slmoe.lora.inject import inject_lora

    model = build_model(mc)
    inject_lora(model, lora_config(targets=["linear_qkv"], dropout=0.5))
    randomize(model)
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    x = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(3))
    expected = x @ _merged(qkv).detach().T
    qkv.eval()
    torch.testing.assert_close(qkv(x)[0].detach(), expected, rtol=1e-5, atol=1e-5)
    qkv.train()
    first, second = qkv(x)[0].detach(), qkv(x)[0].detach()
    assert not torch.allclose(first, expected) and not torch.equal(first, second)
    base = x @ qkv.weight.T  # dropout never touches the base path: its mean is unchanged
    assert (first - base).abs().sum() > 0


def test_config_validation_one_line_naming_the_field():
    from megatron_slmoe.lora.config import LoRAConfig

    cases = [({"rank": 0}, "lora.rank"), ({"rank": 257}, "lora.rank"), ({"rank": 2.0}, "lora.rank"),
             ({"alpha": 0}, "lora.alpha"), ({"alpha": float("nan")}, "lora.alpha"),
             ({"dropout": 1.0}, "lora.dropout"), ({"dropout": -0.1}, "lora.dropout"),
             ({"targets": []}, "lora.targets"), ({"targets": "linear_qkv"}, "lora.targets"),
             ({"targets": ["linear_qkvx"]}, "lora.targets"),
             ({"targets": ["router", "router"]}, "lora.targets"),
             ({"init_seed": -1}, "lora.init_seed")]
    for fields, name in cases:
        with pytest.raises(ValueError) as err:
            LoRAConfig(**fields)
        assert str(err.value).startswith(name) and "\n" not in str(err.value), fields
    assert LoRAConfig(rank=256, alpha=1, dropout=0.0, targets=["latent"]).scaling == 1 / 256


def test_config_json_round_trip_and_refusals():
    from megatron_slmoe.lora.adapter import adapter_config_json, lora_config_from_json, read_base_info
    from megatron_slmoe.lora.config import LoRAConfig

    config = LoRAConfig(rank=16, alpha=32, dropout=0.1, targets=["router", "linear_fc1"],
                        init_seed=3)
    text = adapter_config_json(config, {"model_config": "tiny", "base_checkpoint": "/ckpt"})
    assert lora_config_from_json(text) == config
    assert read_base_info(text) == {"model_config": "tiny", "base_checkpoint": "/ckpt"}
    import json

    document = json.loads(text)
    assert document["format_version"] == 1
    for change, needle in (({"format_version": 2}, "format_version"),
                           ({"extra": 1}, "unknown key"),
                           ({"lora": {**document["lora"], "rank": 0}}, "lora.rank"),
                           ({"lora": {**document["lora"], "bias": "none"}}, "lora.bias")):
        with pytest.raises(ValueError, match=needle) as err:
            lora_config_from_json(json.dumps({**document, **change}))
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="not valid JSON"):
        lora_config_from_json("{")
    with pytest.raises(ValueError, match="plain JSON"):
        adapter_config_json(config, {"model": object()})


def test_full_recomputation_still_trains_the_adapters(mc):
    """The frozen embedding gives the first checkpointed block an input without grad; inject_lora
    marks it so that Megatron's activation checkpointing keeps the LoRA graph."""
    from megatron_slmoe.lora.inject import inject_lora, lora_modules

    model = build_model(mc, recompute_granularity="full", recompute_method="uniform",
                        recompute_num_layers=1)
    inject_lora(model, lora_config(targets=["linear_qkv", "router"]))
    randomize(model)
    tokens, positions = batch()
    model(tokens, positions, None, labels=tokens).float().mean().backward()
    for module in lora_modules(model):
        for param in module.lora_parameters():
            assert param.grad is not None and param.grad.abs().sum() > 0, module.lora_name


def test_torch_free_target_names_are_exactly_the_module_kinds_targets():
    """lora.config names the targets without torch; the registry must adapt each and no other."""
    from megatron_slmoe.lora.config import TARGET_NAMES
    from megatron_slmoe.lora.targets import MODULE_KINDS

    assert set(TARGET_NAMES) == {t for kind in MODULE_KINDS for t in kind.targets}
    assert len(set(TARGET_NAMES)) == len(TARGET_NAMES)
