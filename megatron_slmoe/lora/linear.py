"""LoRA on Megatron-Core's tensor-parallel linears (attention QKV and output, dense MLP).

With the TP group of the base linear (size t, rank i):

* ``ColumnParallelLinear`` (output sharded; qkv, fc1): A [r, in] is replicated, B [out/t, r] is
  sharded like the base weight (rows ``[gate_i; up_i]`` for a gated fc1, stride 2, as Megatron's).
  The LoRA branch sees the same input as the base: with sequence parallelism it is gathered with
  Megatron's ``gather_from_sequence_parallel_region`` (backward: split, see below). Then
  ``h = A x`` [T, r] is identical on every rank; it goes through
  ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce of dL/dh backward), and
  ``y_i = s * B_i h`` is this rank's slice of the TP=1 output. Backward: dL/dh summed over the TP
  ranks is the TP=1 dL/dh, so dA = dh^T x is the full gradient on every rank (A needs no further
  reduction and is not marked ``sequence_parallel``) and dx = dh A is full too: the sequence
  gather's backward only splits it (no reduce-scatter), without SP it is added as it is. The extra
  communication is an all-reduce of [T, r] per linear in backward (and, with SP, the all-gather of
  the input in forward).
* ``RowParallelLinear`` (input sharded; proj, fc2): A [r, in/t] is sharded on dim 1, B [out, r] is
  replicated. ``h_i = A_i x_i`` is a partial sum; ``h = sum_i h_i`` is formed exactly where the base
  output is: ``reduce_scatter_to_sequence_parallel_region`` with SP (h is then [T/t, r], sequence
  sharded, so B sees sequence-sharded input and is marked ``sequence_parallel`` for
  finalize_model_grads), ``reduce_from_tensor_model_parallel_region`` without (B's gradient is
  then full and identical on every rank). ``y = s * B h`` equals the TP=1 output (its sequence
  shard with SP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
from megatron.core.utils import (
    get_pg_rank,
    get_pg_size,
)

from megatron_slmoe.lora.config import LoRAConfig
from megatron_slmoe.lora.base import (
    TP_RNG,
    LoRALinearMixin,
    LoRAPiece,
    full_slice,
    lora_dropout,
    shard_slice,
    tp_group,
)


class LoRAColumnParallelLinear(LoRALinearMixin, ColumnParallelLinear):
    """ColumnParallelLinear + LoRA: A [r, in] replicated, B [out/tp, r] sharded like the weight."""

    lora_glu: bool
    """fc1 of a gated MLP: B's local rows are [gate_i; up_i] (checkpointed like the weight)."""

    @classmethod
    def from_base(cls, base: ColumnParallelLinear, lora_config: LoRAConfig, name: str,
                  glu: bool = False) -> "LoRAColumnParallelLinear":
        if type(base) is not ColumnParallelLinear:
            raise TypeError(f"{name}: LoRA supports Megatron's ColumnParallelLinear, "
                            f"not {type(base).__name__}")
        if base.is_expert or base.disable_grad_reduce:
            raise TypeError(f"{name}: LoRA does not support expert or grad-reduce-disabled "
                            f"ColumnParallelLinear")
        base.__class__ = cls
        base._lora_setup(lora_config, name, ColumnParallelLinear)
        base.lora_glu = glu
        r = lora_config.rank
        base._lora_make((r, base.input_size), (base.output_size_per_partition, r),
                        {"lora_B": (0, getattr(base.weight, "partition_stride", 1))})
        base._lora_init_a(lora_config.init_seed)
        return base

    def forward(self, input_, weight=None, runtime_gather_output=None):
        output, output_bias = super().forward(input_, weight, runtime_gather_output)
        gather_output = self.gather_output if runtime_gather_output is None else runtime_gather_output
        return output + self._lora_column(input_, gather_output), output_bias

    def _lora_column(self, x: torch.Tensor, gather_output: bool) -> torch.Tensor:
        group = tp_group(self)
        if self.sequence_parallel:
            # The base gathers the sequence too; our dL/dx is already full: backward splits.
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False,
                                                     group=group)
        x = lora_dropout(x, self.lora_dropout, self.training, None)  # same mask on every TP rank
        h = F.linear(x, self.lora_A.weight)
        h = copy_to_tensor_model_parallel_region(h, group=group)  # backward: sum dL/dh over TP
        y = F.linear(h, self.lora_B.weight) * self.lora_scaling
        if gather_output:
            y = gather_from_tensor_model_parallel_region(y, group=group)
        return y

    def lora_pieces(self):
        group = tp_group(self)
        rank, size = get_pg_rank(group), get_pg_size(group)
        a, b = self.lora_A.weight, self.lora_B.weight
        r = self.lora_rank
        pieces = [LoRAPiece(f"{self.lora_name}.lora_A.weight", tuple(a.shape),
                            (full_slice(r), full_slice(a.shape[1])), a.data, True, False)]
        name_b = f"{self.lora_name}.lora_B.weight"
        out_local = b.shape[0]
        if self.lora_glu:
            half = out_local // 2
            total_half = half * size
            for part in range(2):  # gate rows, then up rows
                rows = slice(part * total_half + rank * half, part * total_half + (rank + 1) * half)
                pieces.append(LoRAPiece(name_b, (2 * total_half, r), (rows, full_slice(r)),
                                        b.data[part * half:(part + 1) * half], False, False))
        else:
            pieces.append(LoRAPiece(name_b, (out_local * size, r),
                                    (shard_slice(rank, size, out_local), full_slice(r)), b.data, False,
                                    False))
        return pieces

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return self._lora_sharded(sharded, prefix, sharded_offsets, metadata, {"lora_B": 0},
                                  glu_b=self.lora_glu)

    def _lora_strip(self) -> None:
        super()._lora_strip()
        self.__dict__.pop("lora_glu", None)


