"""The one error type of bad configuration."""

from __future__ import annotations

from megatron_slmoe.utils.errors import InputError
from megatron_slmoe.utils.redact import redact


class ConfigError(InputError, ValueError):
    """An invalid model or run configuration. The message is one line and names the flag (or the
    file and key) to change; a command line prints it and exits with code 2. It never holds a
    credential (a value echoed back is masked)."""

    def __init__(self, message: str) -> None:
        super().__init__(redact(" ".join(str(message).split())))
