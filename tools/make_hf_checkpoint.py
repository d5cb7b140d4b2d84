#!/usr/bin/env python
"""A random-weight Hugging Face checkpoint with a real model's layer shapes and fewer layers (``slmoe-make-hf-checkpoint``; see megatron_slmoe.commands.make_hf_checkpoint)."""

import sys

from megatron_slmoe.commands.make_hf_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