class LoRARowParallelLinear(LoRALinearMixin, RowParallelLinear):
    """RowParallelLinear + LoRA: A [r, in/tp] sharded like the weight, B [out, r] replicated."""

    @classmethod
    def from_base(cls, base: RowParallelLinear, lora_config: LoRAConfig,
                  name: str) -> "LoRARowParallelLinear":
        if type(base) is not RowParallelLinear:
            raise TypeError(f"{name}: LoRA supports Megatron's RowParallelLinear, "
                            f"not {type(base).__name__}")
        if base.is_expert:
            raise TypeError(f"{name}: LoRA does not support expert RowParallelLinear")
        base.__class__ = cls
        base._lora_setup(lora_config, name, RowParallelLinear)
        r = lora_config.rank
        base._lora_make((r, base.input_size_per_partition), (base.output_size, r),
                        {"lora_A": (1, getattr(base.weight, "partition_stride", 1))})
        # With SP, B sees this rank's sequence shard: finalize_model_grads sums it over TP.
        base.lora_B.weight.sequence_parallel = bool(base.sequence_parallel)
        base._lora_init_a(lora_config.init_seed)
        return base

    def forward(self, input_):
        output, output_bias = super().forward(input_)
        return output + self._lora_row(input_), output_bias

    def _lora_row(self, x: torch.Tensor) -> torch.Tensor:
        group = tp_group(self)
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, group=group)
        tracker = TP_RNG if get_pg_size(group) > 1 else None
        x = lora_dropout(x, self.lora_dropout, self.training, tracker)
        h = F.linear(x, self.lora_A.weight)  # partial sum over this rank's input slice
        if self.sequence_parallel:
            h = reduce_scatter_to_sequence_parallel_region(h, group=group)
        else:
            h = reduce_from_tensor_model_parallel_region(h, group=group)
        return F.linear(h, self.lora_B.weight) * self.lora_scaling

    def lora_pieces(self):
        group = tp_group(self)
        rank, size = get_pg_rank(group), get_pg_size(group)
        a, b = self.lora_A.weight, self.lora_B.weight
        r, in_local = a.shape
        return [
            LoRAPiece(f"{self.lora_name}.lora_A.weight", (r, in_local * size),
                      (full_slice(r), shard_slice(rank, size, in_local)), a.data, False, False),
            LoRAPiece(f"{self.lora_name}.lora_B.weight", tuple(b.shape),
                      (full_slice(b.shape[0]), full_slice(r)), b.data, True, False),
        ]

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return self._lora_sharded(sharded, prefix, sharded_offsets, metadata, {"lora_A": 1})


class LoRAReplicatedLinear(LoRALinearMixin, torch.nn.Linear):
    """``torch.nn.Linear`` + LoRA, for a module outside Megatron's tensor parallelism that every
    rank holds whole (a transformers vision tower or projector, KDA's ``f_a_proj``): A [r, in]
    and B [out, r] whole too. Where its input is the same on every tensor-parallel rank, so are
    its gradients; where sequence parallelism gives each rank its own tokens (the base weight is
    marked ``sequence_parallel``), A and B are marked too, so finalize_model_grads sums their
    gradients over TP as it does the base weight's."""

    @classmethod
    def from_base(cls, base: torch.nn.Linear, lora_config: LoRAConfig,
                  name: str) -> "LoRAReplicatedLinear":
        if type(base) is not torch.nn.Linear:
            raise TypeError(f"{name}: expected a torch.nn.Linear, got {type(base).__name__}")
        base.__class__ = cls
        base._lora_setup(lora_config, name, torch.nn.Linear)
        r = lora_config.rank
        base._lora_make((r, base.in_features), (base.out_features, r))
        for param in base.lora_parameters():
            param.sequence_parallel = bool(getattr(base.weight, "sequence_parallel", False))
        base._lora_init_a(lora_config.init_seed)
        return base

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        return (torch.nn.Linear.forward(self, input_)
                + self._lora_branch_replicated(input_, None, dtype=input_.dtype))

    def lora_pieces(self):
        return self._replicated_pieces()
