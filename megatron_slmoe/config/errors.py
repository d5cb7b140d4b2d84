"""The one error type of bad configuration."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid model or run configuration. The message is one line and names the flag (or the
    file and key) to change; a command line prints it and exits with code 2."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))
