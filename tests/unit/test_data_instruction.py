"""Instruction data: the chat template, a loss mask that covers exactly the response tokens (checked
against tokenizing the response text alone), packing (lengths, EOS, no example split, too-long
examples counted), malformed records counted and warned with FILE:LINE, a missing file as a
one-line error, deterministic order by seed, a resumed run continuing at the same samples, and
the positions a data-parallel rank reads (which read-ahead follows)."""

import itertools
import json
import logging

import numpy as np
import pytest
import torch

from megatron_slmoe.data.errors import DataError, DataFileNotFoundError
from megatron_slmoe.data.tokenizer import load_tokenizer
from megatron_slmoe.data.assets import asset_path
from megatron_slmoe.data.instruction import (InstructionDataset, InstructionStats,
                                             build_generation_prompt, pack_examples, parse_record,
                                             read_instruction_jsonl, render_chat,
                                             split_for_generation)
from megatron_slmoe.data.sampler import (
    GlobalBatchSampler,
    RankReads,
    ReadAhead,
    collate,
    micro_batches,
    rank_batches,
)

SEQ = 64

GOOD = [
    {"prompt": "Write in digits: one two", "response": "1 2"},
    {"messages": [{"role": "user", "content": "Write in digits: nine"},
                  {"role": "assistant", "content": "9"}]},
    {"messages": [{"role": "system", "content": "You turn number words into digits."},
                  {"role": "user", "content": "Write in digits: three four five"},
                  {"role": "assistant", "content": "3 4 5"}]},
    {"messages": [{"role": "user", "content": "Write in digits: six"},
                  {"role": "assistant", "content": "6"},
                  {"role": "user", "content": "and: seven eight"},
                  {"role": "assistant", "content": "7 8"}]},
    {"prompt": "", "response": "an answer to nothing", "extra": "ignored"},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(asset_path("tokenizer.json"))


def _write_jsonl(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines),
                    encoding="utf-8")
    return str(path)


def _responses(record):
    if "response" in record:
        return [record["response"]]
    return [m["content"] for m in record["messages"] if m["role"] == "assistant"]


def test_render_chat_template(tok):
    ids, targets = render_chat(tok, parse_record(GOOD[2]))
    assert tok.decode(ids) == ("<|system|>You turn number words into digits.<|user|>Write in digits: "
                               "three four five<|assistant|>3 4 5<|eos|>")
    assert len(targets) == len(ids)
    assert [i for i, t in zip(ids, targets) if t] == tok.encode("3 4 5") + [tok.eos_id]
    prompt = build_generation_prompt(tok, parse_record(GOOD[2])[:-1])
    assert prompt == ids[:len(prompt)] and prompt[-1] == tok.role_id("assistant")
    ctx, ref = split_for_generation(parse_record(GOOD[3]))
    assert ref == "7 8" and [m["role"] for m in ctx] == ["user", "assistant", "user"]
    with pytest.raises(DataError):
        build_generation_prompt(tok, parse_record(GOOD[0]))


def test_loss_mask_covers_exactly_the_response_tokens(tok, tmp_path):
    path = _write_jsonl(tmp_path / "good.jsonl", GOOD * 3)
    ds = InstructionDataset(path, tok, SEQ, shuffle=False)
    assert ds.stats.examples == ds.stats.packed_examples == len(GOOD) * 3
    # Independent expectation: each response tokenized alone, followed by EOS, in file order.
    expected = []
    for record in GOOD * 3:
        for response in _responses(record):
            expected += tok.encode(response) + [tok.eos_id]
    got = []
    for i in range(len(ds)):
        s = ds[i]
        assert set(s["loss_mask"].unique().tolist()) <= {0.0, 1.0}
        got += s["labels"][s["loss_mask"] == 1].tolist()
        # Masked-out labels are context: role tokens, system/user text, padding.
        for label, m in zip(s["labels"].tolist(), s["loss_mask"].tolist()):
            if label in (tok.pad_id, tok.role_id("user"), tok.role_id("system"),
                         tok.role_id("assistant")):
                assert m == 0
    assert got == expected
    assert ds.stats.target_tokens == len(expected)


