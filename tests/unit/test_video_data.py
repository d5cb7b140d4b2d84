"""Video data for Qwen3-VL-MoE: a JSONL of conversations with ``videos`` (LLaMA-Factory's and
ms-swift's field, ``<video>`` marks) becomes energon shards holding the clips as they were
(``tools/prepare_image_text.py``); the dataset reads them through the checkpoint's video
processor: the token ids are transformers' (its chat template, each clip written as
Qwen3VLProcessor writes it, timestamps included) and ``pixel_values_videos`` / ``video_grid_thw``
are transformers' video processor's. Bad clips and marks are counted skips, in the preparation
and in the reader; over ``--max-bad-fraction`` the preparation is refused in one line."""

import json

import pytest
import torch

from tests.helpers import hf_models, video_clips

SEQ = 160


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf_dir = tmp_path_factory.mktemp("video-data") / "qwen3-vl-moe"
    return hf_dir, video_clips.save_qwen3_vl_video_checkpoint(hf_dir, SEQ)


def _no_frames_clip() -> bytes:
    """An MP4 with a video stream and no frame."""
    import io

    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=4)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
    return buffer.getvalue()


def _write_clips(folder):
    folder.mkdir()
    clips = {"a.mp4": video_clips.encode_clip(video_clips.random_frames(8, 64, 64, seed=1)),
             "b.mp4": video_clips.encode_clip(video_clips.random_frames(6, 72, 100, seed=2)),
             "long.mp4": video_clips.encode_clip(video_clips.random_frames(40, 32, 32), fps=4),
             "empty.mp4": b"", "corrupt.mp4": b"\x00garbage" * 50,
             "noframes.mp4": _no_frames_clip()}
    for name, data in clips.items():
        (folder / name).write_bytes(data)


GOOD = [
    {"messages": [{"role": "user", "content": "<video>Which way does it move?"},
                  {"role": "assistant", "content": "right"}], "videos": ["a.mp4"]},
    {"messages": [{"role": "user", "content": "<video>\nAnd here?"},
                  {"role": "assistant", "content": "down"}], "videos": ["b.mp4"]},
]
BAD = {  # record -> the reason the preparation skips it
    "missing video": {"messages": [{"role": "user", "content": "<video>?"},
                                   {"role": "assistant", "content": "x"}],
                      "videos": ["nowhere.mp4"]},
    "zero-length": {"messages": [{"role": "user", "content": "<video>?"},
                                 {"role": "assistant", "content": "x"}], "videos": ["empty.mp4"]},
    "corrupt": {"messages": [{"role": "user", "content": "<video>?"},
                             {"role": "assistant", "content": "x"}], "videos": ["corrupt.mp4"]},
    "no frames": {"messages": [{"role": "user", "content": "<video>?"},
                               {"role": "assistant", "content": "x"}],
                  "videos": ["noframes.mp4"]},
    "too long": {"messages": [{"role": "user", "content": "<video>?"},
                              {"role": "assistant", "content": "x"}], "videos": ["long.mp4"]},
    "mark without clip": {"messages": [{"role": "user", "content": "<video>?"},
                                       {"role": "assistant", "content": "x"}]},
    "clip without mark": {"messages": [{"role": "user", "content": "what?"},
                                       {"role": "assistant", "content": "x"}],
                          "videos": ["a.mp4"]},
}


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_prepared_clips_read_as_transformers_makes_them(checkpoint, tmp_path, monkeypatch):
    from transformers import AutoTokenizer
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    from megatron_slmoe.data.image_text import ImageTextDataset, collate_image_text
    from megatron_slmoe.data.image_text_prepare import prepare_from_llava_json
    from megatron_slmoe.data.tokenizer import load_tokenizer
    from megatron_slmoe.data.video import decode_clip

    hf_dir, model = checkpoint
    _write_clips(tmp_path / "clips")
    train = _jsonl(tmp_path / "train.jsonl", GOOD + list(BAD.values()))
    written, stats = prepare_from_llava_json(str(tmp_path / "ds"), train, str(tmp_path / "clips"),
                                             max_video_seconds=5.0)
    assert written == {"train": 2}
    assert {k: v for k, v in stats["train"].skipped.items() if v} == {
        "missing video": 1, "undecodable video": 4, "video count mismatch": 2}

    tokenizer = load_tokenizer(str(hf_dir))
    images = hf_models.kimi_image_input(str(hf_dir), tokenizer)
    dataset = ImageTextDataset(str(tmp_path / "ds"), tokenizer, SEQ, images=images,
                               split="train", shuffle=False)
    batch = collate_image_text([dataset[0], dataset[1]])
    # transformers: its video processor on each decoded clip, its processor's text.
    video_clips.without_torchvision(monkeypatch)
    settings = {k: v for k, v in video_clips.QWEN3_VL_VIDEO_SETTINGS.items()
                if k != "video_processor_type"}
    processor = Qwen3VLVideoProcessor(**settings)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    from tests.unit.test_video_qwen3_vl import _processor_text

    pixels, grids = [], []
    for row, (record, name) in enumerate(zip(GOOD, ("a.mp4", "b.mp4"))):
        clip = decode_clip((tmp_path / "clips" / name).read_bytes())
        out = processor(videos=[clip.pixels(range(len(clip.frames)))],
                        video_metadata=[VideoMetadata(total_num_frames=len(clip.frames),
                                                      fps=clip.fps)],
                        return_metadata=True, return_tensors="pt")
        pixels.append(out["pixel_values_videos"])
        grids.append(out["video_grid_thw"])
        wrapper = "<|vision_start|><|video_pad|><|vision_end|>"
        text = hf_tokenizer.apply_chat_template(
            [{**m, "content": m["content"].replace("<video>", wrapper)}
             for m in record["messages"]], tokenize=False)
        text = text.replace(wrapper, _processor_text(processor, out))
        ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert batch["tokens"][row, :len(ids) - 1].tolist() == ids[:-1]
        assert "seconds>" in text and text.count("<|vision_start|>") == int(grids[-1][0, 0])
    torch.testing.assert_close(batch["pixel_values_videos"], torch.cat(pixels), rtol=0, atol=0)
    assert batch["video_grid_thw"].tolist() == torch.cat(grids).tolist()
    assert batch["pixel_values"].shape[0] == 0 and batch["image_grid_thw"].shape == (0, 3)


