"""Adapters out of a parallel run: 10 LoRA steps from ``--hf-checkpoint`` on 2 ranks with EP=2
and, separately, TP=2 (sequence parallel, expert TP 1), for Qwen3-MoE and DeepSeek-V3 (MLA,
shared experts), and NemotronH (TP=2) and the Stable Latent MoE (EP=2), both latent MoEs; the
Qwen3-MoE TP=2 run starts from an adapter PEFT made (``--adapter-init``).
Then ``--export-hf``: PEFT loads the exported adapter on transformers' model and gives the
fine-tuned Megatron model's logits, computed on the ranks in their layout (fp32); the merged
export loaded with ``AutoModelForCausalLM`` gives them too; the base weights gathered from the
layout into an HF checkpoint are bitwise the checkpoint's.

Under TP=2 every parameter Megatron does not mark tensor-parallel is bitwise the same on both TP
ranks after the 10 steps, and both ranks clip with the same grad norm. (Regression: expert weights
lacked Megatron's ``tensor_model_parallel`` mark, so TP rank 1 left them out of the expert grad
norm, clipped by another factor and drifted from rank 0.)

The per-expert layout is exported single-process in ``tests/unit/test_hf_export.py`` (the adapter
file is the same whatever the run's layout)."""

import pytest
import torch

from tests.helpers import hf_models
from tests.helpers.ranks import run_ranks

VOCAB, SEQ, GLOBAL_BATCH, MICRO_BATCH, ITERS = 320, 32, 4, 2, 10


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def make(family):
        if family not in made:
            hf_dir = tmp_path_factory.mktemp("hf-export-parallel") / family
            hf_models.save_family(family, str(hf_dir), vocab_size=VOCAB,
                                  max_position_embeddings=SEQ)
            hf_models.save_chatml_tokenizer(hf_dir)
            made[family] = hf_dir
        return made[family]

    return make


def _tp_replica_spread(model) -> float:
    """Largest difference between the TP ranks of a parameter Megatron does not mark
    tensor-parallel (0 when there is no tensor parallelism)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    size = torch.distributed.get_world_size(group)
    spread = torch.zeros(())
    for _, param in sorted(model.named_parameters()):
        if size == 1 or getattr(param, "tensor_model_parallel", False):
            continue
        copies = [torch.empty_like(param) for _ in range(size)]
        torch.distributed.all_gather(copies, param.detach().contiguous(), group=group)
        spread = torch.maximum(spread, max((c - copies[0]).abs().max() for c in copies))
    return spread.item()


def finetune_and_export(args: list[str], steps: int = ITERS):
    """The entry point's engine: set-up, ``steps`` steps, the model's logits, then its end-of-run
    adapter save and --export-hf (the adapter callback's part of the run's finish)."""
    import megatron_slmoe
    from megatron_slmoe.hf.loader import open_hf_checkpoint
    from megatron_slmoe.hf.megatron_export import export_megatron_weights
    from megatron_slmoe.lora.inject import unwrap_chunks
    from megatron_slmoe.training.recipe import build_engine
    from megatron_slmoe.training.finetune import parse

    engine = build_engine(parse(args).run, megatron_slmoe.PLATFORM)
    ctx = engine.setup()
    grad_norms = [engine.train_step()["grad_norm"] for _ in range(steps)]
    logits = hf_models.megatron_logits(ctx.model, hf_models.tokens(seq=16))
    adapter = next(c for c in engine.callbacks if c.name == "adapter")
    adapter.finish(ctx, {})
    hf = open_hf_checkpoint(engine.run_config.model.hf_checkpoint, check_shapes=False)
    export_megatron_weights(unwrap_chunks(ctx.model), hf, f"{ctx.output_dir}/base-hf",
                            max_shard_bytes=64 * 2**10)
    return {"logits": logits, "grad_norms": grad_norms, "spread": _tp_replica_spread(ctx.model),
            "rank": engine.run_config.lora.rank}


def _peft_adapter(family, directory):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                        init_lora_weights=False)
    base = hf_models.build(family, vocab_size=VOCAB, max_position_embeddings=SEQ)
    get_peft_model(base, config).save_pretrained(str(directory))


CASES = [("qwen3_moe", "ep2"), ("qwen3_moe", "tp2-from-peft"), ("deepseek_v3", "ep2"),
         ("deepseek_v3", "tp2"), ("nemotron_h", "tp2"), ("stable_latent_moe", "ep2")]


@pytest.mark.parametrize("family, layout", CASES, ids=[f"{f}-{l}" for f, l in CASES])
def test_exported_adapter_gives_the_finetuned_logits(checkpoints, tmp_path, family, layout):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megatron_slmoe.hf.merged_export import export_merged

    checkpoint = checkpoints(family)
    output, peft_dir = tmp_path / "run", tmp_path / "peft"
    args = ["--hf-checkpoint", str(checkpoint), "--seq-length", str(SEQ),
            "--global-batch-size", str(GLOBAL_BATCH), "--micro-batch-size", str(MICRO_BATCH),
            "--train-iters", str(ITERS), "--lr", "1e-2", "--lr-warmup-iters", "0",
            "--eval-iters", "1", "--lora-rank", "4", "--fp32", "--no-tensorboard",
            "--output-dir", str(output), "--export-hf", str(peft_dir),
            "--export-hf-layout", "fused"]
    if family == "deepseek_v3":  # linear_qkv: MLA's q/kv down and up projections
        args += ["--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
                 "shared_experts", "router"]
    if layout == "ep2":
        results = run_ranks(finetune_and_export, 2, ep=2,
                            args=args + ["--expert-model-parallel-size", "2"])
    else:
        if layout == "tp2-from-peft":
            _peft_adapter(family, tmp_path / "peft-in")
            args += ["--adapter-init", str(tmp_path / "peft-in")]
        results = run_ranks(finetune_and_export, 2, tp=2, etp=1,
                            args=args + ["--tensor-model-parallel-size", "2"])
        if layout == "tp2-from-peft":
            assert results[0]["rank"] == 6  # q, k and v (rank 2 each) stack in linear_qkv
        assert results[0]["spread"] == 0.0
        assert results[0]["grad_norms"] == results[1]["grad_norms"]
    assert max(results[0]["grad_norms"]) > 1.0  # --clip-grad 1.0 acted: the norms must agree
    megatron = results[0]["logits"]
    base = hf_models.build(family, vocab_size=VOCAB, max_position_embeddings=SEQ)
    input_ids = hf_models.tokens(seq=16)
    base_logits = hf_models.hf_logits(base, input_ids)
    peft = hf_models.hf_logits(PeftModel.from_pretrained(base, str(peft_dir)).eval(), input_ids)
    torch.testing.assert_close(peft, megatron, rtol=1e-5, atol=2e-5)
    assert (peft - base_logits).abs().max() > 1e-3  # the adapter changes the model
    export_merged(str(output / "adapter"), str(checkpoint), str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    torch.testing.assert_close(hf_models.hf_logits(merged, input_ids), megatron,
                               rtol=1e-5, atol=2e-5)
    hf_models.assert_same_tensors(checkpoint, output / "base-hf")
