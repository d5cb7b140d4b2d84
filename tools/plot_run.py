#!/usr/bin/env python
"""Pictures of a run as PNGs (``slmoe-plot-run``; see megatron_slmoe.commands.plot_run)."""

import sys

from megatron_slmoe.commands.plot_run import main

if __name__ == "__main__":
    sys.exit(main())
