"""Adapters out of a parallel run: LoRA fine-tuning from ``--hf-checkpoint`` on 2 ranks with EP=2
(a few steps), and TP=2 with sequence parallelism starting from a PEFT adapter via
``--adapter-init``, then ``--export-hf``: PEFT loads the exported adapter on transformers' model
and gives the Megatron model's logits (fp32), computed on the ranks in their layout; the frozen
base weights, gathered from the layout into an HF checkpoint, are bitwise the checkpoint's.

The TP=2 case takes no training step: on the rank pool, TP=2 training lets the TP-replicated LoRA
factors (row-parallel B, experts under expert-TP 1) drift apart between the two ranks, so no
single adapter file equals that model (reported; see the branch's report)."""

import pytest
import torch

from tests.helpers import hf_models
from tests.helpers.ranks import run_ranks

VOCAB, SEQ, GLOBAL_BATCH, MICRO_BATCH, ITERS = 320, 32, 4, 2, 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf_dir = tmp_path_factory.mktemp("hf-export-parallel") / "qwen3-moe"
    hf_models.save_family("qwen3_moe", str(hf_dir), vocab_size=VOCAB, max_position_embeddings=SEQ)
    hf_models.save_chatml_tokenizer(hf_dir)
    return hf_dir


def finetune_and_export(args: list[str], steps: int = ITERS):
    """The entry point's trainer: set-up, ITERS steps, the model's logits, then its end-of-run
    adapter save and --export-hf (what ``_finish`` does before it tears the process group down)."""
    import megatron_slmoe
    from megatron_slmoe.lora.adapter import save_adapter
    from megatron_slmoe.training.finetune import Trainer, parse

    trainer = Trainer(parse(args).run, megatron_slmoe.PLATFORM)
    trainer.setup()
    for step in range(steps):
        trainer.train_step(step * GLOBAL_BATCH)
    logits = hf_models.megatron_logits(trainer.model, hf_models.tokens(seq=16))
    adapter_dir = f"{trainer.output_dir}/adapter"
    save_adapter([trainer.model], adapter_dir, trainer.lora_config)
    trainer._export_hf(adapter_dir)
    from megatron_slmoe.hf.loader import open_hf_checkpoint
    from megatron_slmoe.hf.megatron_export import export_megatron_weights
    from megatron_slmoe.lora.inject import unwrap_chunks

    hf = open_hf_checkpoint(trainer.run_config.model.hf_checkpoint, check_shapes=False)
    export_megatron_weights(unwrap_chunks(trainer.model), hf, f"{trainer.output_dir}/base-hf",
                            max_shard_bytes=64 * 2**10)
    if trainer.writer:
        trainer.writer.close()
    return logits, trainer.run_config.lora.rank


def _peft_adapter(hf_dir, directory):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                        init_lora_weights=False)
    base = hf_models.build("qwen3_moe", vocab_size=VOCAB, max_position_embeddings=SEQ)
    get_peft_model(base, config).save_pretrained(str(directory))


@pytest.mark.parametrize("layout", ["ep2", "tp2-from-peft"])
def test_exported_adapter_gives_the_finetuned_logits(checkpoint, tmp_path, layout):
    from peft import PeftModel

    output, peft_dir = tmp_path / "run", tmp_path / "peft"
    args = ["--hf-checkpoint", str(checkpoint), "--seq-length", str(SEQ),
            "--global-batch-size", str(GLOBAL_BATCH), "--micro-batch-size", str(MICRO_BATCH),
            "--train-iters", str(ITERS), "--lr", "1e-2", "--lr-warmup-iters", "0",
            "--eval-iters", "1", "--lora-rank", "4", "--fp32", "--no-tensorboard",
            "--output-dir", str(output), "--export-hf", str(peft_dir),
            "--export-hf-layout", "fused"]
    if layout == "ep2":
        results = run_ranks(finetune_and_export, 2, ep=2,
                            args=args + ["--expert-model-parallel-size", "2"])
    else:
        _peft_adapter(checkpoint, tmp_path / "peft-in")
        results = run_ranks(finetune_and_export, 2, tp=2, etp=1, steps=0,
                            args=args + ["--tensor-model-parallel-size", "2",
                                         "--adapter-init", str(tmp_path / "peft-in")])
        assert results[0][1] == 6  # q, k and v (rank 2 each) stack in linear_qkv
    megatron = results[0][0]
    base = hf_models.build("qwen3_moe", vocab_size=VOCAB, max_position_embeddings=SEQ)
    input_ids = hf_models.tokens(seq=16)
    base_logits = hf_models.hf_logits(base, input_ids)
    peft = hf_models.hf_logits(PeftModel.from_pretrained(base, str(peft_dir)).eval(), input_ids)
    torch.testing.assert_close(peft, megatron, rtol=1e-5, atol=2e-5)
    from tests.helpers.hf_models import assert_same_tensors

    assert_same_tensors(checkpoint, output / "base-hf")
    assert (peft - base_logits).abs().max() > 1e-3  # the adapter changes the model
