"""Kimi K3: the family (``family``: config reading, tensor table, the release's layout)."""
