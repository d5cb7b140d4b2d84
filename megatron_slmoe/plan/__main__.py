"""``python -m megatron_slmoe.plan``: the planner's command (megatron_slmoe.commands.plan). An entry
point nothing imports, so it stands on the top floor (tests/unit/test_import_floors.py)."""

import sys

from megatron_slmoe.commands.plan import main

if __name__ == "__main__":
    sys.exit(main())
