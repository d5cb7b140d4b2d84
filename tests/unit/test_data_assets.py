"""The shipped assets: regenerated exactly by data/synthetic.py (corpus, task splits, tokenizer),
small, well-formed, with a held-out split disjoint from train, and fitting the tiny model's
sequence length."""

import json
import os
import random

from megatron_slmoe.data.tokenizer import load_tokenizer, train_tokenizer
from megatron_slmoe.data import synthetic
from megatron_slmoe.data.assets import ASSETS_DIR, asset_path
from megatron_slmoe.data.instruction import (InstructionDataset, InstructionStats,
                                             read_instruction_jsonl, render_chat)

FILES = (synthetic.CORPUS_FILE, synthetic.TASK_TRAIN_FILE, synthetic.TASK_EVAL_FILE,
         synthetic.TOKENIZER_FILE)


def _read(name):
    with open(asset_path(name), encoding="utf-8") as f:
        return f.read()


def test_asset_sizes():
    sizes = {name: os.path.getsize(asset_path(name)) for name in FILES}
    assert sum(os.path.getsize(os.path.join(ASSETS_DIR, f)) for f in os.listdir(ASSETS_DIR)) < 2 << 20
    assert 100_000 < sizes[synthetic.CORPUS_FILE] < 400_000
    assert sizes[synthetic.TASK_TRAIN_FILE] < 400_000 and sizes[synthetic.TASK_EVAL_FILE] < 100_000
    assert load_tokenizer(asset_path(synthetic.TOKENIZER_FILE)).vocab_size == synthetic.TOKENIZER_VOCAB


def test_corpus_regenerates_identically():
    shipped = _read(synthetic.CORPUS_FILE)
    docs = shipped[:-1].split("\n\n")
    assert len(docs) == synthetic.CORPUS_DOCS
    assert shipped == synthetic.generate_corpus()
    assert synthetic.generate_corpus(num_docs=25, start=100) == "\n\n".join(docs[100:125]) + "\n"
    for i in random.Random(0).sample(range(len(docs)), 10):
        assert synthetic.corpus_document(i) == docs[i]
    assert "<|" not in shipped  # the base model never sees the chat template


def test_task_regenerates_identically():
    train, evals = synthetic.generate_task()
    assert _read(synthetic.TASK_TRAIN_FILE) == synthetic.records_to_jsonl(train)
    assert _read(synthetic.TASK_EVAL_FILE) == synthetic.records_to_jsonl(evals)


def test_tokenizer_retrains_identically(tmp_path):
    out = tmp_path / "tokenizer.json"
    train_tokenizer([asset_path(synthetic.CORPUS_FILE), asset_path(synthetic.TASK_TRAIN_FILE)],
                    synthetic.TOKENIZER_VOCAB, str(out))
    assert out.read_text(encoding="utf-8") == _read(synthetic.TOKENIZER_FILE)


def test_write_assets_without_tokenizer(tmp_path):
    paths = synthetic.write_assets(str(tmp_path), tokenizer=False)
    assert sorted(paths) == sorted(FILES[:3])
    for name, path in paths.items():
        with open(path, encoding="utf-8") as f:
            assert f.read() == _read(name)


def _digits_lists(records):
    out = []
    for r in records:
        prompts = [r["prompt"]] if "prompt" in r else [m["content"] for m in r["messages"]
                                                       if m["role"] == "user"]
        out += [p.split(": ", 1)[1] for p in prompts]
    return out


def test_task_is_well_formed_and_held_out():
    tok = load_tokenizer(asset_path(synthetic.TOKENIZER_FILE))
    splits = {}
    for name, count in ((synthetic.TASK_TRAIN_FILE, synthetic.TASK_TRAIN),
                        (synthetic.TASK_EVAL_FILE, synthetic.TASK_EVAL)):
        stats = InstructionStats()
        conversations = read_instruction_jsonl(asset_path(name), stats)
        assert stats.examples == count and stats.malformed == 0
        records = [json.loads(line) for line in _read(name).splitlines()]
        kinds = {("prompt" if "prompt" in r else
                  "system" if r["messages"][0]["role"] == "system" else "messages") for r in records}
        assert kinds == {"prompt", "system", "messages"}  # both formats in both splits
        for conv in conversations:
            for user, assistant in zip(conv[-2::-2], conv[-1::-2]):
                words = user["content"].split(": ", 1)[1].split()
                assert assistant["content"] == " ".join(
                    str(synthetic.NUMBER_WORDS.index(w)) for w in words)
            assert len(render_chat(tok, conv)[0]) <= 65  # fits the tiny model's 64 + 1
        splits[name] = records
    train_lists = set(_digits_lists(splits[synthetic.TASK_TRAIN_FILE]))
    eval_lists = _digits_lists(splits[synthetic.TASK_EVAL_FILE])
    assert len(set(eval_lists)) == len(eval_lists) == synthetic.TASK_EVAL
    assert not train_lists & set(eval_lists)
    ds = InstructionDataset(asset_path(synthetic.TASK_TRAIN_FILE), tok, 64)
    assert ds.stats.too_long == 0 and ds.stats.packed_examples == synthetic.TASK_TRAIN
