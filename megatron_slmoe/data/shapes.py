"""The synthetic image-text task of the multimodal demo: coloured shapes on a small canvas.

Each scene is a 32 x 32 image with one to three shapes (circle, square, triangle), each in its own
quadrant, all of different kinds and different colours (red, green, blue, yellow), drawn with a
pixel of jitter on a light background. From scenes come

* captions (the base model's pretraining) list every shape of a scene in one of three orders,
  drawn per scene: by position, ``red circle top left, blue triangle bottom right`` (reading order
  of the quadrants); by shape, ``circle: red top left, triangle: blue bottom right``; by colour,
  ``blue: triangle bottom right, red: circle top left``. With the position order alone a colour
  word only ever names "the next shape in reading order", which the tiny base never learns to
  find: its colour words stayed at chance while it read shapes from the image; keyed by shape
  and colour, it learns to look a shape up by an attribute, as the questions ask;
* questions (the LoRA task), one per image, of four kinds with their answers:
  ``What colour is the circle?`` -> ``red``; ``Which shape is blue?`` -> ``triangle``;
  ``Where is the square?`` -> ``top left``; ``How many shapes are there?`` -> ``2``.

Chance accuracy (a uniform guess of the right kind of answer) is 1/4, 1/3, 1/4 and 1/3: about
0.29 over the mix. The held-out questions are about scenes that occur nowhere in the training
data (neither in the captions nor in the training questions): a quarter of the distinct scenes of
each shape count is set aside for them (:func:`held_out_scenes`), so both sides keep the same mix
of counts. (Holding out the first distinct scenes drawn instead took 40 of the 48 one-shape scenes:
training then had almost no one-shape scene, and the held-out "1" answers failed.)

Everything is drawn from ``random.Random`` seeded by ``(seed, split, index)`` (string seeds hash
with SHA-512: the same on every machine), images are PNG and shards carry fixed tar metadata, so
the same seed gives byte-identical datasets. ``python -m megatron_slmoe.data.shapes --out DIR``
writes them; :func:`ensure_shapes_task` makes them once in a run directory.

Layout of ``DIR``: ``images/*.png``, the LLaVA-style ``captions.json``, ``vqa_train.json``,
``vqa_eval.json``, and the energon datasets ``captions/`` (captioning samples, splits train/val)
and ``vqa/`` (VQA samples, train = training questions, val = held-out questions).
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import math
import os
import random
import sys
from typing import Dict, FrozenSet, List, Optional, Tuple

from megatron_slmoe.data.scoring import exact_match
from megatron_slmoe.utils.atomic import atomic_directory
from megatron_slmoe.utils.jsonl import numbered_records

SEED = 20250301
CANVAS = 32
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (50, 80, 220),
           "yellow": (225, 200, 30)}
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
COUNT_WORDS = {1: "1", 2: "2", 3: "3"}
BACKGROUND = (240, 240, 236)
QUESTION_KINDS = ("colour", "shape", "position", "count")

Scene = Tuple[Tuple[int, str, str], ...]  # ((quadrant, colour, shape), ...) sorted by quadrant


HELD_OUT_SHARE = 0.25  # of the distinct scenes of each count
# Written into every generated folder; raised whenever the same seed would give other data, so
# the demo refuses a folder made by an earlier version (``--check``). A run's own copy
# (``ensure_shapes_task``) is kept as made: a resumed run reads the data it started on.
TASK_VERSION = 2  # 2: the held-out scenes are a share of each count


def make_scene(rng: random.Random) -> Scene:
    count = rng.randint(1, 3)
    quadrants = sorted(rng.sample(range(4), count))
    colours = rng.sample(sorted(COLOURS), count)
    shapes = rng.sample(SHAPES, count)
    return tuple(zip(quadrants, colours, shapes))


def all_scenes(count: int) -> List[Scene]:
    """Every distinct scene of ``count`` shapes, in a fixed order."""
    return [tuple(zip(quadrants, colours, kinds))
            for quadrants in itertools.combinations(range(4), count)
            for colours in itertools.permutations(sorted(COLOURS), count)
            for kinds in itertools.permutations(SHAPES, count)]


def held_out_scenes(seed: int = SEED) -> FrozenSet[Scene]:
    """The scenes only held-out questions show: ``HELD_OUT_SHARE`` of each count's scenes, drawn
    by ``seed``."""
    held_out: List[Scene] = []
    for count in (1, 2, 3):
        scenes = all_scenes(count)
        _rng(seed, "held-out", count).shuffle(scenes)
        held_out += scenes[:math.ceil(len(scenes) * HELD_OUT_SHARE)]
    return frozenset(held_out)


def draw_scene(scene: Scene, rng: random.Random) -> bytes:
    """PNG bytes of a scene."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (CANVAS, CANVAS), BACKGROUND)
    draw = ImageDraw.Draw(image)
    half = CANVAS // 2
    for quadrant, colour, shape in scene:
        x0 = (quadrant % 2) * half + 2 + rng.randint(-1, 1)
        y0 = (quadrant // 2) * half + 2 + rng.randint(-1, 1)
        x1, y1 = x0 + half - 5, y0 + half - 5
        fill = COLOURS[colour]
        if shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif shape == "square":
            draw.rectangle((x0 + 1, y0 + 1, x1 - 1, y1 - 1), fill=fill)
        else:
            draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=fill)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=False)
    return out.getvalue()


