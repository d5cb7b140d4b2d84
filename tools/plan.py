#!/usr/bin/env python
"""Layout planner for LoRA fine-tuning: a thin wrapper over ``slmoe-plan``
(megatron_slmoe.commands.plan).

    python tools/plan.py --model-config flagship_2p8t --num-devices 256 --device h200 --json plan.json
"""

import sys

from megatron_slmoe.commands.plan import main

if __name__ == "__main__":
    sys.exit(main())
