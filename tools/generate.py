#!/usr/bin/env python
"""Generate answers with a base model and an optional LoRA adapter (``slmoe-generate``; see
megatron_slmoe.commands.generate)."""

import sys

from megatron_slmoe.commands.generate import main

if __name__ == "__main__":
    sys.exit(main())
