"""Block Attention Residuals (AttnRes) on Megatron-Core's TransformerLayer and TransformerBlock.

The residual stream of an AttnRes model is a running sum and a bank of block vectors. The input
of each sublayer is not the running sum but a mix of the candidates ``[bank..., sum]``: a softmax
over ``<w_norm * w_proj, RMSNorm(v_j)>`` (fp32, the norm without weight) applied to the raw
candidates. Layer ``i``::

    h = Mix(sum, bank; self_attention_res) if bank else sum
    if i % block == 0: bank.append(sum); sum = 0
    sum += attention(input_layernorm(h))
    h = Mix(sum, bank; mlp_res)
    sum += mlp(pre_mlp_layernorm(h))

and after the last layer the output is ``final_norm(Mix(sum, bank; output_attn_res))``. The
first bank vector is the embedding.

**How the stream travels.** Megatron-Core's block and pipeline schedules hand one tensor
``[s, b, h]`` from layer to layer and from stage to stage. Here that tensor holds the stream's
slots stacked on the sequence dimension: ``[sum; bank 0; ...; bank n-1]``, ``[(n + 1) s, b, h]``
(under sequence parallelism each rank's ``s / tp``). Between the layers of a stage it holds
exactly the slots that exist. At a stage boundary (and a virtual-stage boundary) it is padded
with zeros to ``stream_slots`` slots, the most any boundary can need, so that every stage sends
and receives one shape: the schedules are given a sequence length of ``stream_slots * s``
(``pipeline_seq_length``). How many bank vectors enter layer ``i`` is ``ceil(i / block)``, known on
every rank, so a layer finds ``s`` from the length of its input and cuts its slots with no other
message; the embedding (layer 0's input) is the stream of one slot.

Memory: each layer's output stream is a new tensor (its bank slots copied in: Megatron-Core's
schedules hand over one tensor, and free a stage's output after sending it), and what autograd
keeps of a layer's input stream is the whole stream, up to ``stream_slots`` times one hidden
state per layer (``plan`` prices it). The mixes read their candidates where they lie, with no
stacked fp32 copy kept for the backward (``_Mix``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    get_transformer_layer_offset,
)


def bank_size(layer: int, block: int) -> int:
    """How many bank vectors enter layer ``layer`` (0-based): one was added at every layer
    ``0, block, 2 block, ...`` before it."""
    return math.ceil(layer / block)


def stream_slots(num_layers: int, block: int) -> int:
    """The slots of the stream a stage hands the next (the running sum and the most bank
    vectors any layer boundary holds)."""
    return 1 + bank_size(num_layers, block)


class AttentionResidualMix(MegatronModule):
    """``Mix(sum, bank)``: weights ``norm_weight`` [h] and ``proj_weight`` [1, h] (the release's
    ``*_res_norm`` and ``*_res_proj``), replicated on the tensor-parallel ranks; under sequence
    parallelism each rank mixes its slice of the sequence, so their gradients are reduced over
    the tensor-parallel group as the layer norms' are."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float) -> None:
        super().__init__(config=config)
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.eps = eps
        self.norm_weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        # Zero scores: the mix starts as the mean of the candidates (overwritten on import).
        self.proj_weight = torch.nn.Parameter(
            torch.zeros(1, hidden_size, dtype=config.params_dtype, device=device))
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, running_sum: torch.Tensor, bank: list[torch.Tensor]) -> torch.Tensor:
        return _Mix.apply(self.norm_weight, self.proj_weight, self.eps, *bank, running_sum)


