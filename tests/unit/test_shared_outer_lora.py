"""Shared-outer expert LoRA (issue 42, ``--expert-lora-layout shared-outer``; SGLang's
``experts_shared_outer_loras``, miles' K3 LoRA): one A per gate/up input and one B on the down
output shared by the experts of a layer, per-expert factors inside.

On the small Stable Latent MoE GPT (4 experts in a latent of 16, FFN 24, top-2, rank 4): the
factor shapes; the experts' output and every gradient against the shared-outer maths written out
here token by token in float64; the model's logits against the base model with the per-expert
weights W_e + s ΔW_e computed here; ``merge_lora`` and the adapter file (names, module scales,
load back, refusal of the other layout); the planner's count equals the model's; bad input."""

import json

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import lora_models

pytestmark = pytest.mark.usefixtures("megatron_single_rank")

R = 4  # the experts' rank (--lora-rank 4, alpha 8: s = 2)
EXPERTS, LATENT, FFN = 4, 16, 24


@pytest.fixture(scope="module")
def mc(tmp_path_factory):
    return lora_models.model_config(tmp_path_factory)


def _base_like(mc, model):
    """A model without LoRA holding ``model``'s base weights (expert weights are drawn from an
    RNG tracker that a rebuild does not reset)."""
    base = lora_models.build_model(mc)
    with torch.no_grad():
        base.load_state_dict({k: v for k, v in model.state_dict().items() if "lora" not in k
                              and not k.endswith("_extra_state")}, strict=False)
    return base


def _shared_outer(mc, seed=0, **overrides):
    from megatron_slmoe.lora.inject import inject_lora

    model = lora_models.build_model(mc, seed=seed)
    inject_lora(model, lora_models.lora_config(expert_layout="shared-outer", **overrides))
    lora_models.randomize(model, seed=seed + 1)
    return model


def test_factor_shapes_and_marks(mc):
    model = _shared_outer(mc)
    experts = model.decoder.layers[1].mlp.experts
    assert experts.lora_layout == "shared-outer"
    shapes = {n: tuple(getattr(experts, n).shape)
              for n in ("fc1_lora_A", "fc1_lora_B", "fc2_lora_A", "fc2_lora_B")}
    assert shapes == {"fc1_lora_A": (2 * R, LATENT), "fc1_lora_B": (EXPERTS, 2 * FFN, R),
                      "fc2_lora_A": (EXPERTS, R, FFN), "fc2_lora_B": (LATENT, R)}
    for param in experts.lora_parameters():
        assert param.requires_grad and param.allreduce is False
    # One rank: the shared factors are counted in the grad norm.
    assert experts.fc1_lora_A.shared is False and experts.fc2_lora_B.shared is False


def _reference_experts(rows, counts, probs, w1, w2, a1, b1, a2, b2, s):
    """The shared-outer maths row by row in float64: gate = W_g x + s B_g,e (A_g x), up likewise
    with A_u, out = p (W_2 act + s B (A_2,e act))."""
    out = []
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts)), counts)
    for x, e, p in zip(rows, expert_of_row.tolist(), probs):
        gate = w1[e, :FFN] @ x + s * b1[e, :FFN] @ (a1[:R] @ x)
        up = w1[e, FFN:] @ x + s * b1[e, FFN:] @ (a1[R:] @ x)
        act = F.silu(gate) * up
        out.append(p * (w2[e] @ act + s * b2 @ (a2[e] @ act)))
    return torch.stack(out)


def test_experts_and_their_gradients_equal_the_shared_outer_maths(mc):
    model = _shared_outer(mc)
    experts = model.decoder.layers[1].mlp.experts
    gen = torch.Generator().manual_seed(5)
    counts = torch.tensor([3, 0, 5, 2])
    rows = torch.randn(10, LATENT, generator=gen, requires_grad=True)
    probs = torch.rand(10, generator=gen)
    out = experts(rows, counts, probs)
    weights = torch.randn(out.shape, generator=gen)
    (out * weights).sum().backward()

    factors = [experts.fc1_lora_A, experts.fc1_lora_B, experts.fc2_lora_A, experts.fc2_lora_B]
    leaves = [rows.detach().double().requires_grad_()] + [
        f.detach().double().requires_grad_() for f in factors]
    expected = _reference_experts(leaves[0], counts, probs.double(),
                                  experts.fc1_weight.double(), experts.fc2_weight.double(),
                                  *leaves[1:], experts.lora_scaling)
    (expected * weights.double()).sum().backward()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    for got, want in zip([rows] + factors, leaves):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-5)
    # An expert without rows contributes nothing to its factors; the shared ones get all rows.
    assert experts.fc1_lora_B.grad[1].abs().sum() == 0 and experts.fc2_lora_A.grad[1].abs().sum() == 0
    assert experts.fc1_lora_A.grad.abs().sum() > 0 and experts.fc2_lora_B.grad.abs().sum() > 0


