"""Train a byte-level BPE tokenizer (tokenizer.json) on text or JSONL files.

    slmoe-train-tokenizer --input corpus.txt task.jsonl --vocab-size 512 --output tokenizer.json

Inputs: ``.txt`` (every line) or ``.jsonl`` (the ``text``, ``prompt``, ``response`` and
``messages[].content`` strings). Special tokens ``<|pad|> <|eos|> <|bos|> <|system|> <|user|>
<|assistant|>`` get ids 0..5. Bad input (missing file, vocabulary too small) is one line on stderr,
exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

from megatron_slmoe.commands.cli import user_errors
from megatron_slmoe.data.tokenizer import train_tokenizer


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, help="training text files (.txt, .jsonl)")
    parser.add_argument("--vocab-size", type=int, required=True,
                        help="total vocabulary, special tokens and 256 byte symbols included")
    parser.add_argument("--output", required=True, help="path of the tokenizer.json to write")
    parser.add_argument("--min-frequency", type=int, default=2, help="least count of a merged pair")
    return parser.parse_args(argv)


@user_errors("megatron_slmoe.data.errors.DataError")
def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_slmoe.platform import apply_adaptor

    apply_adaptor()
    logging.getLogger("megatron").setLevel(logging.ERROR)
    tokenizer = train_tokenizer(args.input, args.vocab_size, args.output,
                                min_frequency=args.min_frequency)
    specials = " ".join(f"{tok}={tid}" for tok, tid in tokenizer.special_tokens.items())
    print(f"wrote {args.output}: vocab_size {tokenizer.vocab_size}, special tokens {specials}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
