"""A small KDA layer on Megatron-Core and the plain reference it is held to.

The reference is ``tests.helpers.kimi_k3_reference.KimiDeltaAttention`` (written from KIMI_K3.md,
a per-token recurrence), with random weights drawn from a seed; :func:`load_reference_weights`
copies them into our Megatron layer, each tensor-parallel rank taking its heads' slices, so any
layout computes the same layer. Runs in one process (after ``init_single_rank``) or inside a rank
of ``ranks.run_ranks``.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

from tests.helpers import kimi_k3_reference

HIDDEN = 32
HEADS = 4
HEAD_DIM = 8
A_LOG_STORED = 8  # the release pads A_log past the heads (K3: 96 in 128)
NORM_EPS = 1e-5


def kda_config():
    from megatron_slmoe.model.kda_attention import KDAConfig

    return KDAConfig(num_heads=HEADS, head_dim=HEAD_DIM, conv_kernel_size=4,
                     gate_lower_bound=-5.0, norm_eps=NORM_EPS)


def transformer_config(sequence_parallel: bool | None = None) -> TransformerConfig:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1 if sequence_parallel is None else sequence_parallel,
        normalization="RMSNorm", layernorm_epsilon=NORM_EPS, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32, bf16=False)


def reference_layer(seed: int = 0) -> torch.nn.Module:
    """The plain KDA layer with random weights of useful sizes (float32)."""
    layer = kimi_k3_reference.KimiDeltaAttention(
        HIDDEN, HEADS, HEAD_DIM, conv_kernel=4, gate_lower_bound=-5.0, a_log_size=A_LOG_STORED,
        norm_eps=NORM_EPS)
    gen = torch.Generator().manual_seed(seed)
    P = HEADS * HEAD_DIM
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith("conv1d.weight"):
                value = torch.rand(param.shape, generator=gen) - 0.5
            elif name == "A_log":
                value = torch.zeros(param.shape)
                value[:HEADS] = torch.randn(HEADS, generator=gen) * 0.5
            elif name == "dt_bias":
                value = torch.randn(P, generator=gen) * 0.5
            elif name == "o_norm.weight":
                value = 1 + 0.2 * torch.randn(param.shape, generator=gen)
            else:  # projections [out, in]
                value = torch.randn(param.shape, generator=gen) * param.shape[1] ** -0.5
            param.copy_(value)
    return layer


_ROW_SLICED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "g_proj.weight",
               "f_b_proj.weight", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
               "dt_bias")


def rank_slice(name: str, full: torch.Tensor) -> torch.Tensor:
    """This TP rank's part of the reference's tensor ``name`` (A_log without its padding)."""
    from megatron_slmoe.model.kda_attention import a_log_from_checkpoint

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    if name == "A_log":
        full = a_log_from_checkpoint(full, HEADS)
    if name in _ROW_SLICED or name in ("A_log", "b_proj.weight"):
        return full.chunk(tp, dim=0)[rank]
    if name == "o_proj.weight":
        return full.chunk(tp, dim=1)[rank]
    return full  # f_a_proj, o_norm: whole on every rank


def load_reference_weights(layer: torch.nn.Module, reference: torch.nn.Module) -> None:
    full = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(rank_slice(name, full[name].detach()))


def build_layer(reference: torch.nn.Module, sequence_parallel: bool | None = None):
    """Our KimiDeltaAttention for this rank's layout, holding ``reference``'s weights."""
    from megatron_slmoe.model.kda_attention import KimiDeltaAttention, KimiDeltaAttentionSubmodules

    layer = KimiDeltaAttention(transformer_config(sequence_parallel),
                               KimiDeltaAttentionSubmodules(), layer_number=1,
                               kda_config=kda_config())
    load_reference_weights(layer, reference)
    return layer