def test_bad_clips_in_shards_are_counted_skips(checkpoint, tmp_path):
    """Shards written by other tools: a clip that does not decode and a mark without its clip
    are skipped and counted by reason, never an exception."""
    from megatron_slmoe.data.image_text import ImageTextDataset
    from megatron_slmoe.data.image_text_prepare import (
        ShardRecord,
        index_energon_dataset,
        write_shards,
    )
    from megatron_slmoe.data.tokenizer import load_tokenizer

    hf_dir, _ = checkpoint
    good = video_clips.encode_clip(video_clips.random_frames(8, 64, 64))
    ask = [{"role": "user", "content": "<video>?"}, {"role": "assistant", "content": "x"}]
    records = [ShardRecord({"messages": ask}, [], [("mp4", good)]),
               ShardRecord({"messages": ask}, [], [("mp4", b"\x00garbage" * 40)]),
               ShardRecord({"messages": ask}, [], []),
               ShardRecord({"messages": ask}, [], [("mp4", good), ("mp4", good)])]
    write_shards(records, str(tmp_path / "ds"), "train", 10)
    index_energon_dataset(str(tmp_path / "ds"), "chat")
    tokenizer = load_tokenizer(str(hf_dir))
    dataset = ImageTextDataset(str(tmp_path / "ds"), tokenizer, SEQ,
                               images=hf_models.kimi_image_input(str(hf_dir), tokenizer),
                               split="train", shuffle=False)
    first = dataset[0]
    for i in range(1, 4):
        assert torch.equal(dataset[i]["tokens"], first["tokens"])  # the next good record
    assert {k: v for k, v in dataset.stats.skipped.items() if v} == {
        "undecodable video": 1, "video count mismatch": 2}


def test_over_max_bad_fraction_is_one_line_and_nothing_written(checkpoint, tmp_path, capsys):
    import importlib.util

    from tests.helpers.entry_point import REPO

    spec = importlib.util.spec_from_file_location("prepare", f"{REPO}/tools/prepare_image_text.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    _write_clips(tmp_path / "clips")
    train = _jsonl(tmp_path / "train.jsonl", GOOD + [BAD["corrupt"]])
    assert tool.main(["--json", train, "--image-dir", str(tmp_path / "clips"), "--output",
                      str(tmp_path / "ds"), "--max-bad-fraction", "0.25"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "more bad records than --max-bad-fraction 0.25" in err[0], err
    assert not (tmp_path / "ds").exists()
    assert tool.main(["--json", train, "--image-dir", str(tmp_path / "clips"), "--output",
                      str(tmp_path / "ds"), "--max-bad-fraction", "0.5"]) == 0
    assert "1 skipped (undecodable video: 1)" in capsys.readouterr().out


def test_clip_shards_stream_from_object_storage_through_the_node_cache(checkpoint, tmp_path,
                                                                      monkeypatch):
    """The prepared clips on an S3 prefix (moto's server): opening fetches no shard, the
    samples read through the node cache equal the local folder's, each shard fetched once."""
    from megatron_slmoe.data.image_text import ImageTextDataset
    from megatron_slmoe.data.image_text_prepare import prepare_from_llava_json
    from megatron_slmoe.data.tokenizer import load_tokenizer
    from megatron_slmoe.storage import Storage
    from megatron_slmoe.storage.config import StorageConfig
    from megatron_slmoe.data.image_text import node_view
    from tests.helpers.s3_server import S3TestServer

    hf_dir, _ = checkpoint
    _write_clips(tmp_path / "clips")
    prepare_from_llava_json(str(tmp_path / "ds"), _jsonl(tmp_path / "t.jsonl", GOOD * 3),
                            str(tmp_path / "clips"), samples_per_shard=2)
    tokenizer = load_tokenizer(str(hf_dir))
    images = hf_models.kimi_image_input(str(hf_dir), tokenizer)
    with S3TestServer() as server:
        server.client().create_bucket(Bucket="clips")
        server.upload_folder("clips", "ds/", tmp_path / "ds")
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        server.reset_counts()
        storage = Storage(StorageConfig(cache_dir=str(tmp_path / "nvme"),
                                        retry_timeout_seconds=30.0))
        local, stored = node_view(storage, "s3://clips/ds/")
        shards = sorted(p.relative_to(tmp_path / "ds").as_posix()
                        for p in (tmp_path / "ds").rglob("*.tar"))
        assert len(shards) == 3 and not any(server.requests("GET", f"/clips/ds/{s}")
                                            for s in shards)
        ours = ImageTextDataset(local, tokenizer, SEQ, images=images, split="train",
                                shuffle=False, stored=stored)
        theirs = ImageTextDataset(str(tmp_path / "ds"), tokenizer, SEQ, images=images,
                                  split="train", shuffle=False)
        for i in range(6):
            a, b = ours[i], theirs[i]
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), i
            assert a["video_grid_thw"].shape == (1, 3)
        stored.close()
        assert [server.requests("GET", f"/clips/ds/{s}") for s in shards] == [1, 1, 1]
