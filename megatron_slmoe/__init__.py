"""megatron_slmoe: LoRA fine-tuning of Stable Latent MoE models on Megatron-Core.

Importing the package applies the adaptor for the detected platform (see ``megatron_slmoe.platform``),
so import it before building any Megatron-Core model.
"""

import os as _os
import sys as _sys

from megatron_slmoe.platform import PlatformError, apply_adaptor as _apply_adaptor

__version__ = "0.1.0"


def _is_our_command_line() -> bool:
    """Whether this process is one of the project's command-line programs: ``python -m
    megatron_slmoe.<tool>`` (argv[0] is "-m" while runpy locates the module), an installed
    ``slmoe-*`` console script, or a script in this checkout's ``tools/``."""
    program = _sys.argv[0] if _sys.argv else ""
    tools = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "tools")
    return (program == "-m" or _os.path.basename(program).startswith("slmoe-")
            or _os.path.abspath(program).startswith(tools + _os.sep))


try:
    PLATFORM = _apply_adaptor()
except PlatformError as _err:
    if _is_our_command_line():  # one line and exit code 2, not a traceback
        print(f"error: {_err}", file=_sys.stderr)
        raise SystemExit(2) from None
    raise
