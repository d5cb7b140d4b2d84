#!/usr/bin/env python
"""Choose the LoRA rank by short fine-tunes at several ranks (``slmoe-rank-sweep``; see
megatron_slmoe.commands.rank_sweep)."""

import sys

from megatron_slmoe.commands.rank_sweep import main

if __name__ == "__main__":
    sys.exit(main())
