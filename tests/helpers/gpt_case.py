"""A tiny Megatron-Core GPTModel with an MoE layer, run through Megatron's own machinery.

Every function here runs inside a rank spawned by ``ranks.run_ranks`` and reads the parallel
layout from Megatron's parallel_state. Weights and gradients move between layouts as Megatron
dist checkpoints, so a single-rank reference and a parallel run can be compared shard by shard.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB = 64
SEQ = 16
MICRO_BATCH = 2
GLOBAL_BATCH = 8
NUM_EXPERTS = 4


# "megatron": Megatron-Core's own MoE layer; "slmoe": our Stable Latent MoE layer (latent width,
# shared expert, sigmoid routing with expert bias) from our decoder-block spec.
VARIANT = {"name": "megatron"}


def tiny_config() -> TransformerConfig:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    extra = {}
    if VARIANT["name"] == "slmoe":
        extra = dict(moe_latent_size=16, moe_shared_expert_intermediate_size=24,
                     moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_load_balancing_type="seq_aux_loss")
    return TransformerConfig(**{**dict(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
        num_query_groups=2, kv_channels=8,
        num_moe_experts=NUM_EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=48,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2, moe_grouped_gemm=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        sequence_parallel=tp > 1,  # Megatron requires it for MoE with TP>1
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        bf16=False, deterministic_mode=True,
    ), **extra})


def build_model(config: TransformerConfig) -> GPTModel:
    if VARIANT["name"] == "slmoe":
        from megatron_slmoe.moe.specs import get_slmoe_decoder_block_spec

        spec = get_slmoe_decoder_block_spec(config)
    else:
        spec = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=False,
                                        normalization="RMSNorm")
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type="rope",
    )


def wrap_ddp(config: TransformerConfig, model: GPTModel, distributed_optimizer: bool = False):
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer,
        overlap_grad_reduce=False, bucket_size=None,
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return ddp


def global_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(42)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    loss_mask = torch.ones(GLOBAL_BATCH, SEQ)
    loss_mask[:, :3] = 0.0  # some masked positions, as with prompt tokens
    return {
        "tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
        "loss_mask": loss_mask, "position_ids": torch.arange(SEQ).expand(GLOBAL_BATCH, SEQ),
    }


def my_microbatches() -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's share of the global batch, cut into micro-batches."""
    dp = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    batch = global_batch()
    per_rank = GLOBAL_BATCH // dp
    mine = {k: v[dp_rank * per_rank:(dp_rank + 1) * per_rank] for k, v in batch.items()}
    return [{k: v[i:i + MICRO_BATCH] for k, v in mine.items()}
            for i in range(0, per_rank, MICRO_BATCH)]


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1)
    loss = torch.sum(losses * mask) / mask.sum()
    # clone: the schedule divides the returned loss in place by the number of micro-batches
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def forward_backward(model, forward_only: bool = False) -> float | None:
    """Megatron's schedule over this rank's micro-batches; mean loss over the global batch."""
    microbatches = my_microbatches()
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(microbatches), model=model,
        num_microbatches=len(microbatches), seq_length=SEQ, micro_batch_size=MICRO_BATCH,
        forward_only=forward_only,
    )
    if not parallel_state.is_pipeline_last_stage():
        return None
    loss = torch.stack([entry["lm loss"] for entry in losses]).mean()
    torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    return (loss / parallel_state.get_data_parallel_world_size()).item()


def build_optimizer(ddp, distributed_optimizer: bool):
    config = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=1.0,
                             use_distributed_optimizer=distributed_optimizer, bf16=False)
    return get_megatron_optimizer(config, [ddp])


def save(model: GPTModel, directory: str) -> None:
    dist_checkpointing.save(model.sharded_state_dict(), directory)


def load(model: GPTModel, directory: str) -> None:
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), directory))


def named_main_grads(model: GPTModel) -> dict[str, torch.Tensor]:
    return {name: p.main_grad.detach().clone() for name, p in model.named_parameters()}


def relative_errors(actual: dict[str, torch.Tensor], expected_dir: str) -> dict[str, float]:
    """Load a checkpoint written in any layout into this rank's shards; compare by name."""
    holder = build_model(tiny_config())
    load(holder, expected_dir)
    errors = {}
    for name, expected in holder.named_parameters():
        diff = (actual[name] - expected.detach()).norm()
        errors[name] = (diff / expected.detach().norm().clamp_min(1e-12)).item()
    return errors


# --- rank entry points --------------------------------------------------------------------------


def reference_run(weights_dir: str, grads_dir: str, stepped_dir: str,
                  variant: str = "megatron") -> dict:
    """Single rank: initial weights, the loss, gradients and one optimizer step, as checkpoints."""
    VARIANT["name"] = variant
    config = tiny_config()
    model = build_model(config)
    save(model, weights_dir)
    ddp = wrap_ddp(config, model)
    loss = forward_backward(ddp)
    grads = build_model(tiny_config())  # fresh: DDP put process groups into `config`
    with torch.no_grad():
        for (_, target), grad in zip(grads.named_parameters(), named_main_grads(model).values()):
            target.copy_(grad)
    save(grads, grads_dir)
    build_optimizer(ddp, distributed_optimizer=False).step()
    save(model, stepped_dir)
    return {"loss": loss}


def parallel_run(weights_dir: str, grads_dir: str, stepped_dir: str,
                 distributed_optimizer: bool = False, variant: str = "megatron") -> dict:
    """Any layout: load the reference weights, train one step, compare every local shard."""
    VARIANT["name"] = variant
    config = tiny_config()
    model = build_model(config)
    load(model, weights_dir)
    ddp = wrap_ddp(config, model, distributed_optimizer)
    optimizer = build_optimizer(ddp, distributed_optimizer)
    loss = forward_backward(ddp)
    grad_errors = relative_errors(named_main_grads(model), grads_dir)
    optimizer.step()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"loss": loss, "grad_errors": grad_errors,
            "step_errors": relative_errors(params, stepped_dir)}


def resave_run(source_dir: str, target_dir: str) -> None:
    """Load a checkpoint into this layout and save it again (in this layout's shards)."""
    model = build_model(tiny_config())
    load(model, source_dir)
    save(model, target_dir)


def compare_run(expected_dir: str, actual_dir: str) -> dict[str, float]:
    """Load two checkpoints into this layout and compare them tensor by tensor."""
    model = build_model(tiny_config())
    load(model, actual_dir)
    return relative_errors({n: p.detach() for n, p in model.named_parameters()}, expected_dir)


def tiny_attnres_model(block: int, num_layers: int, seed: int = 3):
    """The packaged ``tiny`` model (first layer dense, the others Stable Latent MoE) with
    ``num_layers`` layers on the Attention Residuals stream (``blocks.attention_residual_block``)
    in the current layout, its weights random (the mixes far from uniform), in eval mode. Its
    random weights depend on the layout: move them between layouts as a dist checkpoint."""
    import dataclasses

    from megatron_slmoe.hf.convert import build_model_in_layout
    from megatron_slmoe.model.model_file import BlocksConfig, load_model_config

    base = load_model_config("tiny")
    transformer = dict(base.transformer, num_layers=num_layers,
                       moe_layer_freq=[0] + [1] * (num_layers - 1))
    model_config = dataclasses.replace(base, transformer=transformer,
                                       blocks=BlocksConfig(attention_residual_block=block))
    model, _ = build_model_in_layout(model_config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm_weight", "layernorm.weight", "norm.weight")):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.5 if name.endswith("proj_weight") else 0.05)
    return model.eval()
