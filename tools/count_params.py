#!/usr/bin/env python
"""Parameter census of a model config: total and active-per-token parameters, by component. (``slmoe-count-params``; see megatron_slmoe.commands.count_params)."""

import sys

from megatron_slmoe.commands.count_params import main

if __name__ == "__main__":
    sys.exit(main())
