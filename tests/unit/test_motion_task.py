"""The synthetic video task (``data.motion``): the answer is the motion the decoded clip shows
(the shape's centre, found in the decoded frames, moves STEP pixels a frame that way on the
wrapping canvas); no single frame answers it (at every frame index the frames of all starts are
the same for every direction); the
same seed writes the same questions and clips; the prepared datasets hold every question (the
clips as the video dataset's, the middle frames as the baseline's)."""

import json
import random

import numpy as np
import pytest

from megatron_slmoe.data import motion


def _centre(frame) -> np.ndarray:
    """(y, x) of the shape on the wrapping canvas: the circular mean of its pixels."""
    mask = np.abs(frame.astype(int) - np.array(motion.BACKGROUND)).sum(-1) > 120
    angles = [2 * np.pi * np.nonzero(mask)[axis] / motion.CANVAS for axis in (0, 1)]
    return np.array([np.angle(np.exp(1j * a).mean()) * motion.CANVAS / (2 * np.pi)
                     for a in angles])


def test_the_answer_is_the_motion_the_decoded_clip_shows():
    from megatron_slmoe.data.video import decode_clip

    for index in range(8):
        task = motion.make_motion(random.Random(index))
        clip = decode_clip(motion.encode_mp4(motion.draw_frames(task)))
        assert (len(clip.frames), clip.fps) == (motion.FRAMES, motion.FPS)
        frames = clip.pixels(range(motion.FRAMES)).permute(0, 2, 3, 1).numpy()
        moves = [(_centre(b) - _centre(a) + motion.CANVAS / 2) % motion.CANVAS - motion.CANVAS / 2
                 for a, b in zip(frames, frames[1:])]
        step = np.mean(moves, axis=0) / motion.STEP
        assert np.allclose(step, motion.DIRECTIONS[task.direction], atol=0.15), (task, step)


def test_no_single_frame_answers():
    # For every frame index, the frames of all starts are the same set whichever the direction:
    # any one frame (the baseline's middle one included) fits all four answers equally.
    cells = range(0, motion.CANVAS, motion.STEP)
    for shape in motion.SHAPES:
        clips = {d: [motion.draw_frames(motion.Motion(shape, "red", (y, x), d))
                     for y in cells for x in cells] for d in motion.DIRECTIONS}
        seen = {d: [sorted(f.tobytes() for f in frames) for frames in zip(*c)]
                for d, c in clips.items()}
        assert all(v == seen["right"] for v in seen.values()), shape
        first = [motion.draw_frames(motion.Motion(shape, "red", (16, 32), d))[0]
                 for d in motion.DIRECTIONS]
        assert all(np.array_equal(f, first[0]) for f in first)  # four answers, one frame
    # Starts are drawn uniformly over the patch grid: every cell, about equally often.
    starts = [motion.make_motion(random.Random(i)).start for i in range(1600)]
    counts = [starts.count((y, x)) for y in cells for x in cells]
    assert len(counts) == 16 and sum(counts) == 1600 and min(counts) > 60, counts


def test_generated_task_is_reproducible_and_prepared(tmp_path):
    first = motion.generate(str(tmp_path / "a"), train=6, held_out=3)
    motion.generate(str(tmp_path / "b"), train=6, held_out=3)
    for name in ("motion_train.jsonl", "motion_eval.jsonl", "single_frame_eval.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    records = [json.loads(line) for line in (tmp_path / "a" / "motion_eval.jsonl").open()]
    assert [r["messages"][1]["content"] in motion.DIRECTIONS for r in records] == [True] * 3
    assert records[0]["messages"][0]["content"].startswith("<video>\nWhich way does the ")
    for folder in first.values():
        infos = json.loads((tmp_path / "a" / folder / ".nv-meta" / ".info.json").read_text())
        counts = {split.split("/")[0]: n for split, n in infos["shard_counts"].items()}
        assert counts == {"train": 6, "val": 3}


def test_the_command_refuses_an_existing_folder(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert motion.main(["--out", str(tmp_path / "x")]) == 2
    assert "already exists" in capsys.readouterr().err
