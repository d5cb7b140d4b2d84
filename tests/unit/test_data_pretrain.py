"""Pretraining data: tools/preprocess_data.py writes Megatron .bin/.idx whose IndexedDataset reads
back the tokenized documents plus EOS; bad records are counted and warned with FILE:LINE; missing
files are one-line errors; Megatron's GPTDataset (through BlendedMegatronDatasetBuilder, with the
shipped compiled helpers) serves deterministic fixed-length samples from them."""

import importlib.util
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_slmoe.data.errors import DataError, DataFileNotFoundError
from megatron_slmoe.data.tokenizer import load_tokenizer
from megatron_slmoe.data.assets import asset_path
from megatron_slmoe.data.pretrain import build_pretrain_datasets, load_indexed_dataset, preprocess

ROOT = Path(__file__).resolve().parents[2]

DOCS = ["3 plus 4 is 7.\nthe cow says moo.", "count: 1 2 3.", "unicode ☃ and tabs\tkept",
        "the opposite of hot is cold.\n  indented line\nlast line."]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(asset_path("tokenizer.json"))


def _tool():
    spec = importlib.util.spec_from_file_location("preprocess_data_tool",
                                                  ROOT / "tools" / "preprocess_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read_all(prefix):
    ds = load_indexed_dataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds


def test_text_round_trip_through_indexed_dataset(tok, tmp_path, capsys):
    text = "\n\n\n".join(DOCS[:2]) + "\n\n" + DOCS[2] + "\n   \n" + DOCS[3] + "\n"
    (tmp_path / "in.txt").write_text(text, encoding="utf-8")
    prefix = str(tmp_path / "out" / "corpus")
    assert _tool().main(["--input", str(tmp_path / "in.txt"), "--tokenizer",
                         asset_path("tokenizer.json"), "--output-prefix", prefix, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    docs, ds = _read_all(prefix)
    assert docs == [tok.encode(d) + [tok.eos_id] for d in DOCS]
    assert summary["documents"] == 4 and summary["tokens"] == sum(map(len, docs))
    assert ds[0].dtype == np.uint16
    assert list(ds.document_indices) == [0, 1, 2, 3, 4]
    assert sorted(os.listdir(tmp_path / "out")) == ["corpus.bin", "corpus.idx"]  # no temp files


def test_document_per_line_and_no_eos(tok, tmp_path):
    (tmp_path / "in.txt").write_text("one two\n\nthree\nfour five\n", encoding="utf-8")
    preprocess(str(tmp_path / "in.txt"), tok, str(tmp_path / "p"), document_per_line=True,
               append_eos=False)
    docs, _ = _read_all(str(tmp_path / "p"))
    assert docs == [tok.encode(t) for t in ("one two", "three", "four five")]


def test_jsonl_bad_records_are_counted_and_warned(tok, tmp_path, caplog):
    lines = [json.dumps({"text": DOCS[0]}), "{broken", json.dumps({"body": "x"}),
             json.dumps({"text": 5}), "", json.dumps({"text": "  "}), json.dumps(["text"]),
             json.dumps({"text": DOCS[1], "id": 3})]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="megatron_slmoe.data.pretrain"):
        stats = preprocess(str(path), tok, str(tmp_path / "j"))
    assert stats.documents == 2 and stats.skipped == 5
    assert stats.by_reason == {"bad json": 1, "missing key": 2, "wrong type": 1, "empty": 1}
    for lineno in (2, 3, 4, 6, 7):
        assert any(r.getMessage().startswith(f"{path}:{lineno}: skipped") for r in caplog.records)
    docs, _ = _read_all(str(tmp_path / "j"))
    assert docs == [tok.encode(DOCS[0]) + [tok.eos_id], tok.encode(DOCS[1]) + [tok.eos_id]]


def test_invalid_utf8_line_is_skipped(tok, tmp_path, caplog):
    path = tmp_path / "in.txt"
    path.write_bytes(b"good line\n\xff\xfe bad\nmore good\n\nnext doc\n")
    with caplog.at_level(logging.WARNING, logger="megatron_slmoe.data.pretrain"):
        stats = preprocess(str(path), tok, str(tmp_path / "u"))
    assert stats.by_reason == {"invalid utf-8": 1}
    assert f"{path}:2: skipped" in caplog.text
    docs, _ = _read_all(str(tmp_path / "u"))
    assert docs == [tok.encode("good line\nmore good") + [1], tok.encode("next doc") + [1]]


def test_missing_files_are_one_line_errors(tok, tmp_path, capsys):
    tool = _tool()
    for args in (["--input", str(tmp_path / "none.txt"), "--tokenizer", asset_path("tokenizer.json")],
                 ["--input", asset_path("corpus.txt"), "--tokenizer", str(tmp_path / "t.json")]):
        assert tool.main(args + ["--output-prefix", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "not found" in err
    with pytest.raises(DataFileNotFoundError, match="x.idx"):
        load_indexed_dataset(str(tmp_path / "x"))
    (tmp_path / "empty.txt").write_text("\n\n", encoding="utf-8")
    with pytest.raises(DataError, match="no documents"):
        preprocess(str(tmp_path / "empty.txt"), tok, str(tmp_path / "e"))
    assert not list(tmp_path.glob("e.*")) and not list(tmp_path.glob("x.*"))


def test_gpt_datasets_from_the_corpus(tok, tmp_path):
    prefix = str(tmp_path / "corpus")
    preprocess(asset_path("corpus.txt"), tok, prefix)
    docs, _ = _read_all(prefix)
    seq = 32
    train, valid, test = build_pretrain_datasets(prefix, tok, seq, train_samples=200,
                                                 valid_samples=20, split="90,10,0", seed=5)
    assert test is None and len(train) >= 200 and len(valid) >= 20
    for i in (0, 1, 57, len(train) - 1):
        s = train[i]
        assert sorted(s) == ["labels", "loss_mask", "position_ids", "tokens"]
        assert s["tokens"].shape == (seq,) and s["tokens"].dtype == torch.int64
        assert torch.equal(s["tokens"][1:], s["labels"][:-1])
        assert torch.equal(s["position_ids"], torch.arange(seq))
        assert torch.all(s["loss_mask"] == 1)
        assert int(s["tokens"].max()) < tok.vocab_size
    # Every sample is a window of whole documents in some order: each doc it fully contains is a
    # document of the corpus.
    eos = tok.eos_id
    full = torch.cat([train[3]["tokens"], train[3]["labels"][-1:]]).tolist()
    cuts = [j for j, t in enumerate(full) if t == eos]
    known = {tuple(d) for d in docs}
    for a, b in zip(cuts, cuts[1:]):
        assert tuple(full[a + 1:b + 1]) in known
    again = build_pretrain_datasets(prefix, tok, seq, train_samples=200, valid_samples=20,
                                    split="90,10,0", seed=5)[0]
    assert all(torch.equal(train[i]["tokens"], again[i]["tokens"]) for i in range(0, 200, 13))
    other = build_pretrain_datasets(prefix, tok, seq, train_samples=200, valid_samples=20,
                                    split="90,10,0", seed=6)[0]
    assert not all(torch.equal(train[i]["tokens"], other[i]["tokens"]) for i in range(20))
    assert os.path.isdir(tmp_path / "index-cache")


def test_gpt_datasets_missing_prefix(tok, tmp_path):
    with pytest.raises(DataFileNotFoundError) as e:
        build_pretrain_datasets(str(tmp_path / "nothing"), tok, 16, 10)
    assert "\n" not in str(e.value) and "preprocess_data.py" in str(e.value)