def _explicit_merge(model, base):
    """Add to ``base`` (``model``'s base weights) s ΔW_e computed here: fc1's gate rows
    B_g,e A_g and up rows B_u,e A_u, fc2's B A_e; the other LoRA modules' s B A."""
    from megatron_slmoe.lora.inject import lora_modules

    with torch.no_grad():
        params = dict(base.named_parameters())
        for module in lora_modules(model):
            local = module.lora_name
            s = module.lora_scaling
            if local.endswith("mlp.experts"):
                a1, b1 = module.fc1_lora_A, module.fc1_lora_B
                a2, b2 = module.fc2_lora_A, module.fc2_lora_B
                for e in range(EXPERTS):
                    delta1 = torch.cat([b1[e, :FFN] @ a1[:R], b1[e, FFN:] @ a1[R:]])
                    params[f"{local}.fc1_weight"][e] += s * delta1
                    params[f"{local}.fc2_weight"][e] += s * (b2 @ a2[e])
                continue
            weight = params[f"{local}.weight"]
            weight += s * (module.lora_B.weight @ module.lora_A.weight)


def test_model_logits_equal_explicit_per_expert_weights_and_merge(mc):
    from megatron_slmoe.lora.adapter import merge_lora

    model = _shared_outer(mc)
    logits = lora_models.logits(model)
    base = _base_like(mc, model)
    _explicit_merge(model, base)
    torch.testing.assert_close(logits, lora_models.logits(base), rtol=1e-4, atol=1e-4)
    merge_lora(model)
    torch.testing.assert_close(lora_models.logits(model), logits, rtol=1e-4, atol=1e-4)


def test_adapter_file_names_scales_and_load_back(mc, tmp_path):
    from safetensors import safe_open

    from megatron_slmoe.lora.adapter import AdapterError, load_adapter, save_adapter
    from megatron_slmoe.lora.inject import inject_lora

    config = lora_models.lora_config(expert_layout="shared-outer")
    model = _shared_outer(mc)
    save_adapter(model, tmp_path / "adapter", config)
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as fh:
        shapes = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    prefix = "decoder.layers.1.mlp.experts"
    assert shapes[f"{prefix}.linear_fc1.lora_A.weight"] == (2 * R, LATENT)
    assert shapes[f"{prefix}.linear_fc2.lora_B.weight"] == (LATENT, R)
    for e in range(EXPERTS):
        assert shapes[f"{prefix}.{e}.linear_fc1.lora_B.weight"] == (2 * FFN, R)
        assert shapes[f"{prefix}.{e}.linear_fc2.lora_A.weight"] == (R, FFN)
    assert f"{prefix}.0.linear_fc1.lora_A.weight" not in shapes
    document = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert document["lora"]["expert_layout"] == "shared-outer"
    for proj in ("linear_fc1", "linear_fc2"):
        assert document["module_scales"][f"{prefix}.*.{proj}"] == {
            "rank": R, "alpha": 8.0, "scaling": 2.0}

    fresh = _base_like(mc, model)
    load_adapter(fresh, tmp_path / "adapter")  # injects the adapter's layout
    torch.testing.assert_close(lora_models.logits(fresh), lora_models.logits(model))

    per_expert = _base_like(mc, model)
    inject_lora(per_expert, lora_models.lora_config())
    with pytest.raises(AdapterError, match="expert_layout 'shared-outer' but the model's "
                                           "adapters were injected with 'per-expert'"):
        load_adapter(per_expert, tmp_path / "adapter")


def test_planner_count_equals_the_models_trainable_parameters(mc):
    from megatron_slmoe.plan.adapter_state import ExpertDims, expert_adapter_count

    dims = ExpertDims(moe_layers=1, experts=EXPERTS, width=LATENT, ffn=FFN)
    for layout in ("per-expert", "shared-outer"):
        from megatron_slmoe.lora.inject import inject_lora

        model = lora_models.build_model(mc)
        inject_lora(model, lora_models.lora_config(expert_layout=layout,
                                                   targets=["linear_fc1", "linear_fc2"]))
        experts = model.decoder.layers[1].mlp.experts
        measured = sum(p.numel() for p in experts.lora_parameters())
        assert measured == expert_adapter_count(dims, R, layout).total, layout
    # Shared-outer on this model: 3 f r per expert + 3 l r per layer.
    assert expert_adapter_count(dims, R, "shared-outer").total == 3 * R * (EXPERTS * FFN + LATENT)


def test_bad_inputs_are_one_line(mc, tmp_path_factory):
    from megatron_slmoe.config.errors import ConfigError
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.inject import inject_lora
    from megatron_slmoe.lora.targets import LoRATargetError

    with pytest.raises(ConfigError, match="expert_layout.*per-expert, shared-outer.*'outer'"):
        LoRAConfig(expert_layout="outer")
    dense_yaml = "".join(line for line in lora_models.MODEL_YAML.splitlines(keepends=True)
                         if "moe_" not in line)  # no MoE layer at all
    dense = lora_models.model_config(tmp_path_factory, dense_yaml, "dense")
    message = (r"^--expert-lora-layout shared-outer: no routed experts are adapted \(the model "
               r"has none, or neither linear_fc1 nor linear_fc2 is a target\); use per-expert$")
    with pytest.raises(LoRATargetError, match=message):
        inject_lora(lora_models.build_model(dense),
                    lora_models.lora_config(expert_layout="shared-outer",
                                            targets=["linear_qkv", "linear_fc1", "linear_fc2"]))
    with pytest.raises(LoRATargetError, match=message):
        inject_lora(lora_models.build_model(mc),
                    lora_models.lora_config(expert_layout="shared-outer", targets=["router"]))
