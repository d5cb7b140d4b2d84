"""A small Stable Latent MoE GPT for LoRA tests on one rank (layer 0 dense, layer 1 MoE with a
latent width, a shared expert and 4 experts), and what the tests do with it."""

from __future__ import annotations

import torch

ALL_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "shared_experts",
               "router", "latent"]

# A small Stable Latent MoE GPT: layer 0 dense, layer 1 MoE (latent, shared expert, 4 experts).
MODEL_YAML = """\
model:
  num_layers: 2
  moe_layer_freq: [0, 1]
  hidden_size: 32
  ffn_hidden_size: 48
  num_attention_heads: 4
  num_query_groups: 2
  kv_channels: 8
  normalization: RMSNorm
  gated_linear_unit: true
  add_bias_linear: false
  hidden_dropout: 0.0
  attention_dropout: 0.0
  num_moe_experts: 4
  moe_router_topk: 2
  moe_ffn_hidden_size: 24
  moe_latent_size: 16
  moe_shared_expert_intermediate_size: 24
  moe_router_score_function: sigmoid
  moe_router_enable_expert_bias: true
  moe_router_load_balancing_type: seq_aux_loss
  moe_aux_loss_coeff: 1.0e-3
  moe_router_dtype: fp32
  vocab_size: 64
  max_sequence_length: 16
  position_embedding_type: rope
"""


def model_config(tmp_path_factory, text: str = MODEL_YAML, name: str = "lora_unit"):
    from megatron_slmoe.model.model_file import load_model_config

    path = tmp_path_factory.mktemp("model-config") / f"{name}.yaml"
    path.write_text(text)
    return load_model_config(str(path))


def build_model(mc, seed: int = 0, **overrides):
    from megatron_slmoe.model.build import build_gpt_model

    torch.manual_seed(seed)
    return build_gpt_model(mc, mc.transformer_config(use_cpu_initialization=True, **overrides))


def batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (2, 16), generator=gen)
    return tokens, torch.arange(16).expand(2, 16)


def logits(model, seed: int = 0):
    tokens, positions = batch(seed)
    with torch.no_grad():
        return model(tokens, positions, None)


def randomize(model, seed: int = 0, scale: float = 0.2):
    from megatron_slmoe.lora.inject import lora_modules

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in lora_modules(model):
            for param in module.lora_parameters():
                param.copy_(torch.randn(param.shape, generator=gen) * scale)


def lora_config(**overrides):
    from megatron_slmoe.lora.config import LoRAConfig

    fields = dict(rank=4, alpha=8.0, targets=ALL_TARGETS)
    fields.update(overrides)
    return LoRAConfig(**fields)


def parallel_moe_config(**extra):
    """A tiny latent-MoE TransformerConfig (sigmoid router with expert bias, shared expert) for
    the layout of the current parallel state: the parity tests' language model, in fp32."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = ps.get_tensor_model_parallel_world_size()
    return TransformerConfig(
        num_layers=2, moe_layer_freq=[0, 1], hidden_size=32, ffn_hidden_size=48,
        num_attention_heads=4, num_query_groups=2, kv_channels=8,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_latent_size=16,
        moe_shared_expert_intermediate_size=24, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=1e-2, moe_router_dtype="fp32", moe_grouped_gemm=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        sequence_parallel=tp > 1, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        bf16=False, deterministic_mode=True, **extra)
