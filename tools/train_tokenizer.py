#!/usr/bin/env python
"""Train a byte-level BPE tokenizer (tokenizer.json) on text or JSONL files. (``slmoe-train-tokenizer``; see megatron_slmoe.commands.train_tokenizer)."""

import sys

from megatron_slmoe.commands.train_tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
