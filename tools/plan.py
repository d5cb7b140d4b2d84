#!/usr/bin/env python
"""Layout planner for LoRA fine-tuning: a thin wrapper over ``python -m megatron_slmoe.plan``.

    python tools/plan.py --model-config flagship_2p8t --num-devices 256 --device h200 --json plan.json
"""

import sys

from megatron_slmoe.plan.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
