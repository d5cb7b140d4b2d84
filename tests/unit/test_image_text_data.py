"""Image-text data on energon datasets: LLaVA-style JSON -> shards with energon's metadata (read back
by energon's own factory and tar index), samples with image placeholders where the text says
``<image>`` and a loss mask on the answer only (checked against the chat template and the image
preprocessing done independently), and each bad-sample case counted, named by shard and sample in
the log and skipped to the next record, never a crash and never a wrong sample."""

import io
import json
import logging
import os
import tarfile

import pytest
import torch
from PIL import Image

from megatron_slmoe.data.errors import DataError
from megatron_slmoe.data.tokenizer import load_tokenizer
from megatron_slmoe.data.assets import asset_path
from megatron_slmoe.data.image import ImagePreprocessConfig, decode_image, preprocess_image
from megatron_slmoe.data.image_inputs import ImageTokens, TiledImages
from megatron_slmoe.data.image_text import (
    REASONS,
    ImageTextDataset,
    collate_image_text,
    reduce_skip_counts,
)
from megatron_slmoe.data.image_text_prepare import (
    ShardRecord,
    index_energon_dataset,
    prepare_from_llava_json,
    write_shards,
)
from megatron_slmoe.data.instruction import render_chat

SEQ = 48
IMAGE = -200
TILE_TOKENS = 4
PREPROCESS = ImagePreprocessConfig(img_h=16, img_w=16)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(asset_path("tokenizer.json"))


