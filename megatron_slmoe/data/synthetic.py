"""Deterministic generator of the small data shipped in ``megatron_slmoe/assets/``.

Everything is made here from templates and a seeded :class:`random.Random` (string seeds hash with
SHA-512, so the output is the same on every machine and Python version); nothing is copied from
elsewhere. Each document and each task record has its own generator seeded by ``(seed, index)``, so
any part can be regenerated alone and compared with the shipped files.

The assets (regenerate them with ``python -m megatron_slmoe.data.synthetic --out-dir DIR``):

``corpus.txt``
    Plain text for pretraining a tiny base model on CPU. Documents are separated by a blank line
    (the ``.txt`` convention of ``tools/preprocess_data.py``); each is a paragraph of short sentences
    with learnable structure: arithmetic on digits (``3 plus 4 is 7.``), number words and their
    digits (``seven is 7.``), counting, animal sounds, colours of things, opposites, alternating
    patterns and repeated word lists.

``digits_train.jsonl`` / ``digits_eval.jsonl``
    The instruction-tuning task: turn a list of 2 to 4 number words into digits,
    ``Write in digits: seven two nine`` -> ``7 2 9``. The base model has seen number words and
    digits, but never a chat turn; it cannot do the task before tuning. The word lists of the eval
    split never occur in the train split. Both record formats are present: about half
    ``{"prompt", "response"}``, half ``{"messages": [...]}`` (some with a system message, some with
    two user/assistant turns).

``tokenizer.json``
    Byte-level BPE, vocabulary 512 (6 special tokens, 256 bytes, 250 merges), trained by
    :func:`megatron_slmoe.data.tokenizer.train_tokenizer` on ``corpus.txt`` and ``digits_train.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Dict, List, Sequence, Tuple

from megatron_slmoe.data.tokenizer import train_tokenizer
from megatron_slmoe.utils.atomic import write_text_atomic

SEED = 20240611
CORPUS_DOCS = 1200
TASK_TRAIN = 2000
TASK_EVAL = 200
TOKENIZER_VOCAB = 512

CORPUS_FILE = "corpus.txt"
TASK_TRAIN_FILE = "digits_train.jsonl"
TASK_EVAL_FILE = "digits_eval.jsonl"
TOKENIZER_FILE = "tokenizer.json"

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
                "seventeen", "eighteen", "nineteen", "twenty")
ANIMAL_SOUNDS = (("cow", "moo"), ("dog", "woof"), ("cat", "meow"), ("duck", "quack"),
                 ("sheep", "baa"), ("owl", "hoot"), ("lion", "roar"), ("frog", "ribbit"),
                 ("horse", "neigh"), ("bee", "buzz"), ("mouse", "squeak"), ("snake", "hiss"))
THING_COLOURS = (("sky", "blue"), ("grass", "green"), ("snow", "white"), ("coal", "black"),
                 ("banana", "yellow"), ("tomato", "red"), ("plum", "purple"), ("carrot", "orange"),
                 ("sea", "blue"), ("leaf", "green"), ("milk", "white"), ("night", "black"),
                 ("lemon", "yellow"), ("cherry", "red"), ("cloud", "grey"), ("sand", "brown"))
OPPOSITES = (("hot", "cold"), ("big", "small"), ("fast", "slow"), ("up", "down"), ("day", "night"),
             ("open", "closed"), ("wet", "dry"), ("light", "dark"), ("happy", "sad"),
             ("loud", "quiet"), ("early", "late"), ("full", "empty"), ("old", "new"),
             ("high", "low"), ("hard", "soft"), ("left", "right"))
COLOURS = ("red", "blue", "green", "yellow", "black", "white")
NOUNS = ("cat", "dog", "sun", "tree", "box", "cup", "hat", "car", "fish", "bird", "book", "door")
LETTERS = "abcdefghijklmnopqrstuvwxyz"

TASK_PROMPT = "Write in digits: {words}"
TASK_SYSTEM = "You turn number words into digits."


def _rng(seed: int, kind: str, index: int) -> random.Random:
    return random.Random(f"{seed}/{kind}/{index}")


# ---- corpus ----------------------------------------------------------------------------------------

def _sentence(r: random.Random) -> str:
    kind = r.randrange(12)
    if kind == 0:
        a, b = r.randrange(10), r.randrange(10)
        return f"{a} plus {b} is {a + b}."
    if kind == 1:
        a = r.randrange(10)
        b = r.randrange(a + 1)
        return f"{a} minus {b} is {a - b}."
    if kind == 2:
        n = r.randrange(21)
        return r.choice((f"{NUMBER_WORDS[n]} is {n}.", f"the number {n} is written {NUMBER_WORDS[n]}."))
    if kind == 3:
        a, b = r.randrange(10), r.randrange(10)
        return f"{NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]} is {NUMBER_WORDS[a + b]}."
    if kind == 4:
        start, length = r.randrange(12), r.randrange(3, 9)
        if r.random() < 0.5:
            return "count: " + " ".join(str(i) for i in range(start, start + length)) + "."
        return "count: " + " ".join(NUMBER_WORDS[i] for i in range(start, start + length)) + "."
    if kind == 5:
        animal, sound = r.choice(ANIMAL_SOUNDS)
        return r.choice((f"the {animal} says {sound}.", f"a {animal} goes {sound} {sound}."))
    if kind == 6:
        thing, colour = r.choice(THING_COLOURS)
        return r.choice((f"the {thing} is {colour}.", f"the colour of the {thing} is {colour}."))
    if kind == 7:
        a, b = r.choice(OPPOSITES)
        if r.random() < 0.5:
            a, b = b, a
        return f"the opposite of {a} is {b}."
    if kind == 8:
        x, y = r.sample(COLOURS, 2)
        return " ".join([x, y] * r.randrange(2, 5)) + "."
    if kind == 9:
        words = r.sample(NOUNS, r.randrange(2, 5))
        return "say: " + " ".join(words) + ". " + " ".join(words) + "."
    if kind == 10:
        start, length = r.randrange(20), r.randrange(3, 7)
        return " ".join(LETTERS[start:start + length]) + "."
    n = r.randrange(10)
    return f"double {n} is {2 * n}."


def corpus_document(index: int, seed: int = SEED) -> str:
    """Document ``index`` of the corpus: 4 to 10 sentences, one per line."""
    r = _rng(seed, "doc", index)
    return "\n".join(_sentence(r) for _ in range(r.randrange(4, 11)))


def generate_corpus(num_docs: int = CORPUS_DOCS, seed: int = SEED, start: int = 0) -> str:
    """Documents ``start .. start+num_docs-1`` joined by blank lines, ending with a newline."""
    return "\n\n".join(corpus_document(i, seed) for i in range(start, start + num_docs)) + "\n"


# ---- instruction task ------------------------------------------------------------------------------

def _task_words(r: random.Random) -> Tuple[int, ...]:
    return tuple(r.randrange(10) for _ in range(r.randrange(2, 5)))


def task_turn(digits: Sequence[int]) -> Tuple[str, str]:
    """(prompt, response) of one task turn for a list of digits."""
    return (TASK_PROMPT.format(words=" ".join(NUMBER_WORDS[d] for d in digits)),
            " ".join(str(d) for d in digits))


def _task_record(r: random.Random, turns: List[Tuple[int, ...]]) -> Dict:
    if len(turns) == 1 and r.random() < 0.5:
        prompt, response = task_turn(turns[0])
        return {"prompt": prompt, "response": response}
    messages = []
    if r.random() < 0.3:
        messages.append({"role": "system", "content": TASK_SYSTEM})
    for digits in turns:
        prompt, response = task_turn(digits)
        messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return {"messages": messages}


def generate_task(num_train: int = TASK_TRAIN, num_eval: int = TASK_EVAL,
                  seed: int = SEED) -> Tuple[List[Dict], List[Dict]]:
    """(train records, eval records). Eval word lists are drawn first and never appear in train."""
    eval_records, seen = [], set()
    i = 0
    while len(eval_records) < num_eval:
        r = _rng(seed, "eval", i)
        i += 1
        digits = _task_words(r)
        if digits in seen:
            continue
        seen.add(digits)
        eval_records.append(_task_record(r, [digits]))
    held_out = frozenset(seen)
    train_records = []
    i = 0
    while len(train_records) < num_train:
        r = _rng(seed, "train", i)
        i += 1
        turns = [_task_words(r) for _ in range(2 if r.random() < 0.15 else 1)]
        if any(t in held_out for t in turns):
            continue
        train_records.append(_task_record(r, turns))
    return train_records, eval_records


def records_to_jsonl(records: Sequence[Dict]) -> str:
    return "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records)


# ---- all assets ------------------------------------------------------------------------------------

def write_assets(out_dir: str, seed: int = SEED, tokenizer: bool = True) -> Dict[str, str]:
    """Write the corpus, the task splits and (unless ``tokenizer=False``) the tokenizer trained on
    them into ``out_dir``; returns name -> path."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name)
             for name in (CORPUS_FILE, TASK_TRAIN_FILE, TASK_EVAL_FILE, TOKENIZER_FILE)}
    train, evals = generate_task(seed=seed)
    for name, text in ((CORPUS_FILE, generate_corpus(seed=seed)),
                       (TASK_TRAIN_FILE, records_to_jsonl(train)),
                       (TASK_EVAL_FILE, records_to_jsonl(evals))):
        write_text_atomic(paths[name], text)
    if tokenizer:
        train_tokenizer([paths[CORPUS_FILE], paths[TASK_TRAIN_FILE]], TOKENIZER_VOCAB,
                        paths[TOKENIZER_FILE])
    else:
        del paths[TOKENIZER_FILE]
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", required=True, help="where to write the asset files")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--no-tokenizer", action="store_true", help="skip training tokenizer.json")
    args = parser.parse_args(argv)
    for name, path in write_assets(args.out_dir, seed=args.seed,
                                   tokenizer=not args.no_tokenizer).items():
        print(f"{name}: {os.path.getsize(path)} bytes -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
