"""Paths of the small data shipped in ``megatron_slmoe/assets/`` (see ``data/synthetic.py``)."""

import os

from megatron_slmoe.data.errors import require_file

ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")


def asset_path(name: str) -> str:
    """Path of a shipped asset file, e.g. ``asset_path("tokenizer.json")``; a one-line
    :class:`~megatron_slmoe.data.errors.DataFileNotFoundError` when the install lacks it."""
    return require_file(os.path.join(ASSETS_DIR, name), "shipped asset")