def _png(colour, size=(20, 12)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


def _dataset(path, tok, **kw):
    return ImageTextDataset(str(path), tok, SEQ,
                            images=TiledImages(PREPROCESS, IMAGE, TILE_TOKENS),
                            shuffle=kw.pop("shuffle", False), **kw)


def _chat(user, answer):
    return [{"from": "human", "value": user}, {"from": "gpt", "value": answer}]


@pytest.fixture(scope="module")
def llava_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava")
    (root / "img").mkdir()
    colours = [(200, 10, 10), (10, 200, 10), (10, 10, 200), (90, 90, 90)]
    for i, colour in enumerate(colours):
        (root / "img" / f"{i}.png").write_bytes(_png(colour))
    good = [
        {"id": "one", "image": "0.png", "conversations": _chat("<image>\nWhat colour?", "red")},
        {"id": "two", "images": ["1.png", "2.png"],
         "conversations": _chat("Compare <image> with <image>.", "green then blue")},
        {"id": "none", "conversations": _chat("Say hi.", "hi")},
        {"id": "turns", "image": "3.png",
         "conversations": _chat("<image>\nColour?", "grey") + _chat("Sure?", "yes")},
    ]
    (root / "img" / "broken.png").write_bytes(_png((1, 2, 3))[:40])
    (root / "outside.png").write_bytes(_png((1, 2, 3)))
    bad = [
        {"id": "broken", "image": "broken.png", "conversations": _chat("<image>\nQ?", "A")},
        {"id": "escape", "image": "../outside.png", "conversations": _chat("<image>\nQ?", "A")},
        {"id": "mismatch", "image": "0.png", "conversations": _chat("<image> <image> Q?", "A")},
        {"id": "missing", "image": "nope.png", "conversations": _chat("<image>\nQ?", "A")},
        {"id": "malformed", "conversations": [{"from": "robot", "value": "beep"}]},
    ]
    (root / "train.json").write_text(json.dumps(good + bad))
    (root / "val.json").write_text(json.dumps(good[:1]))
    return root


def test_prepare_counts_and_names_bad_records(llava_folder, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    written, stats = prepare_from_llava_json(
        str(tmp_path / "out"), str(llava_folder / "train.json"), str(llava_folder / "img"),
        val_json=str(llava_folder / "val.json"), samples_per_shard=3)
    assert written == {"train": 4, "val": 1}
    assert {k: v for k, v in stats["train"].skipped.items() if v} == {
        "undecodable image": 1, "path escapes dataset": 1, "image count mismatch": 1,
        "missing image": 1, "malformed record": 1}
    for ident in ("broken", "escape", "mismatch", "missing", "malformed"):
        assert any(f"(id {ident})" in r.getMessage() and "train.json" in r.getMessage()
                   for r in caplog.records), ident
    meta = sorted(os.listdir(tmp_path / "out" / ".nv-meta"))
    assert {"dataset.yaml", "split.yaml", ".info.json", "index.sqlite"} <= set(meta)
    assert sorted(os.listdir(tmp_path / "out" / "train")) == [
        "shard-000000.tar", "shard-000000.tar.idx", "shard-000001.tar", "shard-000001.tar.idx"]
    assert [p for p in os.listdir(tmp_path) if ".tmp-" in p] == []  # no staging left behind


def test_prepare_refuses_existing_output_and_missing_inputs(llava_folder, tmp_path):
    (tmp_path / "exists").mkdir()
    with pytest.raises(DataError, match="already exists"):
        prepare_from_llava_json(str(tmp_path / "exists"), str(llava_folder / "train.json"),
                                str(llava_folder / "img"))
    with pytest.raises(DataError, match="not found"):
        prepare_from_llava_json(str(tmp_path / "new"), str(llava_folder / "nope.json"),
                                str(llava_folder / "img"))
    assert not (tmp_path / "new").exists()


@pytest.fixture(scope="module")
def chat_dataset(llava_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("chat") / "ds"
    prepare_from_llava_json(str(out), str(llava_folder / "train.json"),
                            str(llava_folder / "img"), val_json=str(llava_folder / "val.json"))
    return out


def _expected(tok, user_assistant_pairs, image_files):
    messages = []
    for user, answer in user_assistant_pairs:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    ids, targets = render_chat(ImageTokens(tok, IMAGE), messages)
    pixels = [preprocess_image(decode_image(open(p, "rb").read()), PREPROCESS)
              for p in image_files]
    return ids, targets, pixels


def test_samples_place_images_where_the_text_says(chat_dataset, llava_folder, tok):
    dataset = _dataset(chat_dataset, tok)
    assert len(dataset) == 4
    img = llava_folder / "img"
    cases = [
        ([("<image>\nWhat colour?", "red")], [img / "0.png"]),
        ([("Compare <image> with <image>.", "green then blue")], [img / "1.png", img / "2.png"]),
        ([("Say hi.", "hi")], []),
        ([("<image>\nColour?", "grey"), ("Sure?", "yes")], [img / "3.png"]),
    ]
    for i, (pairs, files) in enumerate(cases):
        sample = dataset[i]
        ids, targets, pixels = _expected(tok, pairs, files)
        n = len(ids) - 1
        assert sample["tokens"][:n].tolist() == ids[:-1]
        assert sample["labels"][:n].tolist() == ids[1:]
        assert sample["loss_mask"][:n].tolist() == [float(t) for t in targets[1:]]
        assert (sample["tokens"][n:] == tok.pad_id).all() and sample["loss_mask"][n:].sum() == 0
        assert (sample["tokens"] == IMAGE).sum() == len(files)
        assert sample["num_image_tiles"].tolist() == [1] * len(files)
        expected_pixels = torch.cat(pixels) if pixels else torch.zeros(0, 3, 16, 16)
        assert torch.equal(sample["images"], expected_pixels)
        answer_ids = [t for t, m in zip(sample["labels"].tolist(), sample["loss_mask"].tolist())
                      if m]
        assert tok.decode(answer_ids) == "<|eos|>".join(a for _, a in pairs) + "<|eos|>"
    assert dataset.stats.samples == 4 and dataset.stats.total_skipped == 0


def test_collate_concatenates_images_in_sample_order(chat_dataset, tok):
    dataset = _dataset(chat_dataset, tok)
    samples = [dataset[i] for i in range(4)]
    batch = collate_image_text(samples)
    assert batch["tokens"].shape == (4, SEQ)
    assert batch["images"].shape == (4, 3, 16, 16)  # 1 + 2 + 0 + 1 images
    assert batch["num_image_tiles"].tolist() == [1, 1, 1, 1]
    assert torch.equal(batch["images"][1:3], samples[1]["images"])


@pytest.mark.parametrize("kind, user", [("vqa", "<image>\nWhat colour?"),
                                        ("caption", "<image>\nDescribe the image.")])
def test_energon_vqa_and_caption_samples(llava_folder, tmp_path, tok, kind, user):
    records = [{"id": "q", "image": "0.png", "conversations": _chat("What colour?", "red")}]
    records[0]["conversations"][0]["value"] = "<image>\nWhat colour?"
    (tmp_path / "one.json").write_text(json.dumps(records))
    prepare_from_llava_json(str(tmp_path / kind), str(tmp_path / "one.json"),
                            str(llava_folder / "img"), kind=kind)
    sample = _dataset(tmp_path / kind, tok)[0]
    ids, _, pixels = _expected(tok, [(user, "red")], [llava_folder / "img" / "0.png"])
    assert sample["tokens"][:len(ids) - 1].tolist() == ids[:-1]
    assert torch.equal(sample["images"], pixels[0])
    (prompt, pixels_g, counts), answer = _split(_dataset(tmp_path / kind, tok))
    assert answer == "red" and prompt[-1] == tok.role_id("assistant") and counts.tolist() == [1]


def _split(dataset):
    (example, answer), = dataset.generation_examples(limit=1)
    return (example.tokens, example.images, example.num_image_tiles), answer


def test_vqa_requires_one_image_and_one_exchange(llava_folder, tmp_path):
    _, stats = prepare_from_llava_json(str(tmp_path / "vqa"), str(llava_folder / "train.json"),
                                       str(llava_folder / "img"), kind="vqa")
    assert stats["train"].skipped["wrong sample type"] == 3  # two images, none, two turns


# --- bad samples inside shards ------------------------------------------------------------------


def _member(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _chat_json(user, answer="fine"):
    return json.dumps({"messages": [{"role": "user", "content": user},
                                    {"role": "assistant", "content": answer}]}).encode()


@pytest.fixture(scope="module")
def bad_shards(tmp_path_factory):
    """One good chat sample between each kind of bad one, in two shards."""
    root = tmp_path_factory.mktemp("bad") / "ds"
    (root / "train").mkdir(parents=True)
    good = _png((200, 10, 10))
    truncated = _png((1, 2, 3), size=(64, 64))
    with tarfile.open(root / "train" / "a.tar", "w") as tar:
        for key, user, image in [("good0", "<image> ok", good),
                                 ("corrupt", "<image> ok", b"GIF89a" + bytes(30)),
                                 ("good1", "<image> ok", good),
                                 ("truncated", "<image> ok", truncated[:len(truncated) // 2]),
                                 ("good2", "<image> ok", good)]:
            _member(tar, f"{key}.json", _chat_json(user))
            _member(tar, f"{key}.img0.png", image)
    with tarfile.open(root / "train" / "b.tar", "w") as tar:
        _member(tar, "mismatch.json", _chat_json("<image> and <image>"))
        _member(tar, "mismatch.img0.png", good)
        _member(tar, "good3.json", _chat_json("<image> ok"))
        _member(tar, "good3.img0.png", good)
        _member(tar, "../escape.json", _chat_json("<image> ok"))
        _member(tar, "../escape.img0.png", good)
        _member(tar, "badjson.json", b"{not json")
        _member(tar, "good4.json", _chat_json("<image> ok", "last"))
        _member(tar, "good4.img0.png", good)
        _member(tar, "long.json", _chat_json("<image> " + "word " * SEQ))
        _member(tar, "long.img0.png", good)
    index_energon_dataset(str(root), "chat")
    return root


EXPECTED_SKIPS = {"undecodable image": 2, "image count mismatch": 1, "path escapes dataset": 1,
                  "malformed record": 1, "too long": 1}


def test_each_bad_case_is_counted_named_and_skipped(bad_shards, tok, caplog):
    caplog.set_level(logging.WARNING)
    dataset = _dataset(bad_shards, tok)
    assert dataset.records == 11
    samples = [dataset[i] for i in range(dataset.records)]  # never raises
    good = {0, 2, 4, 6, 9}
    for i in range(dataset.records):
        j = next(k for k in sorted(good) + [min(good) + 11] if k >= i) % 11
        assert torch.equal(samples[i]["tokens"], samples[j]["tokens"]), i  # the next good record
    assert dataset.stats.skipped == {**dict.fromkeys(REASONS, 0), **EXPECTED_SKIPS}
    messages = [r.getMessage() for r in caplog.records]
    for shard, key, reason in [("train/a.tar", "corrupt", "undecodable image"),
                               ("train/a.tar", "truncated", "undecodable image"),
                               ("train/b.tar", "mismatch", "image count mismatch"),
                               ("train/b.tar", "../escape", "path escapes dataset"),
                               ("train/b.tar", "badjson", "malformed record"),
                               ("train/b.tar", "long", "too long")]:
        assert any(shard in m and repr(key) in m and reason in m for m in messages), (key, messages)
    # A bad record is counted once, however often the order meets it.
    dataset[1], dataset[1]
    assert dataset.stats.total_skipped == sum(EXPECTED_SKIPS.values())


def test_skip_counts_reduce_over_data_parallel_ranks(bad_shards, tok, megatron_single_rank):
    dataset = _dataset(bad_shards, tok)
    for i in range(dataset.records):
        dataset[i]
    again = _dataset(bad_shards, tok)  # meets the same bad records: counted once
    again[1]
    assert reduce_skip_counts(dataset.stats, again.stats) == {
        **dict.fromkeys(REASONS, 0), **EXPECTED_SKIPS}


def test_all_bad_records_is_one_error(tmp_path, tok):
    root = tmp_path / "ds"
    write_shards([ShardRecord({"messages": "nope"}, [])], str(root), "train", 10)
    index_energon_dataset(str(root), "chat")
    with pytest.raises(DataError, match="no usable sample: every one of its 1 records is bad"):
        _dataset(root, tok)


def test_not_an_energon_dataset_is_one_error(tmp_path, tok):
    with pytest.raises(DataError, match="not an energon dataset"):
        _dataset(tmp_path, tok)


def test_order_is_a_seeded_permutation_per_epoch(chat_dataset, tok):
    a = _dataset(chat_dataset, tok, shuffle=True, num_samples=12, seed=7)
    b = _dataset(chat_dataset, tok, shuffle=True, num_samples=12, seed=7)
    order = [a.record_index(i) for i in range(12)]
    assert order == [b.record_index(i) for i in range(12)]
    for epoch in range(3):
        assert sorted(order[epoch * 4:(epoch + 1) * 4]) == [0, 1, 2, 3]
    assert torch.equal(a[7]["tokens"], b[7]["tokens"])  # resuming at 7 reads the same sample


def _read_in_child(dataset, queue):
    # The inherited file objects are held, so that a new one cannot take a freed one's id().
    inherited = list(dataset._reader.itar_files_cache.values())
    rows = [dataset[i]["tokens"].tolist() for i in range(len(dataset))]
    own = list(dataset._reader.itar_files_cache.values())
    shared = sum(any(o is f for f in inherited) for o in own)
    queue.put((len(inherited), len(own), shared, rows))


def test_a_forked_worker_reopens_the_shards(chat_dataset, tok):
    """DataLoader workers fork after the parent has read: sharing its open tar files would share
    their offsets (interleaved reads); the child reopens them and reads the same samples."""
    import multiprocessing

    dataset = _dataset(chat_dataset, tok, shuffle=False)
    parent = [dataset[i]["tokens"].tolist() for i in range(len(dataset))]
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_read_in_child, args=(dataset, queue))
    child.start()
    inherited, own, shared, rows = queue.get(timeout=60)
    child.join(timeout=60)
    assert inherited > 0 and own > 0 and shared == 0  # the parent's open files, then its own
    assert rows == parent
    assert dataset._reader.itar_files_cache  # the parent's stay open


def test_a_truncated_shard_is_refused_naming_it(llava_folder, tmp_path, tok):
    """An incomplete copy of a shard: one DataError line when the dataset opens (the launcher's
    checks open it too), not a crash of every rank in the middle of training."""
    prepare_from_llava_json(str(tmp_path / "out"), str(llava_folder / "train.json"),
                            str(llava_folder / "img"), samples_per_shard=3)
    shard = tmp_path / "out" / "train" / "shard-000001.tar"
    shard.write_bytes(shard.read_bytes()[:700])
    with pytest.raises(DataError, match="shard train/shard-000001.tar is truncated: its index "
                                        "reaches byte") as err:
        _dataset(tmp_path / "out", tok)
    assert "\n" not in str(err.value)


def test_a_dataset_without_a_usable_sample_is_refused(llava_folder, tmp_path, tok):
    """Every image undecodable: no sample to train on is bad input (one line), where half-bad
    data is trained on with the bad records skipped."""
    root = tmp_path / "bad"
    (root / "img").mkdir(parents=True)
    (root / "img" / "broken.png").write_bytes(_png((1, 2, 3))[:40])
    broken = (root / "img" / "broken.png").read_bytes()
    records = [ShardRecord({"messages": [{"role": "user", "content": "<image>\nQ?"},
                                         {"role": "assistant", "content": "A"}]},
                           [("png", broken)]) for _ in range(4)]
    out = tmp_path / "all-bad"
    write_shards(records, str(out), "train", 2)
    index_energon_dataset(str(out), "chat")
    with pytest.raises(DataError, match=r"\[train\]: no usable sample: every one of its 4 "
                                        r"records is bad \(.*undecodable image.*\)"):
        _dataset(out, tok)


@pytest.mark.parametrize("shown", [0, 2])
def test_the_more_skipped_line_comes_only_after_skips_were_shown(bad_shards, tok, caplog, shown):
    """'more bad records skipped (not shown ...)' follows the ``max_warnings`` lines shown; with
    none shown it is not printed (it came first, with nothing shown before it)."""
    caplog.set_level(logging.WARNING)
    dataset = _dataset(bad_shards, tok, max_warnings=shown)
    for i in range(dataset.records):
        dataset[i]
    messages = [r.getMessage() for r in caplog.records]
    more = [i for i, m in enumerate(messages) if "more bad records skipped" in m]
    assert more == ([shown] if shown else []) and len(messages) == shown + bool(shown)