class _Mix(torch.autograd.Function):
    """The mix over the candidates where they lie (slots of the layer's stream, the running
    sum), one at a time: stacking them, and autograd keeping the fp32 stack and its normalised
    copy, would hold about two more streams per mix until the backward. What it keeps: the
    candidates themselves (alive in the stream anyway), and per candidate and token the
    softmax weight and 1 / RMS. Score ``z_j = r_j <x_j, q>``, ``r_j = rsqrt(mean(x_j^2) +
    eps)``, ``q = norm_weight * proj_weight``; output ``sum_j softmax(z)_j x_j``, in fp32 (fp64
    for fp64 candidates)."""

    @staticmethod
    def forward(ctx, norm_weight, proj_weight, eps: float, *candidates):
        wide = torch.promote_types(candidates[-1].dtype, torch.float32)
        query = norm_weight.to(wide) * proj_weight[0].to(wide)
        scores, inv_rms = [], []
        for candidate in candidates:
            x = candidate.to(wide)
            r = torch.rsqrt(x.pow(2).mean(-1) + eps)  # [s, b]
            inv_rms.append(r)
            scores.append(r * (x @ query))
        probs = torch.stack(scores).softmax(dim=0)  # [N, s, b]
        out = torch.zeros_like(candidates[-1], dtype=wide)
        for p, candidate in zip(probs, candidates):
            out += p.unsqueeze(-1) * candidate.to(wide)
        ctx.save_for_backward(norm_weight, proj_weight, probs, torch.stack(inv_rms), *candidates)
        return out.to(candidates[-1].dtype)

    @staticmethod
    def backward(ctx, grad_out):
        norm_weight, proj_weight, probs, inv_rms, *candidates = ctx.saved_tensors
        wide = probs.dtype
        query = norm_weight.to(wide) * proj_weight[0].to(wide)
        grad_out = grad_out.to(wide)
        xs = [c.to(wide) for c in candidates]
        grad_probs = torch.stack([(grad_out * x).sum(-1) for x in xs])  # [N, s, b]
        grad_scores = probs * (grad_probs - (probs * grad_probs).sum(0, keepdim=True))
        grad_query = torch.zeros_like(query)
        grads = []
        width = query.shape[0]
        for x, p, r, gz in zip(xs, probs, inv_rms, grad_scores):
            dot = x @ query  # [s, b]
            # d z / d x = r q - <x, q> r^3 x / h
            grad_x = (p.unsqueeze(-1) * grad_out + (gz * r).unsqueeze(-1) * query
                      - (gz * dot * r.pow(3) / width).unsqueeze(-1) * x)
            grads.append(grad_x)
            grad_query += ((gz * r).unsqueeze(-1) * x).reshape(-1, width).sum(0)
        grad_norm = (grad_query * proj_weight[0].to(wide)).to(norm_weight.dtype)
        grad_proj = (grad_query * norm_weight.to(wide)).unsqueeze(0).to(proj_weight.dtype)
        return (grad_norm, grad_proj, None,
                *(g.to(c.dtype) for g, c in zip(grads, candidates)))


