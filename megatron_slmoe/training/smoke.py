"""Smoke run: a tiny Megatron-Core GPT with an MoE layer learns a synthetic task on this platform.

It shows that the platform adaptor lets Megatron-Core's own model, expert parallelism, DDP,
optimizer and pipeline schedule train here. Launched by ``scripts/pretrain_lora.sh`` under torchrun
(2 processes, expert parallelism 2 by default); the LoRA fine-tuning job replaces it.

Task: sequences of an affine recurrence ``t[i+1] = (a * t[i] + b) mod V`` with (a, b) drawn per
sequence from a small set, so the model must read the context to predict; random guessing costs
ln(V) nats, a model that learned the rule approaches 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from functools import partial

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-iters", type=int, default=60)
    parser.add_argument("--expert-model-parallel-size", type=int, default=None,
                        help="default: the world size")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--output-dir", default=None, help="default: runs/smoke-<time>")
    parser.add_argument("--validate-only", action="store_true",
                        help="check the arguments and exit (the launcher does this before torchrun)")
    args = parser.parse_args(argv)
    for name in ("train_iters", "micro_batch_size", "global_batch_size", "seq_length"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


VOCAB = 64
RULES = [(3, 1), (5, 7), (7, 3), (9, 11)]


def make_batch(batch_size: int, seq_length: int, generator: torch.Generator) -> dict:
    rules = torch.tensor(RULES)[torch.randint(len(RULES), (batch_size,), generator=generator)]
    tokens = torch.empty(batch_size, seq_length + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(VOCAB, (batch_size,), generator=generator)
    for i in range(seq_length):
        tokens[:, i + 1] = (rules[:, 0] * tokens[:, i] + rules[:, 1]) % VOCAB
    loss_mask = torch.ones(batch_size, seq_length)
    loss_mask[:, :2] = 0.0  # the rule is not yet determined by the first tokens
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": loss_mask,
            "position_ids": torch.arange(seq_length).expand(batch_size, -1)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.validate_only:
        return 0
    import megatron_slmoe  # applies the platform adaptor before Megatron-Core is used

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    platform = megatron_slmoe.PLATFORM
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    ep = args.expert_model_parallel_size or world
    tp = args.tensor_model_parallel_size
    if world % (tp * ep):
        print(f"error: world size {world} is not divisible by TP {tp} x EP {ep}", file=sys.stderr)
        return 2
    platform.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.distributed.init_process_group(platform.backend, timeout=timedelta(minutes=5))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             expert_model_parallel_size=ep)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    if args.global_batch_size % (args.micro_batch_size * dp):
        print(f"error: --global-batch-size {args.global_batch_size} is not a multiple of "
              f"--micro-batch-size x data-parallel size ({args.micro_batch_size} x {dp})",
              file=sys.stderr)
        return 2
    num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)

    config = TransformerConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        num_moe_experts=4 * ep, moe_router_topk=2, moe_ffn_hidden_size=64,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2, moe_grouped_gemm=False, tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep, sequence_parallel=tp > 1, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        bf16=platform.name != "cpu", params_dtype=torch.bfloat16 if platform.name != "cpu" else torch.float32,
    )
    model = GPTModel(config=config, vocab_size=VOCAB, max_sequence_length=args.seq_length,
                     transformer_layer_spec=get_gpt_layer_local_spec(
                         num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                         normalization="RMSNorm"),
                     position_embedding_type="rope").to(platform.device())
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, clip_grad=1.0, bf16=config.bf16), [ddp])

    def loss_func(loss_mask, output):
        loss = (output.float() * loss_mask).sum() / loss_mask.sum()
        return loss, {"loss": loss.detach().clone()}

    def forward_step(data_iterator, model):
        batch = {k: v.to(platform.device()) for k, v in next(data_iterator).items()}
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return output, partial(loss_func, batch["loss_mask"])

    def run(generator, forward_only):
        batches = [make_batch(args.micro_batch_size, args.seq_length, generator)
                   for _ in range(num_microbatches)]
        losses = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=ddp,
            num_microbatches=num_microbatches, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=forward_only)
        loss = torch.stack([x["loss"] for x in losses]).mean()
        torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        return loss.item() / dp

    def held_out_loss():
        ddp.eval()
        with torch.no_grad():
            loss = run(torch.Generator().manual_seed(10_000 + dp_rank), forward_only=True)
        ddp.train()
        return loss

    output_dir = args.output_dir or os.path.join("runs", time.strftime("smoke-%Y%m%d-%H%M%S"))
    if rank == 0:
        os.makedirs(output_dir, exist_ok=True)
        print(f"[smoke] platform={platform.name} backend={platform.backend} world={world} "
              f"tp={tp} ep={ep} dp={dp} experts={config.num_moe_experts} output={output_dir}",
              flush=True)
    before = held_out_loss()
    train_gen = torch.Generator().manual_seed(args.seed + dp_rank)
    start = time.time()
    for step in range(1, args.train_iters + 1):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = run(train_gen, forward_only=False)
        _, grad_norm, _ = optimizer.step()
        if rank == 0 and (step % 10 == 0 or step == 1):
            print(f"[smoke] step {step:4d}/{args.train_iters} loss {loss:.4f} "
                  f"grad_norm {grad_norm:.3f} {time.time() - start:.1f}s", flush=True)
    after = held_out_loss()
    if rank == 0:
        summary = {"eval_loss_before": before, "eval_loss_after": after,
                   "steps": args.train_iters, "uniform_loss": float(torch.log(torch.tensor(VOCAB)))}
        with open(os.path.join(output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(f"[smoke] held-out loss {before:.4f} -> {after:.4f} (uniform guess "
              f"{summary['uniform_loss']:.4f}); summary in {output_dir}/summary.json", flush=True)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