def test_packing_lengths_eos_and_positions(tok, tmp_path):
    path = _write_jsonl(tmp_path / "good.jsonl", GOOD * 8)
    ds = InstructionDataset(path, tok, SEQ, seed=3)
    lengths = sorted(len(render_chat(tok, parse_record(r))[0]) for r in GOOD)
    assert ds.stats.rows < ds.stats.examples  # several examples per row
    eos_total = 0
    for i in range(len(ds)):
        s = ds[i]
        for key in ("tokens", "labels", "position_ids", "segment_ids"):
            assert s[key].shape == (SEQ,) and s[key].dtype == torch.int64
        assert s["loss_mask"].dtype == torch.float32
        assert torch.equal(s["tokens"][1:], s["labels"][:-1])
        row = torch.cat([s["tokens"], s["labels"][-1:]]).tolist()
        content = row[:len(row) - next(i for i, t in enumerate(reversed(row)) if t != tok.pad_id)]
        # Whole examples only: a row starts with a role token and its content ends with EOS.
        assert content[0] in (tok.role_id("user"), tok.role_id("system"))
        assert content[-1] == tok.eos_id
        # Each example is a segment that starts at position 0 (a new segment begins after the
        # EOS that closes an example's last turn and at a user/system token).
        starts = [0] + [i for i in range(1, SEQ) if s["segment_ids"][i] != s["segment_ids"][i - 1]]
        for a, b in zip(starts, starts[1:] + [SEQ]):
            assert torch.equal(s["position_ids"][a:b], torch.arange(b - a))
            assert len(set(s["segment_ids"][a:b].tolist())) == 1
        for a in starts[1:]:
            assert row[a - 1] in (tok.eos_id, tok.pad_id) or row[a] == tok.pad_id
        assert s["segment_ids"].tolist() == sorted(s["segment_ids"].tolist())
        assert all(t == tok.pad_id for t in row[len(content):])
        assert s["loss_mask"][len(content) - 1:].sum() == 0  # nothing learnt on padding
        eos_total += content.count(tok.eos_id)
    assert eos_total == sum(len(_responses(r)) for r in GOOD * 8)
    assert ds.stats.pad_tokens == sum(
        int((ds[i]["labels"] == tok.pad_id).sum()) for i in range(len(ds)))
    assert lengths[-1] <= SEQ + 1


def test_too_long_examples_are_skipped_and_counted(tok, tmp_path, caplog):
    long = {"prompt": "Write in digits: " + " ".join(["seven"] * 80), "response": "7"}
    path = _write_jsonl(tmp_path / "mixed.jsonl", [GOOD[0], long, GOOD[1]])
    with caplog.at_level(logging.WARNING, logger="megatron_slmoe.data.instruction"):
        ds = InstructionDataset(path, tok, 16, shuffle=False)
    assert ds.stats.too_long == 1 and ds.stats.packed_examples == 2
    assert "longer than seq_length+1=17" in caplog.text
    # An example of exactly seq_length + 1 tokens fits one row.
    ids, targets = render_chat(tok, parse_record(GOOD[0]))
    stats = InstructionStats()
    rows, flags, _ = pack_examples([(ids, targets)], len(ids) - 1, tok.pad_id, stats)
    assert rows.shape == (1, len(ids)) and stats.too_long == 0 and stats.pad_tokens == 0


MALFORMED = [
    ("{not json", "bad json"),
    ('["a", "list"]', "not an object"),
    ({"prompt": "hi"}, "missing key"),
    ({"response": "x"}, "missing key"),
    ({"prompt": "hi", "response": 7}, "wrong type"),
    ({"prompt": "hi", "response": "   "}, "empty response"),
    ({"text": "plain"}, "missing key"),
    ({"prompt": "a", "response": "b", "messages": []}, "both formats"),
    ({"messages": "hello"}, "wrong type"),
    ({"messages": []}, "empty response"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]},
     "unknown role"),
    ({"messages": [{"role": "user", "content": "a"}]}, "bad turn order"),
    ({"messages": [{"role": "assistant", "content": "a"}]}, "bad turn order"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]},
     "empty response"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "b"}]}, "missing key"),
    ({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "b"}]},
     "wrong type"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                   {"role": "assistant", "content": "c"}]}, "bad turn order"),
    ('{"prompt": "a", "response": "\\ud800"}', "invalid utf-8"),
]


