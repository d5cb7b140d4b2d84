"""Peak memory of one rank of a LoRA fine-tune, by component, for every pipeline stage.

``estimate_memory(shape, settings, device)`` returns a ``MemoryEstimate``: one ``StageMemory`` per
pipeline stage (the peak rank is the largest) with

* ``weights``: the frozen base weights by dtype (norm weights stay fp32 in bf16 runs: Megatron's
  torch norms are built without the params dtype and our trainer adds no Float16Module). Attention,
  dense and shared-expert MLPs and the vocabulary are split over TP, routed experts over EP,
  router and latent projections are replicated; the embedding lives on the first stage, the output
  layer on the last; routed experts held packed (``--expert-weights packed``) count their packed
  bytes (``ModelShape.packed_expert_bytes``) plus the decode scratch the device's kernel holds
  (``packed_scratch_bytes``: on CUDA, and on an NPU with the AscendC build, a chunk of experts
  up to 256 MiB);
* ``lora_params``: the adapters, in the dtype of the weight they adapt (the routed experts' at
  their own rank and layout, ``plan.adapter_state``);
* ``grad_buffers``: Megatron DDP's contiguous gradient buffers, fp32 (``grad_reduce_in_fp32``) for
  the trainable parameters only (with the distributed optimizer the parameters move into DDP's
  parameter buffer, which replaces their storage and costs nothing extra);
* ``optimizer``: Adam's two fp32 moments, plus the fp32 main copy of each 16-bit parameter
  (Megatron's mixed-precision optimizer); divided over the data-parallel ranks of each parameter
  (dense: dp, expert: tp * dp / ep) with the distributed optimizer;
* ``activations`` and ``moe_rows``: what autograd keeps for backward, per micro-batch, times the
  micro-batches in flight (1F1B: ``min(pp - stage, micro-batches)``); ``moe_rows`` is the expert
  side, at the routed row count with the imbalance (and capacity) of the busiest rank;
* ``transient``: the working set on top at the worst moment of the step (the loss's logits, one
  layer's backward and its all-to-all buffers, a recomputed layer);
* ``framework_overhead`` and ``fragmentation`` of the device (see ``megatron_slmoe.plan.devices``).

An image-text run (``settings.vision``) adds its vision tower and projector to the first stage:
weights, adapters on them, what they keep for backward and their forward working set
(``megatron_slmoe.plan.vision``; LLaVAModel's, or a Hugging Face checkpoint's own tower, which
is there in a text run too).

Kimi K3's blocks (a model file's ``blocks``): a Kimi Delta Attention layer keeps its projections,
convolution inputs and outputs, the decay and beta, the chunked core's per-chunk states and
matrices and its gated norm's inputs (``_kda_attention``); gated NoPE MLA keeps MLA's compressed
q and kv, q/k/v, the probabilities and the output gate (``_mla_attention``); with Attention
Residuals every layer keeps its input stream (the running sum and the bank so far, up to
``shape.stream_slots`` hidden states) and each mix its candidates in fp32 (``_attention_residuals``).

What is saved for backward follows Megatron-Core's local (non-TransformerEngine) layers that
``megatron_slmoe.moe.specs`` builds, with frozen base weights, LoRA on the targets, unfused
attention (it keeps the softmax probabilities, S^2 per head), sequence parallelism with TP. Each
rule is written next to the tensors it counts; the benchmark ``tools/bench/plan_accuracy.py``
measures the whole against real runs.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field

from megatron_slmoe.plan._sources import (
    PACKED_SCRATCH_BYTES,
    cpu_threads,
    decode_chunk_bytes,
    expected_rows_per_destination,
)
from megatron_slmoe.plan.adapter_state import ExpertDims, expert_adapter_count
from megatron_slmoe.plan.devices import DeviceSpec
from megatron_slmoe.plan.model_shape import (
    ModelShape,
    census,
    expert_parameters,
    embedding_parameters,
    layer_parameters,
    output_parameters,
)
from megatron_slmoe.plan.settings import DTYPES, RunSettings
from megatron_slmoe.plan.vision import (
    ReplicatedTower,
    tower_activations,
    vision_activations,
    vision_lora_parameters,
    vision_weights,
)

_FP32 = 4
_INT64 = 8

COMPONENTS = ("weights", "lora_params", "grad_buffers", "optimizer", "activations", "moe_rows",
              "transient", "framework_overhead", "fragmentation")
"""The parts of a rank's peak, in the order reports list them."""


