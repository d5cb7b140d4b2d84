"""The synthetic shapes task of the multimodal demo: captions describe every shape of their scene
in each order, questions have one right answer that the scene determines, and a run's answers
files are scored by question kind."""

import collections
import json
import random

import pytest

from megatron_slmoe.data import shapes


def _scenes(count: int):
    return [shapes.make_scene(random.Random(f"test:{i}")) for i in range(count)]


@pytest.mark.parametrize("order", shapes.CAPTION_ORDERS)
def test_captions_name_every_shape_with_its_colour_and_position(order):
    keyed = {"position": "{c} {s} {p}", "shape": "{s}: {c} {p}", "colour": "{c}: {s} {p}"}[order]
    sort = {"position": 0, "shape": 2, "colour": 1}[order]
    for scene in _scenes(50):
        parts = shapes.caption(scene, order).split(", ")
        assert parts == [keyed.format(c=c, s=s, p=shapes.POSITIONS[q])
                         for q, c, s in sorted(scene, key=lambda t: t[sort])]


def test_questions_are_answered_by_their_scene():
    for i, scene in enumerate(_scenes(200)):
        user, answer = shapes.question(scene, random.Random(i))
        kind = shapes.question_kind(user)
        by_position = {shapes.POSITIONS[q]: (c, s) for q, c, s in scene}
        if kind == "count":
            assert answer == str(len(scene))
        elif kind == "position":
            assert answer in by_position and by_position[answer][1] in user
        elif kind == "colour":
            (shape,) = [s for _, s in by_position.values() if user.endswith(f" {s}?")]
            assert (answer, shape) in by_position.values()
        else:
            (colour,) = [c for c, _ in by_position.values() if user.endswith(f" {c}?")]
            assert (colour, answer) in by_position.values()


def test_answers_files_are_scored_by_question_kind(tmp_path):
    shapes.generate(str(tmp_path / "task"), captions=40, vqa_train=40, vqa_eval=12)
    held_out = json.loads((tmp_path / "task" / "vqa_eval.json").read_text())
    rows = [{"prompt": r["conversations"][0]["value"], "reference": r["conversations"][1]["value"],
             "answer": r["conversations"][1]["value"] if i % 2 else "wrong"}
            for i, r in enumerate(held_out)]
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps(r) + "\n" for r in rows))
    scores = shapes.score_answers(str(answers))
    assert scores["all"] == (6, 12)
    assert sum(t for kind, (_, t) in scores.items() if kind != "all") == 12


def _scene_of_caption(text: str):
    """The scene a caption describes, in any order (parsed back by its words)."""
    parts = []
    for part in text.split(", "):
        (colour,) = [c for c in shapes.COLOURS if c in part]
        (shape,) = [s for s in shapes.SHAPES if s in part]
        (quadrant,) = [q for q, p in enumerate(shapes.POSITIONS) if part.endswith(p)]
        parts.append((quadrant, colour, shape))
    return tuple(sorted(parts))


def test_held_out_scenes_are_a_quarter_of_every_count_and_never_trained_on(tmp_path):
    held_out = shapes.held_out_scenes()
    for count in (1, 2, 3):
        every = shapes.all_scenes(count)
        assert len(set(every)) == len(every)
        mine = [s for s in held_out if len(s) == count]
        assert len(mine) == -(-len(every) // 4) and set(mine) <= set(every)
    assert held_out == shapes.held_out_scenes() != shapes.held_out_scenes(seed=1)

    shapes.generate(str(tmp_path / "task"), captions=300, vqa_train=12, vqa_eval=60)
    captions = json.loads((tmp_path / "task" / "captions.json").read_text())
    scenes = [_scene_of_caption(r["conversations"][1]["value"]) for r in captions]
    assert not set(scenes) & held_out
    # Training sees every count about as often (it once saw almost no one-shape scene).
    by_count = collections.Counter(len(s) for s in scenes)
    assert all(70 <= by_count[count] <= 130 for count in (1, 2, 3)), by_count
    questions = json.loads((tmp_path / "task" / "vqa_eval.json").read_text())
    counts = {r["conversations"][1]["value"] for r in questions
              if shapes.question_kind(r["conversations"][0]["value"]) == "count"}
    assert counts == {"1", "2", "3"}


def test_a_folder_of_an_earlier_task_version_is_refused_in_one_line(tmp_path, capsys):
    shapes.generate(str(tmp_path / "task"), captions=4, vqa_train=4, vqa_eval=4)
    assert shapes.main(["--check", str(tmp_path / "task")]) == 0
    (tmp_path / "task" / "task_version").unlink()  # as folders made before versions were
    assert shapes.main(["--check", str(tmp_path / "task")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "version 1 of the shapes task" in line and "remove it" in line
