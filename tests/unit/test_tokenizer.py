"""Byte-level BPE tokenizers: the shipped tokenizer round-trips any text and has the special tokens
at fixed ids; training is deterministic; bad tokenizer files and bad arguments are one-line errors;
tools/train_tokenizer.py writes a loadable tokenizer and answers bad input with exit code 2."""

import importlib.util
import json
from pathlib import Path

import pytest

from megatron_slmoe.data.errors import DataError, DataFileNotFoundError
from megatron_slmoe.data.tokenizer import load_tokenizer, train_tokenizer
from megatron_slmoe.data.assets import asset_path
from megatron_slmoe.data.tokenizer import SPECIAL_TOKENS

ROOT = Path(__file__).resolve().parents[2]

TEXTS = [
    "",
    "seven plus seven is fourteen.",
    "Write in digits: seven two nine",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\nand blank\n\nlines\n",
    "unicode: héllo wörld — ☃ 日本語 🙂",
    "text that looks special: <|eos|> <|user|><|assistant|> <|pad|>",
    "digits 0123456789 and punctuation !@#$%^&*()[]{};:'\",.<>/?\\|`~",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(asset_path("tokenizer.json"))


def test_shipped_tokenizer_round_trips(tok):
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text


def test_special_tokens_have_fixed_ids(tok):
    assert tok.special_tokens == {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    assert tok.vocab_size <= 512
    for role, name in (("system", "<|system|>"), ("user", "<|user|>"), ("assistant", "<|assistant|>")):
        assert tok.role_id(role) == tok.token_to_id(name)
    with pytest.raises(DataError, match="unknown chat role"):
        tok.role_id("tool")


def test_special_token_text_is_plain_text_unless_allowed(tok):
    ids = tok.encode("a<|eos|>b")
    assert tok.eos_id not in ids and tok.decode(ids) == "a<|eos|>b"
    ids = tok.encode("a<|eos|>b", allow_special=True)
    assert tok.eos_id in ids
    assert tok.decode(ids) == "a<|eos|>b"
    assert tok.decode(ids, skip_special_tokens=True) == "ab"
    assert tok.encode_batch(["a<|eos|>", "b"]) == [tok.encode("a<|eos|>"), tok.encode("b")]


def test_megatron_duck_type(tok):
    assert tok.eod == tok.eos == tok.eos_id and tok.pad == tok.pad_id and tok.bos == tok.bos_id
    assert tok.tokenize("one two") == tok.encode("one two")
    assert tok.detokenize(tok.tokenize("one two")) == "one two"
    assert len(tok.vocab) == tok.vocab_size
    assert tok.special_tokens_dict["pad_token"] == tok.pad_id
    assert json.dumps(tok.unique_identifiers)  # Megatron serialises it into its cache description


def _write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_train_tokenizer_is_deterministic_and_round_trips(tmp_path):
    corpus = _write(tmp_path / "c.txt", "\n".join(f"the {w} says {w}{i % 7}." for i, w in
                                                 enumerate(["cow", "dog", "cat", "owl"] * 50)))
    chat = _write(tmp_path / "c.jsonl", json.dumps({"prompt": "hello there", "response": "hi"}) + "\n"
                  + json.dumps({"messages": [{"role": "user", "content": "count"},
                                             {"role": "assistant", "content": "1 2 3"}]}) + "\n"
                  + "not json\n")
    a = train_tokenizer([corpus, chat], 300, str(tmp_path / "a.json"))
    b = train_tokenizer([corpus, chat], 300, str(tmp_path / "b.json"))
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert a.vocab_size <= 300
    assert a.special_tokens == {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    assert len(a.encode("the cow says cow3.")) < len("the cow says cow3.")  # merges were learnt
    loaded = load_tokenizer(str(tmp_path / "a.json"))
    for text in TEXTS:
        assert loaded.decode(loaded.encode(text)) == text
    assert b.encode("hello there") == loaded.encode("hello there")


def test_train_tokenizer_rejects_bad_arguments(tmp_path):
    corpus = _write(tmp_path / "c.txt", "some text\n")
    with pytest.raises(DataError, match="below 262"):
        train_tokenizer([corpus], 100, str(tmp_path / "t.json"))
    with pytest.raises(DataFileNotFoundError, match="not found"):
        train_tokenizer([str(tmp_path / "missing.txt")], 300, str(tmp_path / "t.json"))
    with pytest.raises(DataError, match="<\\|eos\\|>"):
        train_tokenizer([corpus], 300, str(tmp_path / "t.json"), special_tokens=["<|pad|>"])
    assert not (tmp_path / "t.json").exists()


def _one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


def test_load_missing_or_invalid_tokenizer_is_one_line_error(tmp_path):
    with pytest.raises(DataFileNotFoundError) as e:
        load_tokenizer(str(tmp_path / "nope.json"))
    assert str(tmp_path / "nope.json") in _one_line(e)
    with pytest.raises(DataFileNotFoundError, match="directory"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(DataError) as e:
        load_tokenizer(_write(tmp_path / "bad.json", "{ this is not json"))
    assert "not a valid tokenizer.json" in _one_line(e)
    with pytest.raises(DataError) as e:
        load_tokenizer(_write(tmp_path / "empty.json", '{"model": {"type": "BPE"}}'))
    assert "empty.json" in _one_line(e)


def test_tokenizer_without_eos_is_rejected(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.add_special_tokens(["<|pad|>"])
    path = str(tmp_path / "noeos.json")
    backend.save(path)
    with pytest.raises(DataError, match="<\\|eos\\|> missing") as e:
        load_tokenizer(path)
    _one_line(e)


def _tool():
    spec = importlib.util.spec_from_file_location("train_tokenizer_tool",
                                                  ROOT / "tools" / "train_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_tokenizer_tool(tmp_path, capsys):
    tool = _tool()
    corpus = _write(tmp_path / "c.txt", "one two three four five six seven\n" * 20)
    out = tmp_path / "sub" / "tok.json"
    assert tool.main(["--input", corpus, "--vocab-size", "280", "--output", str(out)]) == 0
    assert "vocab_size" in capsys.readouterr().out
    assert load_tokenizer(str(out)).decode(load_tokenizer(str(out)).encode("one two")) == "one two"
    assert tool.main(["--input", str(tmp_path / "missing.txt"), "--vocab-size", "280",
                      "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "missing.txt" in err