@dataclass(frozen=True)
class StageMemory:
    stage: int
    layers: tuple[int, int]
    """First and one-past-last layer index of this stage."""
    weights_by_dtype: dict[str, int]
    lora_params: int
    grad_buffers: int
    optimizer: int
    activations: int
    moe_rows: int
    transient: int
    transient_event: str
    """Which moment of the step the transient belongs to (loss, moe backward, ...)."""
    in_flight: int
    """Micro-batches whose activations are held at the peak."""
    framework_overhead: int
    fragmentation: int
    trainable_params: int

    @property
    def weights(self) -> int:
        return sum(self.weights_by_dtype.values())

    @property
    def peak(self) -> int:
        return sum(self.component(name) for name in COMPONENTS)

    def component(self, name: str) -> int:
        return getattr(self, name)

    def breakdown(self) -> dict[str, int]:
        return {name: self.component(name) for name in COMPONENTS}

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(weights=self.weights, peak=self.peak)
        return data


@dataclass(frozen=True)
class MemoryEstimate:
    stages: tuple[StageMemory, ...]
    weights_bytes_total: int
    """The whole model's base weights (all ranks together, no replicas)."""
    notes: tuple[str, ...] = field(default=())

    @property
    def peak_stage(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.peak)

    @property
    def peak_bytes(self) -> int:
        return self.peak_stage.peak


# --- static: weights, adapters, gradients, optimizer ---------------------------------------------


def _stage_layers(shape: ModelShape, settings: RunSettings, stage: int) -> range:
    per_stage = shape.num_layers // settings.pp
    return range(stage * per_stage, (stage + 1) * per_stage)


