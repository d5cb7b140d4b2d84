"""Small shared utilities with no model or training logic."""
