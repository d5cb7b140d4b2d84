"""Tokenize text into Megatron-Core indexed data (PREFIX.bin + PREFIX.idx) for pretraining.

    slmoe-preprocess-data --input corpus.txt --tokenizer tokenizer.json --output-prefix data/corpus
    slmoe-preprocess-data --input docs.jsonl --json-key text --tokenizer tokenizer.json \\
        --output-prefix data/docs

Documents: ``.jsonl`` -> the ``--json-key`` string of each line; other files -> paragraphs
separated by blank lines (``--document-per-line``: each non-empty line). Each document is written as
one sequence followed by ``<|eos|>``. Bad records are skipped with a warning ``FILE:LINE: ...`` and
counted; bad input (missing file, invalid tokenizer, no documents) is one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from megatron_slmoe.commands.cli import user_errors
from megatron_slmoe.data.tokenizer import load_tokenizer


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="a .jsonl or plain-text file")
    parser.add_argument("--tokenizer", required=True, help="a tokenizer.json")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--json-key", default="text", help="the text field of .jsonl records")
    parser.add_argument("--document-per-line", action="store_true",
                        help="plain text: each non-empty line is a document (default: paragraphs)")
    parser.add_argument("--no-eos", action="store_true", help="do not append <|eos|> per document")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return parser.parse_args(argv)


@user_errors("megatron_slmoe.data.errors.DataError")
def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    from megatron_slmoe.platform import apply_adaptor

    apply_adaptor()
    from megatron_slmoe.data.pretrain import preprocess

    logging.getLogger("megatron").setLevel(logging.ERROR)
    tokenizer = load_tokenizer(args.tokenizer)
    stats = preprocess(args.input, tokenizer, args.output_prefix, json_key=args.json_key,
                       document_per_line=args.document_per_line, append_eos=not args.no_eos)
    summary = {"input": args.input, "output_prefix": args.output_prefix, **stats.__dict__}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {args.output_prefix}.bin/.idx: {stats.documents} documents, {stats.tokens} "
              f"tokens, {stats.skipped} bad records skipped {stats.by_reason or ''}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