@functools.lru_cache(maxsize=4096)
def _dense_layer_weights(shape: ModelShape, settings: RunSettings, moe: bool,
                         kda: bool = False) -> tuple[int, int]:
    """(16-bit-or-run-dtype parameters, fp32 norm parameters) of one layer on one rank; the
    Attention-Residual mixes are replicated, the router's bias is a buffer (``_static``)."""
    counts = layer_parameters(shape, moe, kda)
    tp, ep = settings.tp, settings.ep
    run_dtype = counts["attention"] // tp + counts.get("attention_residuals", 0)
    if moe:
        run_dtype += (counts["router"] + counts["latent"] + counts["routed_experts"] // ep
                      + counts["shared_experts"] // tp)
    else:
        run_dtype += counts["dense_mlp"] // tp
    return run_dtype, counts["norms"]


def _attention_inputs(shape: ModelShape, kda: bool = False) -> list[tuple[int, int]]:
    """(in, out) of each attention input projection (column-parallel): the fused q/k/v, or
    multi-latent attention's q (or q down + up) and kv down + up (and gated NoPE MLA's output
    gate), or KDA's q, k, v, g, b and f_b (its f_a: ``_kda_replicated_input``)."""
    if kda:
        d, p, k = shape.hidden, shape.kda.width, shape.kda.head_dim
        return [(d, p)] * 4 + [(d, shape.kda.heads), (k, p)]
    if shape.mla is None:
        return [(shape.hidden, (shape.heads + 2 * shape.query_groups) * shape.kv_channels)]
    m, d, h = shape.mla, shape.hidden, shape.heads
    q_out = h * m.q_head_dim
    q = [(d, q_out)] if m.q_lora_rank is None else [(d, m.q_lora_rank), (m.q_lora_rank, q_out)]
    gate = [(d, shape.attention_width)] if shape.gated_mla else []
    return q + [(d, m.kv_lora_rank + m.qk_pos_emb_head_dim),
                (m.kv_lora_rank, h * (m.qk_head_dim + m.v_head_dim))] + gate


@functools.lru_cache(maxsize=4096)
def lora_layer_params(shape: ModelShape, settings: RunSettings, moe: bool,
                      kda: bool = False) -> tuple[int, int]:
    """(dense LoRA parameters, expert LoRA parameters) of one layer on one rank. The routed
    experts' adapter is ``plan.adapter_state``'s at their own rank and layout: this rank's 1/ep
    of the experts' own factors; shared-outer factors, replicated over expert parallelism and
    reduced like a dense parameter, count as dense."""
    r, tp, d = settings.lora_rank, settings.tp, shape.hidden
    targets = set(settings.lora_targets)
    dense = 0
    if "linear_qkv" in targets:  # per projection: A [r, in] replicated, B [out/tp, r]
        dense += sum(r * n_in + n_out // tp * r for n_in, n_out in _attention_inputs(shape, kda))
        if kda:  # f_a (d -> K) is whole on every rank: A [r, d], B [K, r]
            dense += r * d + shape.kda.head_dim * r
    if "linear_proj" in targets:  # A [r, hc/tp], B [d, r]
        width = shape.kda.width if kda else shape.attention_width
        dense += r * width // tp + d * r
    fc1_out = 2 if shape.gated else 1
    if not moe:
        if "linear_fc1" in targets:
            dense += r * d + fc1_out * shape.ffn_hidden // tp * r
        if "linear_fc2" in targets:
            dense += r * shape.ffn_hidden // tp + d * r
        return dense, 0
    if "router" in targets:
        dense += r * d + shape.experts * r
    if "latent" in targets and shape.latent:
        dense += 2 * (r * d + shape.latent * r)
    if "shared_experts" in targets and shape.shared_ffn:
        dense += r * d + fc1_out * shape.shared_ffn // tp * r + r * shape.shared_ffn // tp + d * r
    fc1, fc2 = "linear_fc1" in targets, "linear_fc2" in targets
    if not (fc1 or fc2):
        return dense, 0
    count = expert_adapter_count(
        ExpertDims(1, shape.experts, shape.expert_width, shape.expert_ffn, shape.gated),
        settings.expert_rank(shape), settings.expert_lora_layout, fc1=fc1, fc2=fc2)
    return dense + count.shared_per_layer, count.per_expert * (shape.experts // settings.ep)


def _static(shape: ModelShape, settings: RunSettings, stage: int) -> dict:
    b = settings.element_size
    layers = _stage_layers(shape, settings, stage)
    run_dtype = norms = lora_dense = lora_expert = buffers = 0
    for index in layers:
        moe, kda = shape.moe_layers[index], shape.is_kda(index)
        w, n = _dense_layer_weights(shape, settings, moe, kda)
        run_dtype, norms = run_dtype + w, norms + n
        ld, le = lora_layer_params(shape, settings, moe, kda)
        lora_dense, lora_expert = lora_dense + ld, lora_expert + le
        if moe:
            buffers += 2 * shape.experts * _FP32  # expert bias and its token count (router)
    first, last = stage == 0, stage == settings.pp - 1
    if first:
        run_dtype += embedding_parameters(shape) // settings.tp
    if first and isinstance(settings.vision, ReplicatedTower):  # a checkpoint's own tower
        run_dtype += settings.vision.parameters
        lora_dense += settings.vision.lora_parameters
    elif first and settings.vision is not None:  # LLaVAModel's tower and projector
        w, n = vision_weights(settings.vision, shape.hidden, settings.tp)
        run_dtype, norms = run_dtype + w, norms + n
        lora_dense += vision_lora_parameters(settings.vision, shape.hidden, settings.lora_targets,
                                             settings.lora_rank, settings.tp)
    if last:
        norms += shape.hidden * shape.norm_params
        if shape.attention_residual_block:
            run_dtype += 2 * shape.hidden  # the output mix
        # A tied output weight is a second copy on the last stage when it is not the first.
        out = output_parameters(shape) or (shape.vocab * shape.hidden if not first else 0)
        run_dtype += out // settings.tp
    trainable = lora_dense + lora_expert
    zero = settings.zero_stage

    def sharded(dense: float, expert: float) -> int:
        """Bytes over data parallelism: dense parameters over dp, expert ones over expert dp."""
        return int(dense // settings.dp + expert // settings.expert_dp)

    lora_bytes = trainable * b if zero < 3 else sharded(lora_dense * b, lora_expert * b)
    grad_buffers = trainable * _FP32 if zero < 2 else sharded(lora_dense * _FP32,
                                                              lora_expert * _FP32)
    # Adam moments (fp32), plus an fp32 main copy of 16-bit parameters.
    per_param = 2 * _FP32 + (_FP32 if b < _FP32 else 0)
    if zero >= 1:
        optimizer = sharded(per_param * lora_dense, per_param * lora_expert)
    else:
        optimizer = per_param * trainable
    expert_weights = _expert_weight_elements(shape, settings, layers)
    expert_bytes = expert_weights * b
    if settings.experts_packed(shape) and expert_weights:
        # Packed values and scales (the decoded scratch is the device's: _stage_scratch).
        expert_bytes = int(expert_weights * shape.packed_expert_bytes)
    weights = (run_dtype - expert_weights) * b + expert_bytes
    if zero == 3:  # the frozen base too: each rank keeps its share (experts' over expert dp)
        weights = sharded((run_dtype - expert_weights) * b, expert_bytes)
    return {
        "weights_by_dtype": _by_dtype((settings.dtype, weights),
                                      ("fp32", norms * _FP32 + buffers)),
        "lora_params": lora_bytes, "grad_buffers": grad_buffers, "optimizer": optimizer,
        "trainable_params": trainable,
    }


def stage_adapter_state_bytes(shape: ModelShape, settings: RunSettings) -> int:
    """The LoRA weights, gradients and optimizer state of the rank with the most of them (over
    pipeline stages)."""
    return max(sum(_static(shape, settings, stage)[name]
                   for name in ("lora_params", "grad_buffers", "optimizer"))
               for stage in range(settings.pp))


def stage_weight_bytes(shape: ModelShape, settings: RunSettings, device: DeviceSpec) -> int:
    """The frozen base weights of the rank with the most of them (over pipeline stages), packed
    experts' decode scratch included."""
    return max(sum(_static(shape, settings, stage)["weights_by_dtype"].values())
               + _stage_scratch(shape, settings, stage, device) for stage in range(settings.pp))


def _stage_scratch(shape: ModelShape, settings: RunSettings, stage: int,
                   device: DeviceSpec) -> int:
    """The packed experts' decode scratch of ``stage``'s ranks: 0 without packed experts there."""
    layers = _stage_layers(shape, settings, stage)
    if not (settings.experts_packed(shape) and _expert_weight_elements(shape, settings, layers)):
        return 0
    return packed_scratch_bytes(shape, settings, device)


def packed_scratch_bytes(shape: ModelShape, settings: RunSettings, device: DeviceSpec) -> int:
    """The largest decoded scratch one call of the packed expert op holds (one projection, fc1 or
    fc2, of this rank's experts; freed with the call, the backward's as large), in the run's dtype,
    as the device's kernel holds it:

    * cuda: the experts of one chunk, as many as fit in ``PACKED_SCRATCH_BYTES`` (at least one, at
      most the rank's experts; csrc/packed_scratch.h), allocated whole whatever the routing;
    * cpu: one tile per intra-op thread that runs an expert (csrc/cpu/lora_expert_packed.cpp), so
      at most min(threads, experts), and in bf16/fp16 the backward's transposed copy of it
      (``dx_operand`` in csrc/lora_expert_aten.h: ATen's CPU GEMM is slow the other way);
    * npu: in bf16/fp16, the larger of the AscendC binding's chunk (the CUDA rule and cap:
      csrc/ascendc/lora_expert_npu.cpp, on a build with CANN) and the pure-torch twin's
      (``ops.lora_expert.packed_grouped_fwd``, what an NPU runs without that build): one tile the
      call decodes every expert into, plus the intermediates of one decode step
      (``ops.quantized_weights.decode_chunk_bytes``: a few MiB; block-FP8 steps are 128 rows).
      The plan is for a device, not for the build on the planning host, so it cannot know which
      of the two runs there and prices the one that holds more. In fp32 both hold the tile and a
      step (the binding decodes fp32 with ATen ops, in the twin's steps)."""
    experts = shape.experts // settings.ep
    fc1_out = shape.expert_ffn * (2 if shape.gated else 1)
    tiles = [out * inp * settings.element_size for out, inp in (
        (fc1_out, shape.expert_width), (shape.expert_width, shape.expert_ffn))]
    kernel_chunk = max(_cuda_chunk(experts, tile) * tile for tile in tiles)
    if device.kind == "cuda":
        return kernel_chunk
    if device.kind == "cpu":
        per_thread = 1 if settings.element_size == 4 else 2
        return min(cpu_threads(), experts) * max(tiles) * per_thread
    block_rows = 128 if shape.packed_expert_bytes >= 1 else 1  # 8-bit: block FP8's 128 rows
    twin = max(tiles) + max(decode_chunk_bytes(out, inp, block_rows) for out, inp in (
        (fc1_out, shape.expert_width), (shape.expert_width, shape.expert_ffn)))
    if settings.element_size == 4:  # fp32: the binding's ATen decode, as the twin's
        return twin
    return max(twin, kernel_chunk)


def _cuda_chunk(experts: int, tile: int) -> int:
    """Experts the CUDA (and AscendC) packed kernel decodes at once
    (``slmoe::packed_scratch_experts``)."""
    return max(1, min(experts, PACKED_SCRATCH_BYTES // max(1, tile)))


def _expert_weight_elements(shape: ModelShape, settings: RunSettings, layers) -> int:
    """This rank's routed-expert weight elements over ``layers`` (its EP share)."""
    return sum(shape.experts // settings.ep * expert_parameters(shape)
               for index in layers if shape.moe_layers[index])


def zero3_gather_bytes(shape: ModelShape, settings: RunSettings) -> int:
    """ZeRO-3's transient: the largest layer's weights of this rank's share gathered whole for
    its forward or backward, and the next one prefetched (Megatron-FSDP's unit: one layer)."""
    if settings.zero_stage < 3:
        return 0
    b = settings.element_size
    largest = 0
    for moe, kda in set(shape.layer_kinds):
        w, _ = _dense_layer_weights(shape, settings, moe, kda)
        experts = shape.experts // settings.ep * expert_parameters(shape) if moe else 0
        # Only what is sharded is gathered: dense weights over dp, expert ones over expert dp.
        gathered = ((w - experts) if settings.dp > 1 else 0) + (
            experts if settings.expert_dp > 1 else 0)
        largest = max(largest, gathered * b)
    return 2 * largest


def _by_dtype(*items: tuple[str, int]) -> dict[str, int]:
    result: dict[str, int] = {}
    for dtype, nbytes in items:
        result[dtype] = result.get(dtype, 0) + nbytes
    return result


# --- activations ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tokens:
    """Token counts of one micro-batch on one rank."""

    seq: int
    full: int
    """T = seq x micro-batch: what a TP rank sees inside attention and column-parallel linears."""
    sharded: int
    """T / tp: the sequence-parallel shard (norms, router, residual stream)."""
    rows_sent: float
    """(token, expert) pairs this rank dispatches."""
    rows_received: float
    """Expert rows the busiest expert-parallel rank receives (imbalance and capacity)."""
    pairs_sent: float
    """Token rows this rank sends: one per (token, rank holding one of its experts)."""


@functools.lru_cache(maxsize=4096)
def _tokens(shape: ModelShape, settings: RunSettings) -> _Tokens:
    full = settings.seq_length * settings.micro_batch_size
    sharded = full // settings.tp
    routed = sharded * shape.topk
    factor = shape.capacity_factor
    if factor is not None:
        capacity_rows = shape.experts * -(-sharded * shape.topk * factor // shape.experts)
        sent = capacity_rows if shape.pad_to_capacity else min(routed, capacity_rows)
    else:
        sent = routed
    imbalance = settings.moe_imbalance if settings.ep > 1 else 1.0
    if factor is not None:
        imbalance = factor if shape.pad_to_capacity else min(imbalance, factor)
    pairs = 0.0
    if shape.experts:
        pairs = sharded * settings.ep * expected_rows_per_destination(
            shape.experts, shape.topk, settings.ep, shape.router_groups or 0,
            shape.router_group_topk or 0)
    return _Tokens(settings.seq_length, full, sharded, float(sent), routed * imbalance, pairs)


def _norm(shape: ModelShape, tokens: int) -> int:
    """A torch RMSNorm/LayerNorm keeps its input in fp32 (a copy in 16-bit runs) and an fp32
    rsqrt per token."""
    return (_FP32 * shape.hidden + _FP32) * tokens


def _attention(shape: ModelShape, s: RunSettings, t: _Tokens, input_needs_grad: bool) -> int:
    b, r, tp = s.element_size, s.lora_rank, s.tp
    heads, groups, c = shape.heads // tp, shape.query_groups // tp, shape.kv_channels
    total = _norm(shape, t.sharded) if input_needs_grad else 0
    if "linear_qkv" in s.lora_targets:
        total += (shape.hidden + r) * b * t.full  # LoRA A's input is the SP-gathered input
    total += 4 * t.seq * c * b  # rotary cos/sin for q and k
    if s.recompute == "full" or s.recomputes("core_attn"):
        total += (heads + 2 * groups) * c * b * t.full  # checkpoint inputs q, k, v
    else:
        # q, and k, v expanded to every head (a view of the fused qkv output without GQA).
        v_width = heads if groups < heads else heads + 2 * groups
        total += (2 * heads + v_width) * c * b * t.full
        # softmax probabilities, fp32, and their 16-bit copy for the context bmm; causal mask.
        probs = _FP32 + (b if b < _FP32 else 0)
        total += heads * t.seq * t.full * probs + t.seq * t.seq
    if "linear_proj" in s.lora_targets:
        total += heads * c * b * t.full + r * b * t.sharded
    return total + _norm(shape, t.sharded)  # pre-MLP norm


def _mla_attention(shape: ModelShape, s: RunSettings, t: _Tokens, input_needs_grad: bool) -> int:
    """Gated NoPE MLA (no rotation): the q and kv LoRA norms' fp32 inputs, q and k (nope + rope
    dims, k_pe broadcast to every head) and v, the probabilities as ``_attention``'s, the context
    and the output gate's sigmoid (both kept for their product); LoRA's inputs (the layer input,
    the normed q and kv latents) and r per adapted projection."""
    b, r, tp, m = s.element_size, s.lora_rank, s.tp, shape.mla
    heads = shape.heads // tp
    total = _norm(shape, t.sharded) if input_needs_grad else 0
    q_rank = m.q_lora_rank or 0
    total += (q_rank + m.kv_lora_rank) * _FP32 * t.full  # the LoRA norms' fp32 inputs
    if "linear_qkv" in s.lora_targets:
        total += (shape.hidden + q_rank + m.kv_lora_rank) * b * t.full
        total += r * len(_attention_inputs(shape)) * b * t.full
    qkv = heads * (2 * m.q_head_dim + m.v_head_dim)
    if s.recompute == "full" or s.recomputes("core_attn"):
        total += qkv * b * t.full
    else:
        probs = _FP32 + (b if b < _FP32 else 0)
        total += qkv * b * t.full + heads * t.seq * t.full * probs + t.seq * t.seq
    total += 2 * heads * m.v_head_dim * b * t.full  # context and the gate's sigmoid
    if "linear_proj" in s.lora_targets:
        total += heads * m.v_head_dim * b * t.full + r * b * t.sharded
    return total + _norm(shape, t.sharded)  # pre-MLP norm


def kda_chunk_states(shape: ModelShape, s: RunSettings) -> int:
    """Bytes of one KDA layer's per-chunk states on one rank for one micro-batch: the state
    [H/tp, K, K] fp32 entering each chunk of 64 tokens (the chunked core keeps them for
    backward; the fused kernel recomputes them there, a transient of the same size)."""
    k = shape.kda
    chunks = -(-s.seq_length // KDA_CHUNK)
    return chunks * s.micro_batch_size * k.heads // s.tp * k.head_dim * k.head_dim * _FP32


KDA_CHUNK = 64
"""Tokens per chunk of KDA's chunked core (ops.kda.CHUNK_SIZE, fla's chunk_kda)."""


def kda_generation_state(shape: ModelShape, dtype_bytes: int = 2) -> int:
    """Bytes one sequence's KDA layers hold while generating (whole model, no parallelism): per
    layer the recurrent state [H, K, K] fp32 and the causal convolutions' last ``kernel - 1``
    inputs of q, k and v (fp32: model.kda_attention keeps its conv state in fp32)."""
    if shape.kda is None:
        return 0
    k = shape.kda
    per_layer = k.heads * k.head_dim * k.head_dim * _FP32 + 3 * k.width * (k.conv_kernel - 1) * _FP32
    return sum(shape.kda_layers) * per_layer


def _kda_attention(shape: ModelShape, s: RunSettings, t: _Tokens, input_needs_grad: bool) -> int:
    """Kimi Delta Attention (heads over TP, so every per-head tensor is T x P/tp): q, k, v's
    projection outputs (the convolutions' inputs), the convolutions' outputs (SiLU's inputs),
    the L2-normalised q, k and v the core reads; fp32 decay g (P) and beta (H); the core's
    output (fp32) with its norm's rsqrt, the output gate's sigmoid; per chunk its [C, C] score
    matrices (two, fp32, per head) and the state entering it (``kda_chunk_states``); LoRA's
    input (and f_a's output, f_b's input) and r per adapted projection."""
    b, r, tp, k = s.element_size, s.lora_rank, s.tp, shape.kda
    p, heads = k.width // tp, k.heads // tp
    total = _norm(shape, t.sharded) if input_needs_grad else 0
    if "linear_qkv" in s.lora_targets:
        total += (shape.hidden + k.head_dim + 7 * r) * b * t.full
    total += 9 * p * b * t.full  # projections, conv outputs, normalised q, k, v
    total += (p + heads) * _FP32 * t.full  # decay and beta
    total += (p + heads) * _FP32 * t.full + p * b * t.full  # core output, rsqrt, gate
    total += 2 * KDA_CHUNK * heads * _FP32 * t.full + kda_chunk_states(shape, s)
    if "linear_proj" in s.lora_targets:
        total += p * b * t.full + r * b * t.sharded
    return total + _norm(shape, t.sharded)  # pre-MLP norm


def _attention_residuals(shape: ModelShape, s: RunSettings, t: _Tokens, layer: int) -> int:
    """Attention Residuals at layer ``layer``: autograd keeps the layer's input stream (the
    running sum and the bank vectors entering it, ``1 + ceil(layer / block)`` hidden states, as
    model.attention_residuals says) and each mix its stacked candidates in fp32 (the attention
    mix over the bank and the sum when there is a bank; the MLP mix over the bank, with the
    block's new vector, and the sum)."""
    block = shape.attention_residual_block
    if not block:
        return 0
    bank = -(-layer // block)
    after = bank + (1 if layer % block == 0 else 0)
    candidates = (bank + 1 if bank else 0) + after + 1
    d = shape.hidden
    return ((1 + bank) * d * s.element_size + candidates * (d + 1) * _FP32) * t.sharded


def _dense_mlp(shape: ModelShape, s: RunSettings, t: _Tokens) -> int:
    b = s.element_size
    if s.recomputes("mlp"):
        return shape.hidden * b * t.sharded  # checkpoint input
    return _mlp_saved(shape.ffn_hidden // s.tp, "linear_fc1" in s.lora_targets,
                      "linear_fc2" in s.lora_targets, shape, s, t)


def _mlp_saved(ffn: int, lora_fc1: bool, lora_fc2: bool, shape: ModelShape, s: RunSettings,
               t: _Tokens) -> int:
    """A Megatron MLP with frozen weights: SwiGLU keeps fc1's output (2F), glu's x_linear + 0 (F)
    and silu's output (F), SiTU-GLU its input alone (2F); LoRA adds its input and r per token for fc1 and fc2."""
    b, r = s.element_size, s.lora_rank
    total = (shape.glu_saved * ffn if shape.gated else ffn) * b * t.full
    if lora_fc1:
        total += (shape.hidden + r) * b * t.full
    if lora_fc2:
        total += ffn * b * t.full + r * b * t.sharded
    return total


def _moe_dense_side(shape: ModelShape, s: RunSettings, t: _Tokens) -> int:
    """What an MoE layer keeps outside the expert rows: router, latent, indices, shared expert."""
    b, r, d = s.element_size, s.lora_rank, shape.hidden
    if s.recomputes("moe"):
        return d * b * t.sharded  # checkpoint input (the pre-MLP norm output)
    # Router: its input, fp32 scores (three uses), top-k indices and sums.
    total = (d * b + 3 * _FP32 * shape.experts + (2 * _INT64 + _FP32) * shape.topk
             + 2 * _FP32) * t.sharded
    if shape.router_groups:
        total += 2 * _FP32 * shape.router_groups * t.sharded  # group scores and mask
    if "router" in s.lora_targets:
        total += r * _FP32 * t.sharded
    if "latent" in s.lora_targets and shape.latent:
        total += (r + shape.latent + r) * b * t.sharded  # down: r (input is the router's); up
    # The all-to-all's indices: (token, expert) of every pair sent and their send order, the
    # token of every row sent, and where each received expert row and probability come from.
    total += 3 * _INT64 * t.rows_sent + _INT64 * t.pairs_sent + 2 * _INT64 * t.rows_received
    if shape.shared_ffn:
        total += _mlp_saved(shape.shared_ffn // s.tp, "shared_experts" in s.lora_targets,
                            "shared_experts" in s.lora_targets, shape, s, t)
    return total


def _moe_rows(shape: ModelShape, s: RunSettings, t: _Tokens) -> int:
    """Expert side per received row: fc1's input (and r with LoRA), fc1's output, SwiGLU's SiLU
    and product (2f + f + f; the product is fc2's input), the router probability, and r for fc2's
    LoRA (whose op scales its output by the probability) or, without it, the probability-scaled
    activation the plain fc2 keeps."""
    if s.recomputes("moe"):
        return 0
    b, r, f, width = s.element_size, s.expert_rank(shape), shape.expert_ffn, shape.expert_width
    per_row = width + shape.glu_saved * f + 1
    per_row += r if "linear_fc1" in s.lora_targets else 0
    per_row += r if "linear_fc2" in s.lora_targets else f
    return int(per_row * b * t.rows_received)


def _loss(shape: ModelShape, s: RunSettings, t: _Tokens) -> int:
    """Final norm and the fp32 logits the vocab-parallel cross entropy keeps (with mask and
    labels)."""
    return _norm(shape, t.sharded) + shape.vocab // s.tp * _FP32 * t.full + 9 * t.full


@dataclass(frozen=True)
class _LayerActivations:
    dense: int
    """Kept for backward outside the expert rows."""
    rows: int
    """Kept for backward on the expert side."""
    backward_extra: int
    """The most this layer's backward adds on top of what every layer keeps: recomputed
    activations and gradients, less what its own finished parts have freed."""


def _attention_block(shape: ModelShape, s: RunSettings, t: _Tokens, input_needs_grad: bool,
                     kda: bool) -> int:
    if kda:
        return _kda_attention(shape, s, t, input_needs_grad)
    if shape.gated_mla:
        return _mla_attention(shape, s, t, input_needs_grad)
    return _attention(shape, s, t, input_needs_grad)


@functools.lru_cache(maxsize=4096)
def _layer(shape: ModelShape, s: RunSettings, t: _Tokens, moe: bool,
           input_needs_grad: bool, kda: bool = False, index: int = 0) -> _LayerActivations:
    b = s.element_size
    plain = s.replace(recompute="none")
    attention = (_attention_block(shape, s, t, input_needs_grad, kda)
                 + _attention_residuals(shape, s, t, index))
    mlp = _moe_dense_side(shape, s, t) if moe else _dense_mlp(shape, s, t)
    rows = _moe_rows(shape, s, t) if moe else 0
    if s.recompute == "full":  # only the layer input (the whole stream with AttnRes)
        slots = 1 + -(-index // shape.attention_residual_block) if (
            shape.attention_residual_block) else 1
        attention, mlp, rows = slots * shape.hidden * b * t.sharded, 0, 0
    # What each half brings back when recomputed (the full layer: both halves at once).
    attention_again = (_attention_block(shape, plain, t, input_needs_grad, kda)
                       if s.recompute == "full" or s.recomputes("core_attn") else 0)
    mlp_again = 0
    if s.recompute == "full" or (moe and s.recomputes("moe")) or (not moe and s.recomputes("mlp")):
        mlp_again = (_moe_dense_side(shape, plain, t) + _moe_rows(shape, plain, t) if moe
                     else _dense_mlp(shape, plain, t))
    if s.recompute == "full":
        attention_again = (_attention_block(shape, plain, t, input_needs_grad, kda)
                           + _attention_residuals(shape, plain, t, index))
        mlp_again += attention_again  # checkpointed as one layer
    # Backward of the MLP half first: gradients of the expert internals (fc1's output and the
    # activation) and the exchanged gradient rows both ways.
    mlp_work = 0
    if moe:
        f, width = shape.expert_ffn, shape.expert_width
        mlp_work = int((3 * f + width) * b * t.rows_received + width * b * t.pairs_sent)
    # Then attention: fp32 gradients of the softmax probabilities and scores; by then the MLP
    # half's own activations are freed.
    heads = shape.heads // s.tp
    attention_work = heads * t.seq * t.full * 2 * _FP32
    if kda:  # no S^2 scores: the chunk matrices' and the chunk states' gradients
        attention_work = (2 * KDA_CHUNK * shape.kda.heads // s.tp * _FP32 * t.full
                          + kda_chunk_states(shape, s))
    freed = 0 if s.recompute == "full" else mlp + rows
    extra = max(mlp_again + mlp_work, attention_again + attention_work - freed)
    return _LayerActivations(attention + mlp, rows, max(0, extra))


def _stage_activations(shape: ModelShape, s: RunSettings, stage: int) -> dict:
    t = _tokens(shape, s)
    layers = [
        _layer(shape, s, t, shape.moe_layers[i],
               input_needs_grad=not (i == 0 and s.recompute == "none"), kda=shape.is_kda(i),
               index=i if shape.attention_residual_block else 0)
        for i in _stage_layers(shape, s, stage)
    ]
    last = stage == s.pp - 1
    loss = _loss(shape, s, t) if last else 0
    dense = sum(layer.dense for layer in layers) + loss
    rows = sum(layer.rows for layer in layers)
    in_flight = min(s.pp - stage, s.num_microbatches)
    # The worst moment on top of the held activations: the loss of the last micro-batch (its
    # 16-bit logits beside the fp32 copy), one layer's backward, or the vision tower's forward.
    # A decoder layer's backward starts after the output layer's, which freed the logits: the
    # loss's bytes are not held beside it (measured: tools/bench/realistic.py, README).
    events = {"backward": max(0, max(layer.backward_extra for layer in layers) - loss)}
    if stage == 0 and isinstance(s.vision, ReplicatedTower):
        kept, working = tower_activations(
            s.vision, s.vision.patches(s.seq_length, s.micro_batch_size), s.lora_rank,
            s.element_size)
        dense += kept
        events["vision forward"] = working
    elif stage == 0 and s.vision is not None:
        kept, working = vision_activations(s.vision, shape.hidden, s.lora_targets, s.lora_rank,
                                           s.tp, s.micro_batch_size, s.element_size)
        dense += kept
        events["vision forward"] = working
    if last and s.element_size < _FP32:
        events["loss"] = shape.vocab // s.tp * s.element_size * t.full
    transient_event, transient = max(events.items(), key=lambda kv: kv[1])
    return {"activations": in_flight * dense, "moe_rows": in_flight * rows,
            "in_flight": in_flight, "transient": transient,
            "transient_event": transient_event}


# --- the estimate -----------------------------------------------------------------------------


def estimate_memory(shape: ModelShape, settings: RunSettings, device: DeviceSpec) -> MemoryEstimate:
    """Per-stage peak memory of one rank (the settings must be valid for the shape)."""
    stages = []
    for stage in range(settings.pp):
        static = _static(shape, settings, stage)
        scratch = _stage_scratch(shape, settings, stage, device)
        static["weights_by_dtype"] = _by_dtype(*static["weights_by_dtype"].items(),
                                               (settings.dtype, scratch))
        acts = _stage_activations(shape, settings, stage)
        gather = zero3_gather_bytes(shape, settings)
        if gather > acts["transient"]:  # the step's largest transient
            acts = {**acts, "transient": gather, "transient_event": "zero-3 layer gather"}
        allocated = (sum(static["weights_by_dtype"].values()) + static["lora_params"]
                     + static["grad_buffers"] + static["optimizer"] + acts["activations"]
                     + acts["moe_rows"] + acts["transient"])
        stages.append(StageMemory(
            stage=stage,
            layers=(stage * shape.num_layers // settings.pp,
                    (stage + 1) * shape.num_layers // settings.pp),
            framework_overhead=device.framework_overhead,
            fragmentation=int(allocated * device.fragmentation),
            **static, **acts))
    return MemoryEstimate(tuple(stages), weights_bytes_total(shape, settings.dtype))


def weights_bytes_total(shape: ModelShape, dtype: str = "bf16") -> int:
    """Bytes of the whole model's base weights in ``dtype`` (norms and the routers' bias in
    fp32, as built)."""
    counts = census(shape)["breakdown"]
    fp32 = counts["norms"] + counts["router_bias"]
    return (sum(counts.values()) - fp32) * DTYPES[dtype] + fp32 * _FP32
