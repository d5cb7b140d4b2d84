"""The README's Hugging Face path, command by command, as a new user types it (on a tiny random
Qwen3-MoE checkpoint with a ChatML tokenizer, 2 CPU processes, EP=2):

1. fine-tune straight from the checkpoint (``HF_CHECKPOINT=DIR EP=2 bash scripts/pretrain_lora.sh
   ... --export-hf DIR --export-hf-layout fused``: a per-expert export of LoRA on Qwen3-MoE's
   dense layer is refused before start-up, as PEFT would read it as expert LoRA),
2. import it once (``tools/convert_hf.py import``),
3. generate with the adapter, from the import's output (no --tokenizer, no --model-config) and
   from the checkpoint itself (``slmoe-generate --hf-checkpoint``),
4. and the exported PEFT adapter on the transformers model answers the same, token for token.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import hf_models

REPO = Path(__file__).resolve().parents[2]
# No digits after a space: transformers' Qwen2Tokenizer splits them with Qwen's own pattern,
# which this test's small tokenizer.json does not have (real Qwen tokenizer.json files do).
PROMPTS = ["Answer in digits. two one", "Answer in digits. nine", "two one nine", "user nine two"]
NEW_TOKENS = 6


def _env(**extra):
    env = {**os.environ, "SLMOE_PREFLIGHT": "0", "PYTHONPATH": str(REPO), **extra}
    for name in ("NNODES", "NODE_RANK", "MASTER_ADDR", "RDZV_ENDPOINT", "NETWORK_PROFILE", "TP",
                 "MODEL_CONFIG", "BASE_CHECKPOINT"):
        env.pop(name, None)
    return env


def _run(command, **env):
    proc = subprocess.run(command, cwd=REPO, env=_env(**env), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme-hf")
    hf_dir = root / "qwen3-moe"
    model = hf_models.build("qwen3_moe", vocab_size=320, max_position_embeddings=64)
    with torch.no_grad():  # peaked next-token choices: greedy answers without near-ties
        model.lm_head.weight.mul_(10.0)
    hf_models.save(model, str(hf_dir))
    hf_models.save_chatml_tokenizer(hf_dir)
    data = root / "task.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "response": "2 1"}) + "\n"
                            for p in PROMPTS * 4))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    run, peft = root / "qwen3-lora", root / "qwen3-lora-peft"
    # README: "Straight from the checkpoint directory" (scaled to the tiny model and 4 steps).
    _run(["bash", "scripts/pretrain_lora.sh", "--train-data", str(data), "--valid-data",
          str(data), "--seq-length", "64", "--lora-rank", "4", "--train-iters", "4",
          "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "2e-2",
          "--lr-warmup-iters", "0", "--eval-iters", "1", "--no-plots", "--output-dir", str(run),
          "--export-hf", str(peft), "--export-hf-layout", "fused"],
         HF_CHECKPOINT=str(hf_dir), EP="2", NPROC_PER_NODE="2")
    # README: "Or import once into a Megatron dist checkpoint".
    mcore = root / "qwen3-moe-mcore"
    _run([sys.executable, "tools/convert_hf.py", "import", "--hf-checkpoint", str(hf_dir),
          "--output", str(mcore)])
    return {"hf": hf_dir, "run": run, "peft": peft, "mcore": mcore, "prompts": prompts,
            "root": root}


def _generate(path, name: str, *model_flags: str) -> list[str]:
    output = path["root"] / f"{name}.jsonl"
    _run([sys.executable, "-m", "megatron_slmoe.generate", *model_flags, "--adapter",
          str(path["run"] / "adapter"), "--prompts", str(path["prompts"]), "--output",
          str(output), "--max-new-tokens", str(NEW_TOKENS)])
    return [json.loads(line)["answer"] for line in output.read_text().splitlines()]


def _peft_answers(path) -> list[str]:
    """Greedy answers of transformers + PEFT (the exported adapter on the HF checkpoint), the
    prompts rendered with the checkpoint's own chat template."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path["hf"])
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(path["hf"], dtype=torch.float32), path["peft"])
    model.eval()
    answers = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
        with torch.no_grad():
            # The model's vocabulary (320) is padded beyond the tokenizer's: slmoe-generate
            # never picks a token the tokenizer does not have, so neither may transformers.
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                 pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                                 suppress_tokens=list(range(len(tokenizer), 320)))
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return answers


def test_the_adapter_records_its_base_by_absolute_path_and_identity(path):
    recorded = json.loads((path["run"] / "adapter" / "adapter_config.json").read_text())
    base = recorded["base_model"]
    assert base["hf_checkpoint"] == str(path["hf"].resolve())  # not relative to the launch dir
    assert len(base["model_fingerprint"]) == 64 and len(base["tokenizer_sha256"]) == 64


def test_generation_from_the_import_and_from_the_checkpoint_equals_transformers_peft(path):
    expected = _peft_answers(path)
    assert any(expected), expected  # the comparison is over some text
    from_import = _generate(path, "from-import", "--base-checkpoint", str(path["mcore"]))
    from_checkpoint = _generate(path, "from-hf", "--hf-checkpoint", str(path["hf"]))
    assert from_import == expected
    assert from_checkpoint == expected


def test_another_tokenizer_than_the_adapters_is_refused(path, tmp_path):
    from megatron_slmoe.data.assets import asset_path

    proc = subprocess.run(
        [sys.executable, "-m", "megatron_slmoe.generate", "--base-checkpoint", str(path["mcore"]),
         "--adapter", str(path["run"] / "adapter"), "--tokenizer", asset_path("tokenizer.json"),
         "--prompts", str(path["prompts"]), "--output", str(tmp_path / "a.jsonl")],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "was trained with another tokenizer than the tokenizer" in line, line
    assert not (tmp_path / "a.jsonl").exists()


def test_an_export_peft_cannot_read_is_refused_before_start_up(path, tmp_path):
    """Per-expert PEFT export of LoRA on a dense MLP of Qwen3-MoE: refused by --validate-only (the
    launcher's check), before any training, instead of failing at the end of the run."""
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_slmoe.training.finetune", "--validate-only",
         "--hf-checkpoint", str(path["hf"]), "--seq-length", "64", "--export-hf",
         str(tmp_path / "peft"), "--output-dir", str(tmp_path / "run")],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "cannot be exported per expert: use --export-hf-layout fused" in line, line
    assert not (tmp_path / "run").exists()


def test_bad_input_met_after_start_ends_the_job_without_restarts(path, tmp_path):
    """A PEFT --adapter-init with LoRA on a weight no Megatron target maps to passes the checks
    before start-up (they read its config) and fails its conversion on start: the job ends at
    once with that one line and exit code 2, torchrun's restart budget untouched."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path["hf"], dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["lm_head"]))
    peft.save_pretrained(tmp_path / "lm-head-lora")
    out = tmp_path / "run"
    proc = subprocess.run(
        ["bash", "scripts/pretrain_lora.sh", "--adapter-init", str(tmp_path / "lm-head-lora"),
         "--train-data", str(path["root"] / "task.jsonl"), "--valid-data",
         str(path["root"] / "task.jsonl"), "--seq-length", "64", "--train-iters", "2",
         "--lr-warmup-iters", "0",
         "--global-batch-size", "4", "--micro-batch-size", "2", "--output-dir", str(out)],
        cwd=REPO, env=_env(HF_CHECKPOINT=str(path["hf"]), EP="2", NPROC_PER_NODE="2",
                           MAX_RESTARTS="3"),
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --adapter-init ") and "lm_head" in last, last
    assert "will restart worker group" not in proc.stdout + proc.stderr
