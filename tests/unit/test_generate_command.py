"""slmoe-generate end to end in one process: a saved base checkpoint plus an adapter, a prompt file
of every accepted shape in, JSON lines out in prompt order, each greedy answer equal to a plain
argmax loop over full forward passes of the same model (no KV cache, one prompt at a time), exact
match scored where the record carries the answer; bad input is one line and exit code 2."""

import json

import pytest
import torch

pytestmark = pytest.mark.usefixtures("megatron_single_rank")

MAX_NEW = 6
PROMPTS = [
    {"prompt": "Write in digits: two one"},
    {"prompt": "Write in digits: seven", "response": "7"},
    {"messages": [{"role": "system", "content": "You turn number words into digits."},
                  {"role": "user", "content": "Write in digits: nine nine four"}]},
    {"messages": [{"role": "user", "content": "Write in digits: six"},
                  {"role": "assistant", "content": "6"}]},
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny base (random weights) and an adapter with non-zero B, and the model they make."""
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.parallel.config import ParallelConfig
    from megatron_slmoe.lora.adapter import save_adapter
    from megatron_slmoe.lora.inject import inject_lora, lora_modules
    from megatron_slmoe.model.model_file import load_model_config
    from megatron_slmoe.data.assets import asset_path
    from megatron_slmoe.data.tokenizer import load_tokenizer
    from megatron_slmoe.training.checkpointing import save_base_checkpoint
    from megatron_slmoe.runtime.model import build_model

    import megatron_slmoe

    root = tmp_path_factory.mktemp("generate")
    torch.manual_seed(3)
    model, _ = build_model(load_model_config("tiny"), ParallelConfig(), False,
                           megatron_slmoe.PLATFORM)
    save_base_checkpoint(model, str(root / "base"), "tiny",
                         load_tokenizer(asset_path("tokenizer.json")))
    lora = LoRAConfig(rank=4, targets=["linear_qkv", "linear_fc1", "linear_fc2"])
    inject_lora([model], lora)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in lora_modules([model]):
            for param in module.lora_parameters():
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
    save_adapter([model], str(root / "adapter"), lora, {"model_config": "tiny"})
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return root, model.eval()


def _greedy_by_full_forward(model, prompt_ids, eos_id):
    tokens = list(prompt_ids)
    with torch.no_grad():
        for _ in range(MAX_NEW):
            ids = torch.tensor([tokens])
            logits = model(ids, torch.arange(len(tokens)).unsqueeze(0), None)
            token = int(logits[0, -1, :512].argmax())
            if token == eos_id:
                break
            tokens.append(token)
    return tokens[len(prompt_ids):]


def test_answers_in_prompt_order_equal_a_plain_argmax_loop(saved, capsys):
    from megatron_slmoe.commands.generate import main, read_prompts
    from megatron_slmoe.data.assets import asset_path
    from megatron_slmoe.data.tokenizer import load_tokenizer
    from megatron_slmoe.inference.answers import request_for

    root, model = saved
    out = root / "answers.jsonl"
    assert main(["--base-checkpoint", str(root / "base"), "--adapter", str(root / "adapter"),
                 "--prompts", str(root / "prompts.jsonl"), "--output", str(out),
                 "--max-new-tokens", str(MAX_NEW), "--batch-size", "3"]) == 0
    assert f"wrote {len(PROMPTS)} answers to {out}" in capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(len(PROMPTS)))
    tokenizer = load_tokenizer(asset_path("tokenizer.json"))
    for record, messages in zip(records, read_prompts(str(root / "prompts.jsonl"))):
        request = request_for(tokenizer, messages, MAX_NEW)
        want = _greedy_by_full_forward(model, request.prompt_ids, tokenizer.eos_id)
        assert record["answer"] == tokenizer.decode(want), record
        assert record["reference"] == request.reference
        assert record["exact_match"] == (None if request.reference is None
                                         else record["answer"].strip() == request.reference)
    assert records[1]["prompt"] == "Write in digits: seven" and records[1]["reference"] == "7"


@pytest.mark.parametrize("line, needle", [
    ('{"prompt": 7}', "prompts.jsonl:2: prompt must be a string"),
    ('{"text": "hi"}', "prompts.jsonl:2: missing key"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', "prompts.jsonl:2: "),
    ("not json", "prompts.jsonl:2: "),
])
def test_a_bad_prompt_record_is_one_line_naming_its_line(saved, tmp_path, capsys, line, needle):
    from megatron_slmoe.commands.generate import main

    root, _ = saved
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(PROMPTS[0]) + "\n" + line + "\n")
    assert main(["--base-checkpoint", str(root / "base"), "--prompts", str(prompts),
                 "--output", str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out.jsonl").exists()


def test_missing_base_and_bad_sampling_are_one_line(saved, tmp_path, capsys):
    from megatron_slmoe.commands.generate import main

    root, _ = saved
    common = ["--prompts", str(root / "prompts.jsonl"), "--output", str(tmp_path / "o.jsonl")]
    assert main(["--base-checkpoint", str(tmp_path / "none"), *common]) == 2
    assert "--base-checkpoint" in capsys.readouterr().err
    assert main(["--base-checkpoint", str(root / "base"), "--top-p", "0.5", *common]) == 2
    assert "--top-p needs --temperature" in capsys.readouterr().err


def test_the_prompts_file_is_never_overwritten_and_bad_outputs_are_one_line(saved, tmp_path,
                                                                            capsys):
    from megatron_slmoe.commands.generate import main

    root, _ = saved
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(PROMPTS[0]) + "\n")
    kept = prompts.read_bytes()
    base = ["--base-checkpoint", str(root / "base"), "--prompts", str(prompts)]
    for output, needle in ((str(prompts), "is the --prompts file"),
                           (str(tmp_path), "is a directory"),
                           (str(prompts / "answers.jsonl"), "is not a directory")):
        assert main([*base, "--output", output]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
    assert prompts.read_bytes() == kept


def test_a_binary_prompts_file_is_one_line(saved, tmp_path, capsys):
    from megatron_slmoe.commands.generate import main

    root, _ = saved
    prompts = tmp_path / "prompts.bin"
    prompts.write_bytes(b"\x80\x81\xfe\xff binary\n" + bytes(range(256)))
    assert main(["--base-checkpoint", str(root / "base"), "--prompts", str(prompts),
                 "--output", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "prompts.bin:1: not UTF-8 text" in err and len(err.strip().splitlines()) == 1, err


def test_a_prompt_with_the_image_placeholder_and_no_image_is_refused(tmp_path, capsys):
    """A Kimi-K2.5 checkpoint and a text prompt holding its <|media_pad|>: refused in one line,
    as training refuses the same text (it answered garbage, exit 0)."""
    from megatron_slmoe.commands.generate import main
    from tests.helpers import hf_models

    hf_dir = tmp_path / "kimi"
    hf_dir.mkdir()
    hf_models.save_chatml_tokenizer(hf_dir, special_tokens=["<|media_pad|>"])
    import tokenizers

    pad = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json")).token_to_id(
        "<|media_pad|>")
    hf_models.save(hf_models.build_kimi(text_overrides=dict(vocab_size=320),
                                        image_token_id=pad), str(hf_dir))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is this? <|media_pad|>"}) + "\n")
    assert main(["--hf-checkpoint", str(hf_dir), "--prompts", str(prompts), "--output",
                 str(tmp_path / "answers.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"error: prompt 0 holds the model's image placeholder <|media_pad|> (token id {pad}) and "
        f"no image goes with it (slmoe-generate answers text prompts): remove it from the prompt"]
    assert not (tmp_path / "answers.jsonl").exists()
