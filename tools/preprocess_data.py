#!/usr/bin/env python
"""Tokenize text into Megatron-Core indexed data (PREFIX.bin + PREFIX.idx) for pretraining. (``slmoe-preprocess-data``; see megatron_slmoe.commands.preprocess_data)."""

import sys

from megatron_slmoe.commands.preprocess_data import main

if __name__ == "__main__":
    sys.exit(main())