def test_malformed_records_are_counted_and_warned_with_file_and_line(tok, tmp_path, caplog):
    lines, bad_lines = [], {}
    for i, (record, reason) in enumerate(MALFORMED):
        lines.append(GOOD[i % len(GOOD)])
        lines.append(record)
        bad_lines[len(lines)] = reason
        if i % 4 == 0:
            lines.append("   ")  # blank lines are neither records nor errors
    path = _write_jsonl(tmp_path / "mixed.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="megatron_slmoe.data.instruction"):
        ds = InstructionDataset(path, tok, SEQ, max_warnings=100)
    assert ds.stats.malformed == len(MALFORMED)
    assert ds.stats.examples == len(MALFORMED)
    assert ds.stats.records == 2 * len(MALFORMED)
    expected_reasons = {}
    for reason in bad_lines.values():
        expected_reasons[reason] = expected_reasons.get(reason, 0) + 1
    assert ds.stats.by_reason == expected_reasons
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for lineno in bad_lines:
        assert any(m.startswith(f"{path}:{lineno}: skipped malformed record") for m in warned), lineno
    assert len(warned) == len(MALFORMED)
    assert all("\n" not in m for m in warned)
    assert f"{len(MALFORMED)} malformed" in ds.stats.summary()


def test_warnings_are_capped_per_file(tok, tmp_path, caplog):
    path = _write_jsonl(tmp_path / "bad.jsonl", [GOOD[0]] + ["{oops"] * 30)
    with caplog.at_level(logging.WARNING, logger="megatron_slmoe.data.instruction"):
        examples = read_instruction_jsonl(path, max_warnings=5)
    assert len(examples) == 1
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 6 and "25 more malformed records skipped" in warned[-1]


def test_missing_file_and_no_usable_examples(tok, tmp_path):
    with pytest.raises(DataFileNotFoundError) as e:
        InstructionDataset(str(tmp_path / "nope.jsonl"), tok, SEQ)
    assert "\n" not in str(e.value) and "nope.jsonl" in str(e.value)
    with pytest.raises(DataError, match="no usable instruction examples"):
        InstructionDataset(_write_jsonl(tmp_path / "bad.jsonl", ["{oops"]), tok, SEQ)


def _all_tokens(ds):
    return torch.stack([ds[i]["tokens"] for i in range(len(ds))])


def test_order_is_deterministic_by_seed_with_epochs(tok):
    path = asset_path("digits_eval.jsonl")
    a = InstructionDataset(path, tok, SEQ, seed=7, num_samples=130)
    b = InstructionDataset(path, tok, SEQ, seed=7, num_samples=130)
    c = InstructionDataset(path, tok, SEQ, seed=8, num_samples=130)
    assert torch.equal(_all_tokens(a), _all_tokens(b))
    assert not torch.equal(_all_tokens(a), _all_tokens(c))
    rows = a.rows_per_epoch
    assert 130 > 2 * rows  # three epochs
    epochs = [[a.row_index(i) for i in range(e * rows, min((e + 1) * rows, 130))] for e in range(3)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(rows))  # each epoch: every row once
    assert epochs[0] != epochs[1]                                       # in a new order
    plain = InstructionDataset(path, tok, SEQ, shuffle=False)
    first = read_instruction_jsonl(path)[0]
    assert plain[0]["tokens"][:len(render_chat(tok, first)[0])].tolist() == render_chat(tok, first)[0]
    with pytest.raises(IndexError):
        a[130]


def test_resume_continues_at_the_same_samples(tok):
    ds = InstructionDataset(asset_path("digits_eval.jsonl"), tok, SEQ, seed=1, num_samples=96)
    gbs, mbs, dp = 8, 2, 2
    straight = [[collate([ds[i] for i in mb]) for rank in range(dp)
                 for mb in micro_batches(gb, mbs, rank, dp)]
                for gb in GlobalBatchSampler(len(ds), gbs)]
    assert len(straight) == 12

    sampler = GlobalBatchSampler(len(ds), gbs)
    first = [next(iter(sampler)) for _ in range(5)]
    assert first[-1] == range(32, 40)
    state = sampler.state_dict()
    assert state == {"consumed_samples": 40, "global_batch_size": 8}

    resumed = GlobalBatchSampler(len(ds), gbs)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a checkpoint round trip
    assert len(resumed) == 7
    rest = [[collate([ds[i] for i in mb]) for rank in range(dp)
             for mb in micro_batches(gb, mbs, rank, dp)] for gb in resumed]
    assert len(rest) == 7
    for want, got in zip(straight[5:], rest):
        for w, g in zip(want, got):
            assert all(torch.equal(w[k], g[k]) for k in w)
    assert resumed.consumed_samples == 96 and list(resumed) == []


def test_micro_batches_partition_the_global_batch():
    gb = range(16, 32)
    parts = [micro_batches(gb, 2, rank, 4) for rank in range(4)]
    assert [list(r) for p in parts for r in p] == [[i, i + 1] for i in range(16, 32, 2)]
    assert parts[1] == [range(20, 22), range(22, 24)]
    with pytest.raises(DataError, match="not divisible"):
        micro_batches(gb, 3, 0, 2)
    with pytest.raises(DataError, match="rank"):
        micro_batches(gb, 2, 4, 4)
    with pytest.raises(DataError, match="outside"):
        GlobalBatchSampler(10, 2, consumed_samples=12)


def _positions_read(sampler, rank, dp):
    """Every position rank ``rank`` reads, in order, as the engine cuts the batches."""
    return [i for gb in sampler for mb in micro_batches(gb, 2, rank, dp) for i in mb]


@pytest.mark.parametrize("rank", [0, 2])
def test_rank_reads_are_the_positions_the_rank_reads(rank):
    reads = RankReads(global_batch_size=16, data_parallel_rank=rank, data_parallel_size=4)
    read = _positions_read(GlobalBatchSampler(96, 16), rank, 4)
    assert all(reads.mine(p) for p in read)
    assert sum(reads.mine(p) for p in range(96)) == len(read)
    for i, position in enumerate(read[:-10]):
        assert list(itertools.islice(reads.after(position), 10)) == read[i + 1:i + 11]
    # A run resumed at 40 with global batches of 24: the first position read realigns them.
    resumed = _positions_read(GlobalBatchSampler(136, 24, consumed_samples=40), rank, 4)
    reads = RankReads(24, rank, 4)
    assert not reads.mine(resumed[0])
    aligned = reads.aligned_to(resumed[0])
    assert list(itertools.islice(aligned.after(resumed[0]), 20)) == resumed[1:21]
    with pytest.raises(DataError, match="not divisible"):
        RankReads(10, 0, 4)
    with pytest.raises(DataError, match="rank"):
        RankReads(16, 4, 4)


def _misses(positions, ahead: ReadAhead) -> list[int]:
    """The positions read before read-ahead offered them (every offer taken)."""
    offered, missed = set(), []
    for position in positions:
        if position not in offered:
            missed.append(position)
        offer = ahead.offer(position)
        ahead.taken(offer, len(offer))
        offered.update(offer)
    return missed


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_read_ahead_offers_each_position_before_it_is_read(rank):
    # A fresh run: only the first read comes unannounced.
    read = _positions_read(GlobalBatchSampler(1200, 24), rank, 4)
    assert _misses(read, ReadAhead(RankReads(24, rank, 4), 32, 1200)) == read[:1]
    # Resumed at 50 with global batches of 24 (the run had others): 50 may look like this
    # rank's under the old alignment; the batches realign at the first read that is not.
    read = _positions_read(GlobalBatchSampler(1200, 24, consumed_samples=50), rank, 4)
    assert len(_misses(read, ReadAhead(RankReads(24, rank, 4), 32, 1200))) <= 2
    # Two evaluations of 4 batches of 64 each read a held-out set of 100 from the start,
    # wrapping around it (the engine reads position i % 100): batches move against the set's
    # positions, at most one unannounced read per batch (before this, whole runs of them).
    read = [i % 100 for i in _positions_read(GlobalBatchSampler(256, 64), rank, 4)]
    assert len(_misses(read + read, ReadAhead(RankReads(64, rank, 4), 32, 100))) <= 2 * 4
    # Without a share every next position is offered.
    assert _misses(range(50), ReadAhead(None, 8, 50)) == [0]


def test_rank_batches_collates(tok):
    ds = InstructionDataset(asset_path("digits_eval.jsonl"), tok, SEQ)
    batches = list(rank_batches(ds, GlobalBatchSampler(8, 4), 2, data_parallel_rank=1,
                                data_parallel_size=2))
    assert len(batches) == 2 and len(batches[0]) == 1
    mb = batches[1][0]
    assert mb["tokens"].shape == (2, SEQ) and torch.equal(mb["tokens"][0], ds[6]["tokens"])
    assert np.isclose(float(mb["loss_mask"].sum()),
                      float(ds[6]["loss_mask"].sum() + ds[7]["loss_mask"].sum()))


def test_the_dataset_itself_refuses_mostly_malformed_files(tmp_path):
    """The --max-malformed-fraction rule lives in the dataset: files read from object storage
    (which the checks before start-up do not open) are held to it as local ones are."""
    from megatron_slmoe.data.assets import asset_path
    from megatron_slmoe.data.errors import DataError
    from megatron_slmoe.data.instruction import InstructionDataset
    from megatron_slmoe.data.tokenizer import load_tokenizer

    path = tmp_path / "mostly-bad.jsonl"
    path.write_text('{"prompt": "one", "response": "1"}\n{"prompt": 3}\n"a string"\n')
    tokenizer = load_tokenizer(asset_path("tokenizer.json"))
    with pytest.raises(DataError, match="2 of 3 records are malformed, more than "
                                        "--max-malformed-fraction 0.1"):
        InstructionDataset(str(path), tokenizer, 64, max_malformed_fraction=0.1)
    assert len(InstructionDataset(str(path), tokenizer, 64)) == 1  # no limit given: one example