class _Stream:
    """Where a layer's stream comes from and goes (see the module doc)."""

    def __init__(self, config: TransformerConfig, layer: int, block: int,
                 vp_stage: Optional[int]) -> None:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        local = get_num_layers_to_build(config, vp_stage=vp_stage)
        self.slots = stream_slots(config.num_layers, block)
        self.in_slots = 1 + bank_size(layer, block)
        # A stage's first layer gets the padded stream (layer 0 the embedding, one slot).
        self.padded_in = layer == offset and layer > 0
        self.padded_out = layer == offset + local - 1 and layer < config.num_layers - 1

    def unpack(self, stream: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        slots = self.slots if self.padded_in else self.in_slots
        if stream.shape[0] % slots:
            raise ValueError(f"an attention-residual stream of length {stream.shape[0]} does not "
                             f"hold {slots} slots")
        parts = stream.chunk(slots, dim=0)
        return parts[0], list(parts[1:self.in_slots])

    def pack(self, running_sum: torch.Tensor, bank: list[torch.Tensor]) -> torch.Tensor:
        parts = [running_sum, *bank]
        if self.padded_out:
            parts += [torch.zeros_like(running_sum)] * (self.slots - len(parts))
        return torch.cat(parts, dim=0)


def _add(output_with_bias, residual: Optional[torch.Tensor], dropout: float,
         training: bool) -> torch.Tensor:
    output, bias = output_with_bias
    if bias is not None:
        output = output + bias
    output = torch.nn.functional.dropout(output, p=dropout, training=training)
    return output if residual is None else residual + output


class AttnResTransformerLayer(TransformerLayer):
    """Megatron-Core's TransformerLayer (its attention, norms and MLP/MoE submodules, built by
    the spec) on the AttnRes stream: it adds the two mixes ``self_attention_res`` and
    ``mlp_res`` and replaces the residual additions. ``attn_res_block``: the block size."""

    def __init__(self, config: TransformerConfig, submodules, layer_number: int = 1,
                 hidden_dropout: Optional[float] = None, pg_collection=None,
                 vp_stage: Optional[int] = None, *, attn_res_block: int) -> None:
        super().__init__(config, submodules, layer_number=layer_number,
                         hidden_dropout=hidden_dropout, pg_collection=pg_collection,
                         vp_stage=vp_stage)
        index = self.layer_number - 1  # global, 0-based
        self.starts_block = index % attn_res_block == 0
        self.stream = _Stream(config, index, attn_res_block, vp_stage)
        eps = config.layernorm_epsilon
        self.self_attention_res = AttentionResidualMix(config, config.hidden_size, eps)
        self.mlp_res = AttentionResidualMix(config, config.hidden_size, eps)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, context=None,
                context_mask=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                inference_context=None, packed_seq_params=None, sequence_len_offset=None,
                padding_mask=None, **kwargs):
        running, bank = self.stream.unpack(hidden_states)
        rotary_pos_emb = self._rotary_for(rotary_pos_emb, running)
        h = self.self_attention_res(running, bank) if bank else running
        if self.starts_block:
            bank, running = [*bank, running], None
        attention = self.self_attention(
            self.input_layernorm(h), attention_mask=attention_mask,
            inference_context=inference_context, rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
            packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset)
        running = _add(attention, running, self.hidden_dropout, self.training)
        h = self.mlp_res(running, bank)
        mlp_input = self.pre_mlp_layernorm(h)
        if self.recompute_mlp:
            mlp = tensor_parallel.checkpoint(
                lambda x: self.mlp(x, padding_mask=padding_mask), False, mlp_input)
        else:
            mlp = self.mlp(mlp_input, padding_mask=padding_mask)
        running = _add(mlp, running, self.hidden_dropout, self.training)
        return self.stream.pack(running, bank), context


    def _rotary_for(self, rotary_pos_emb, running: torch.Tensor):
        """The rotary embedding of the sequence: a later pipeline stage's GPTModel sizes it by
        the length of the stream it received (all its slots); the first ``s`` positions are
        this sequence's."""
        if rotary_pos_emb is None:
            return None
        length = running.shape[0] * (self.config.tensor_model_parallel_size
                                     if self.config.sequence_parallel else 1)
        if isinstance(rotary_pos_emb, tuple):
            return tuple(r[:length] for r in rotary_pos_emb)
        return rotary_pos_emb[:length]


class AttnResOutput(MegatronModule):
    """The decoder's final norm of an AttnRes model: ``norm(Mix(sum, bank; output_attn_res))``
    of the last layer's stream (built where the block builds its final layer norm;
    ``norm``: the spec of that norm)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float, *, norm,
                 attn_res_block: int) -> None:
        super().__init__(config=config)
        self.attn_res = AttentionResidualMix(config, hidden_size, eps)
        self.norm = build_module(norm, config=config, hidden_size=hidden_size, eps=eps)
        self.slots = 1 + bank_size(config.num_layers, attn_res_block)

    def forward(self, stream: torch.Tensor) -> torch.Tensor:
        running, *bank = stream.chunk(self.slots, dim=0)
        return self.norm(self.attn_res(running, bank))


def with_attention_residuals(block_spec: TransformerBlockSubmodules,
                             attn_res_block: int) -> TransformerBlockSubmodules:
    """A decoder block spec whose layers run on the AttnRes stream (``AttnResTransformerLayer``
    with the same submodules) and whose final norm mixes the stream first (``AttnResOutput``
    around the same norm)."""
    layers = [ModuleSpec(module=AttnResTransformerLayer, submodules=spec.submodules,
                         params={**(spec.params or {}), "attn_res_block": attn_res_block})
              for spec in block_spec.layer_specs]
    output = ModuleSpec(module=AttnResOutput, params={"norm": block_spec.layer_norm,
                                                      "attn_res_block": attn_res_block})
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=output)


def pipeline_seq_length(model: torch.nn.Module, seq_length: int) -> int:
    """The sequence length Megatron's pipeline schedules must be given for ``model`` (a model
    chunk of this rank) at ``seq_length`` tokens: an AttnRes model's stages hand over the stream
    of ``stream_slots`` slots; any other model its hidden states."""
    for module in model.modules():
        if isinstance(module, AttnResTransformerLayer):
            return seq_length * module.stream.slots
    return seq_length
