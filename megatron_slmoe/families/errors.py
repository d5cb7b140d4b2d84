"""The one error type of Hugging Face interop: a checkpoint or config we cannot use.

The message is one line that names the file and, where there is one, the tensor; command-line
tools print it and exit with code 2.
"""

from __future__ import annotations

from megatron_slmoe.utils.errors import InputError


class HFCheckpointError(InputError, ValueError):
    """An unusable Hugging Face checkpoint directory, config or tensor (one line)."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))
