"""The one error type of the data package."""

from megatron_slmoe.utils.errors import InputError


class DataError(InputError):
    """Bad or missing data input (tokenizer, data file, index); the message is one line naming it."""


class DataFileNotFoundError(DataError, FileNotFoundError):
    """A data or tokenizer file that does not exist."""


def require_file(path: str, what: str) -> str:
    """``path`` as a str if it is an existing file, else a one-line :class:`DataFileNotFoundError`."""
    import os

    path = os.fspath(path)
    if not os.path.isfile(path):
        reason = "is a directory, not a file" if os.path.isdir(path) else "not found"
        raise DataFileNotFoundError(f"{what} {reason}: {path}")
    return path