CAPTION_ORDERS = ("position", "shape", "colour")


def caption(scene: Scene, order: str = "position") -> str:
    """Every shape of the scene, in ``order`` (see the module doc)."""
    if order == "position":
        return ", ".join(f"{colour} {shape} {POSITIONS[quadrant]}"
                         for quadrant, colour, shape in scene)
    if order == "shape":
        return ", ".join(f"{shape}: {colour} {POSITIONS[quadrant]}"
                         for quadrant, colour, shape in sorted(scene, key=lambda s: s[2]))
    if order == "colour":
        return ", ".join(f"{colour}: {shape} {POSITIONS[quadrant]}"
                         for quadrant, colour, shape in sorted(scene, key=lambda s: s[1]))
    raise ValueError(f"caption order {order!r} is not one of {', '.join(CAPTION_ORDERS)}")


def question(scene: Scene, rng: random.Random) -> Tuple[str, str]:
    """(question, answer) of one of the four kinds about a scene."""
    kind = rng.choice(QUESTION_KINDS)
    quadrant, colour, shape = rng.choice(scene)
    if kind == "colour":
        return f"What colour is the {shape}?", colour
    if kind == "shape":
        return f"Which shape is {colour}?", shape
    if kind == "position":
        return f"Where is the {shape}?", POSITIONS[quadrant]
    return "How many shapes are there?", COUNT_WORDS[len(scene)]


_KIND_OPENINGS = {"What colour": "colour", "Which shape": "shape", "Where is": "position",
                  "How many": "count"}


def question_kind(prompt: str) -> str:
    """The kind of a question of this task (in a prompt as the run's answers file shows it)."""
    user = prompt.rsplit("\n", 1)[-1] if "\n" in prompt else prompt
    for opening, kind in _KIND_OPENINGS.items():
        if opening in user:
            return kind
    raise ValueError(f"not a question of the shapes task: {prompt!r}")


def score_answers(path: str) -> Dict[str, Tuple[int, int]]:
    """(correct, total) exact-match answers by question kind, and ``all``, of a run's answers
    file (``answers_after_training.jsonl``: prompt, answer, reference per line)."""
    scores = {kind: [0, 0] for kind in (*QUESTION_KINDS, "all")}
    for number, row in numbered_records(path):
        if isinstance(row, ValueError) or not isinstance(row, dict):
            raise ValueError(f"line {number}: not a JSON object")
        hit = int(exact_match(row["answer"], row["reference"]))
        for kind in (question_kind(row["prompt"]), "all"):
            scores[kind][0] += hit
            scores[kind][1] += 1
    return {kind: (c, t) for kind, (c, t) in scores.items() if t}


def _rng(seed: int, split: str, index: int) -> random.Random:
    return random.Random(f"{seed}:{split}:{index}")


def _record(ident: str, image: str, user: str, answer: str) -> dict:
    return {"id": ident, "image": image,
            "conversations": [{"from": "human", "value": f"<image>\n{user}"},
                              {"from": "gpt", "value": answer}]}


