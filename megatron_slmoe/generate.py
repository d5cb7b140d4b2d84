"""``python -m megatron_slmoe.generate``: answers from a base model and an optional adapter (see
megatron_slmoe.commands.generate)."""

import sys

from megatron_slmoe.commands.generate import main

if __name__ == "__main__":
    sys.exit(main())
