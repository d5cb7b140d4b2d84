"""megatron_slmoe: LoRA fine-tuning of Stable Latent MoE models on Megatron-Core.

Importing the package applies the adaptor for the detected platform (see ``megatron_slmoe.platform``),
so import it before building any Megatron-Core model.
"""

import sys as _sys

from megatron_slmoe.platform import PlatformError, apply_adaptor as _apply_adaptor

__version__ = "0.1.0"

try:
    PLATFORM = _apply_adaptor()
except PlatformError as _err:
    # While `python -m megatron_slmoe.<tool>` locates its module, argv[0] is "-m" (documented
    # runpy behaviour): a command-line user gets one line and exit code 2, not a traceback.
    if _sys.argv[:1] == ["-m"]:
        print(f"error: {_err}", file=_sys.stderr)
        raise SystemExit(2) from None
    raise
