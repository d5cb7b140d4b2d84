"""Parallel layout: the ranks' node topology and the layout settings."""
