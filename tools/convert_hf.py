#!/usr/bin/env python
"""Convert between Hugging Face checkpoints and Megatron dist checkpoints (``slmoe-convert-hf``;
see megatron_slmoe.commands.convert_hf)."""

import sys

from megatron_slmoe.commands.convert_hf import main

if __name__ == "__main__":
    sys.exit(main())
