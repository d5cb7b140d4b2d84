"""Routed experts in the latent width: MLPs whose weights are stacked per local expert.

``forward(rows_RL, tokens_per_expert_E, probs_R)`` takes rows grouped by local expert (see the
dispatcher interface) and returns ``fc2(probs_R * act(fc1(row)))`` per row. As in Megatron-Core,
``gated_linear_unit`` chooses SwiGLU (fc1 rows ``[gate; up]``, ``act(gate) * up``) or a non-gated
MLP (e.g. squared ReLU, ``activation_func=squared_relu``); see ``ops.expert_activation``. The
router probability scales the activation before fc2, as in Megatron-Core's experts. The LoRA
experts implement the same interface.

With ``packed`` (``moe.config.PackedExperts``, ``--expert-weights packed``) the frozen weights
are not Parameters but buffers holding the checkpoint's packed bytes and scales
(``fc1_weight_packed``, ``fc1_weight_scale``, ...; not in ``state_dict``, never trained or
written by a run's checkpoints); ``fc1_weight`` / ``fc2_weight`` are then
:class:`~megatron_slmoe.ops.quantized_weights.PackedWeight` views of them, decoded one expert
tile at a time where they are used. Their dist-checkpoint entries are those buffers, sharded by
expert as the dense weights (the HF import fills them, ``hf.loader``).

Parameters are expert-parallel: each EP rank holds ``num_experts / ep`` experts, marked as
Megatron-Core marks its own expert weights (``mark_expert_parameter``), and their dist-checkpoint
shards carry the global expert offset so checkpoints move between expert-parallel sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_slmoe.ops.lora_expert import expert_activation
from megatron_slmoe.ops.quantized_weights import BLOCK_FP8, INT4, MXFP4, PackedWeight

# format -> (packed dtype, inputs per element)
_PACKED_PER_ELEMENT = {MXFP4: (torch.uint8, 2), INT4: (torch.int32, 8),
                       BLOCK_FP8: (torch.float8_e4m3fn, 1)}


def mark_expert_parameter(param: torch.nn.Parameter) -> None:
    """Megatron-Core's marks for an expert weight. ``allreduce = False``: DDP reduces its gradient
    over the expert-data-parallel ranks. ``tensor_model_parallel``: it is no replica within the
    dense tensor-parallel group (with expert TP 1 each TP rank holds its experts whole), so the
    expert optimizer's grad norm, reduced over the expert-model-parallel ranks, counts it on every
    rank. Unmarked, TP ranks > 0 left it out of the norm: grad clipping then scaled gradients
    differently per TP rank and the TP-replicated weights drifted apart step by step."""
    param.allreduce = False
    set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)


class LatentSwiGLUExperts(MegatronModule):
    def __init__(self, config: TransformerConfig, num_local_experts: int,
                 local_expert_offset: int, packed=None) -> None:
        super().__init__(config=config)
        self.num_local_experts = num_local_experts
        self.local_expert_offset = local_expert_offset
        self.packed = packed
        width = config.moe_latent_size or config.hidden_size
        ffn = config.moe_ffn_hidden_size
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        # A gated fc1 holds gate and up stacked on the output dimension, as Megatron's linear_fc1.
        fc1_rows = 2 * ffn if config.gated_linear_unit else ffn
        if packed is not None:
            self._packed_shapes = {"fc1": (fc1_rows, width), "fc2": (width, ffn)}
            dtype, per = _PACKED_PER_ELEMENT[packed.format]
            for proj, (rows, cols) in self._packed_shapes.items():
                if cols % per:
                    raise ValueError(f"{proj}: input width {cols} does not fill whole "
                                     f"{packed.format} elements of {per}")
                self.register_buffer(f"{proj}_weight_packed", torch.zeros(
                    num_local_experts, rows, cols // per, dtype=dtype, device=device),
                    persistent=False)
                self.register_buffer(f"{proj}_weight_scale", torch.zeros(
                    num_local_experts, -(-rows // packed.block_rows), -(-cols // packed.group),
                    dtype=getattr(torch, packed.scale_dtype), device=device), persistent=False)
            return
        self.fc1_weight = torch.nn.Parameter(
            torch.empty(num_local_experts, fc1_rows, width, dtype=config.params_dtype, device=device))
        self.fc2_weight = torch.nn.Parameter(
            torch.empty(num_local_experts, width, ffn, dtype=config.params_dtype, device=device))
        if config.perform_initialization:
            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                for e in range(num_local_experts):
                    config.init_method(self.fc1_weight.data[e])
                    config.output_layer_init_method(self.fc2_weight.data[e])
        for param in (self.fc1_weight, self.fc2_weight):
            mark_expert_parameter(param)

    def __getattr__(self, name: str):
        # fc1_weight / fc2_weight of packed experts: views of their buffers (module doc).
        if name in ("fc1_weight", "fc2_weight") and self.__dict__.get("packed") is not None:
            return self.packed_weight(name[:3])
        return super().__getattr__(name)

    def packed_weight(self, proj: str) -> PackedWeight:
        """The packed frozen weight of ``proj`` (fc1 or fc2), [E_local, out, in] logically."""
        return PackedWeight._checked(
            self.packed.format, getattr(self, f"{proj}_weight_packed"),
            getattr(self, f"{proj}_weight_scale"), self._packed_shapes[proj],
            (self.packed.block_rows, self.packed.group), f"{proj}_weight")

    def check_packed_weights(self) -> None:
        """The full checks of the packed weights (dtypes, shapes, NaN/inf or NaN-byte scales), once
        they are filled: QuantizedWeightError, one line."""
        for proj in ("fc1", "fc2"):
            w = self.packed_weight(proj)
            PackedWeight(w.format, w.packed, w.scale, w.matrix_shape, w.block, w.name)

    def forward(self, rows_RL: torch.Tensor, tokens_per_expert_E: torch.Tensor,
                probs_R: torch.Tensor) -> torch.Tensor:
        sizes = tokens_per_expert_E.tolist()
        outputs = []
        for e, (x_rL, p_r) in enumerate(zip(rows_RL.split(sizes), probs_R.split(sizes))):
            act_rF = expert_activation(F.linear(x_rL, dense_tile(self.fc1_weight[e], x_rL.dtype)),
                                       self.config.activation_func, self.config.gated_linear_unit)
            outputs.append(F.linear(act_rF * p_r.unsqueeze(-1).to(act_rF.dtype),
                                    dense_tile(self.fc2_weight[e], act_rF.dtype)))
        if not outputs:
            return rows_RL.new_zeros(0, self.fc2_weight.shape[1])
        return torch.cat(outputs, dim=0)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        ep_size = parallel_state.get_expert_model_parallel_world_size()
        # Replicas of the same experts live on the expert-data-parallel ranks (TP ranks too).
        replica_id = (0, parallel_state.get_expert_tensor_parallel_rank(),
                      parallel_state.get_expert_data_parallel_rank())
        sharded = {}
        names = ("fc1_weight", "fc2_weight") if self.packed is None else (
            "fc1_weight_packed", "fc1_weight_scale", "fc2_weight_packed", "fc2_weight_scale")
        for name in names:
            key = f"{prefix}{name}"
            # Axis len(sharded_offsets) is the global expert axis, after any layer axes.
            sharded[key] = ShardedTensor.from_rank_offsets(
                key, getattr(self, name), *sharded_offsets,
                (len(sharded_offsets), ep_rank, ep_size),
                replica_id=replica_id, prepend_axis_num=len(sharded_offsets),
            )
        return sharded


def dense_tile(weight, dtype: torch.dtype) -> torch.Tensor:
    """One expert's frozen weight as a dense tensor for a GEMM: itself, or a packed weight decoded
    into a scratch tile of ``dtype`` (dropped after use)."""
    return weight.decode(dtype) if isinstance(weight, PackedWeight) else weight