def generate(out_dir: str, seed: int = SEED, captions: int = 3000, vqa_train: int = 3000,
             vqa_eval: int = 256) -> Dict[str, str]:
    """Write the images, the LLaVA-style JSON files and the two energon datasets into
    ``out_dir`` (see the module doc); returns the dataset paths."""
    from megatron_slmoe.data.image_text_prepare import prepare_from_llava_json

    images = os.path.join(out_dir, "images")
    os.makedirs(images, exist_ok=True)
    held_out = held_out_scenes(seed)
    records: Dict[str, List[dict]] = {"vqa_eval": [], "vqa_train": [], "captions": []}
    for split, count in (("vqa_eval", vqa_eval), ("vqa_train", vqa_train),
                         ("captions", captions)):
        index = 0
        while len(records[split]) < count:
            rng = _rng(seed, split, index)
            index += 1
            scene = make_scene(rng)
            # Every count has the same share held out, so rejecting keeps the counts' mix.
            if (scene in held_out) != (split == "vqa_eval"):
                continue
            name = f"{split}_{len(records[split]):06d}.png"
            with open(os.path.join(images, name), "wb") as f:
                f.write(draw_scene(scene, rng))
            if split == "captions":
                user, answer = "Describe the image.", caption(scene, rng.choice(CAPTION_ORDERS))
            else:
                user, answer = question(scene, rng)
            records[split].append(_record(name[:-4], name, user, answer))
    for split, items in records.items():
        with open(os.path.join(out_dir, f"{split}.json"), "w", encoding="utf-8") as f:
            json.dump(items, f, indent=0)
    n_val = max(1, captions // 20)
    with open(os.path.join(out_dir, "captions_val.json"), "w", encoding="utf-8") as f:
        json.dump(records["captions"][-n_val:], f, indent=0)
    with open(os.path.join(out_dir, "captions_train.json"), "w", encoding="utf-8") as f:
        json.dump(records["captions"][:-n_val], f, indent=0)
    paths = {"captions": os.path.join(out_dir, "captions"), "vqa": os.path.join(out_dir, "vqa")}
    prepare_from_llava_json(paths["captions"], os.path.join(out_dir, "captions_train.json"),
                            images, kind="caption",
                            val_json=os.path.join(out_dir, "captions_val.json"))
    prepare_from_llava_json(paths["vqa"], os.path.join(out_dir, "vqa_train.json"), images,
                            kind="vqa", val_json=os.path.join(out_dir, "vqa_eval.json"))
    with open(os.path.join(out_dir, "task_version"), "w", encoding="utf-8") as f:
        f.write(f"{TASK_VERSION}\n")
    return paths


def stale_reason(out_dir: str) -> Optional[str]:
    """Why the task folder ``out_dir`` cannot be reused, or None when it is this version's."""
    try:
        with open(os.path.join(out_dir, "task_version"), encoding="utf-8") as f:
            found = f.read().strip()
    except FileNotFoundError:
        found = "1"  # made before the version was written
    if found != str(TASK_VERSION):
        return (f"{out_dir} was made by version {found} of the shapes task, this is version "
                f"{TASK_VERSION}: remove it to make it again")
    return None


def ensure_shapes_task(out_dir: str, seed: int = SEED) -> Dict[str, str]:
    """The task's dataset paths under ``out_dir``, generated on first use under a temporary name
    and renamed into place when complete. Call it on one rank (then barrier)."""
    paths = {"captions": os.path.join(out_dir, "captions"), "vqa": os.path.join(out_dir, "vqa")}
    if os.path.isdir(out_dir):
        return paths
    with atomic_directory(out_dir) as staging:
        generate(staging, seed)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="output folder (must not exist)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--score", nargs="+", metavar="ANSWERS",
                        help="instead: print the accuracy by question kind of runs' answers files")
    parser.add_argument("--check", metavar="DIR",
                        help="instead: exit 2 with the reason when DIR was made by another "
                             "version of this task")
    args = parser.parse_args(argv)
    if args.check:
        reason = stale_reason(args.check)
        if reason:
            print(f"error: {reason}", file=sys.stderr)
            return 2
        return 0
    if args.score:
        for path in args.score:
            try:
                scores = score_answers(path)
            except (OSError, ValueError, KeyError) as err:
                parser.error(f"--score {path}: {err}")
            print(f"{path}: " + ", ".join(f"{kind} {c / t:.3f} ({c}/{t})"
                                          for kind, (c, t) in scores.items()))
        return 0
    if not args.out:
        parser.error("--out is required (or --score)")
    if os.path.exists(args.out):
        parser.error(f"--out {args.out} already exists")
    paths = generate(args.out, args.seed)
    print(json.dumps(paths, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
