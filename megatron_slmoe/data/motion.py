"""The synthetic video task of the video demo: which way does a shape move?

Each clip is ``FRAMES`` frames of a ``CANVAS`` x ``CANVAS`` canvas at ``FPS`` frames a second,
one ``SIZE`` x ``SIZE`` shape (circle, square or triangle, in red, green, blue or yellow) moving
``STEP`` pixels a frame to the right, left, up or down. The canvas wraps around (a torus: what
leaves on one side comes back on the other) and the start is uniform over the ``STEP`` grid, so
the shape's place in any one frame is uniform whatever the direction: a single frame cannot
answer the question, only the change between frames can (the single-frame baseline's chance is
1/4).

The geometry is Qwen3-VL's (patch 16, two frames per temporal patch, 2x2 merge, sampling at
2 fps): the shape is one patch, starts on the patch grid and moves one patch a frame, and every
frame is sampled, so each temporal patch holds one move, from one patch (the shape in its first
frame) to the next (in its second), and the merged token (or the two) holding that move tells
which way it went. A shape moving a few pixels off the grid mostly stays inside the patches it
covers; the demo's small random tower then keeps too little of the move: a small classifier on
its frozen outputs read the direction of 58% of held-out clips that way, 91% with this
geometry (320 clips to learn from, 80 held out).

The question names the shape (``Which way does the red circle move?``) and the answer is one of
``right``, ``left``, ``up``, ``down``.

``generate(out_dir)`` writes, from ``random.Random`` seeded by ``(seed, split, index)``:

* ``clips/*.mp4`` (PyAV, MPEG-4 part 2) and ``frames/*.png`` (each clip's middle frame);
* ``motion_train.jsonl`` / ``motion_eval.jsonl``: the questions in LLaMA-Factory's and ms-swift's
  layout (``messages`` with a ``<video>`` mark, ``videos``), and ``single_frame_*.jsonl`` (the
  same questions on the middle frame, ``images``) for the single-frame baseline;
* the energon datasets ``video/`` and ``single_frame/`` (train = training questions, val = the
  held-out ones), made by ``data/image_text_prepare.py``.

``python -m megatron_slmoe.data.motion --out DIR`` writes them.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import sys
from dataclasses import dataclass
from typing import Dict, List, Tuple

SEED = 20261206
CANVAS, FRAMES, FPS, STEP, SIZE = 64, 4, 2, 16, 16
DIRECTIONS = {"right": (0, 1), "left": (0, -1), "down": (1, 0), "up": (-1, 0)}
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (50, 80, 220),
           "yellow": (225, 200, 30)}
SHAPES = ("circle", "square", "triangle")
BACKGROUND = (240, 240, 236)


@dataclass(frozen=True)
class Motion:
    """One clip: its shape and colour, where the shape starts (top-left corner, y, x) and which
    way it moves."""

    shape: str
    colour: str
    start: Tuple[int, int]
    direction: str

    @property
    def question(self) -> str:
        return f"Which way does the {self.colour} {self.shape} move?"


def make_motion(rng: random.Random) -> Motion:
    cells = CANVAS // STEP
    return Motion(rng.choice(SHAPES), rng.choice(sorted(COLOURS)),
                  (STEP * rng.randrange(cells), STEP * rng.randrange(cells)),
                  rng.choice(sorted(DIRECTIONS)))


def draw_frames(motion: Motion) -> List:
    """The clip's RGB frames (uint8 numpy arrays [CANVAS, CANVAS, 3])."""
    import numpy as np
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (CANVAS, CANVAS), BACKGROUND)
    draw = ImageDraw.Draw(image)
    box, fill = (0, 0, SIZE - 1, SIZE - 1), COLOURS[motion.colour]
    if motion.shape == "circle":
        draw.ellipse(box, fill=fill)
    elif motion.shape == "square":
        draw.rectangle((1, 1, SIZE - 2, SIZE - 2), fill=fill)
    else:
        draw.polygon([((SIZE - 1) / 2, 0), (0, SIZE - 1), (SIZE - 1, SIZE - 1)], fill=fill)
    base = np.asarray(image)
    dy, dx = DIRECTIONS[motion.direction]
    y, x = motion.start
    return [np.roll(base, (y + dy * STEP * t, x + dx * STEP * t), axis=(0, 1))
            for t in range(FRAMES)]


def encode_mp4(frames: List) -> bytes:
    """The frames as an MP4 clip at ``FPS`` (MPEG-4 part 2, near lossless)."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=FPS, options={"qscale": "2"})
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buffer.getvalue()


def _rng(seed: int, split: str, index: int) -> random.Random:
    return random.Random(f"{seed}:{split}:{index}")


def generate(out_dir: str, seed: int = SEED, train: int = 2000, held_out: int = 256
             ) -> Dict[str, str]:
    """Write the clips, frames, JSONL files and the two energon datasets into ``out_dir`` (see
    the module doc); returns the dataset paths."""
    from PIL import Image

    from megatron_slmoe.data.image_text_prepare import prepare_from_llava_json

    for folder in ("clips", "frames"):
        os.makedirs(os.path.join(out_dir, folder), exist_ok=True)
    files = {}
    for split, count in (("train", train), ("eval", held_out)):
        video, single = [], []
        for index in range(count):
            motion = make_motion(_rng(seed, split, index))
            name = f"{split}_{index:06d}"
            frames = draw_frames(motion)
            with open(os.path.join(out_dir, "clips", f"{name}.mp4"), "wb") as f:
                f.write(encode_mp4(frames))
            Image.fromarray(frames[FRAMES // 2]).save(
                os.path.join(out_dir, "frames", f"{name}.png"), format="PNG", optimize=False)
            answer = {"role": "assistant", "content": motion.direction}
            video.append({"id": name, "videos": [f"clips/{name}.mp4"], "messages": [
                {"role": "user", "content": f"<video>\n{motion.question}"}, answer]})
            single.append({"id": name, "images": [f"frames/{name}.png"], "messages": [
                {"role": "user", "content": f"<image>\n{motion.question}"}, answer]})
        for kind, records in (("motion", video), ("single_frame", single)):
            path = os.path.join(out_dir, f"{kind}_{split}.jsonl")
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in records)
            files[kind, split] = path
    datasets = {}
    for kind, folder in (("motion", "video"), ("single_frame", "single_frame")):
        datasets[folder] = os.path.join(out_dir, folder)
        prepare_from_llava_json(datasets[folder], files[kind, "train"], out_dir,
                                val_json=files[kind, "eval"], max_bad_fraction=0.0)
    return datasets


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Write the synthetic video task (which way a shape "
                                            "moves) and its single-frame baseline.")
    p.add_argument("--out", required=True, help="new folder")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--train", type=int, default=2000)
    p.add_argument("--held-out", type=int, default=256)
    args = p.parse_args(argv)
    if os.path.exists(args.out):
        print(f"error: {args.out} already exists (choose a new folder)", file=sys.stderr)
        return 2
    for name, path in generate(args.out, args.seed, args.train, args.held_out).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
