"""Small shared utilities with no model or training logic: atomic writes (`atomic`), directory
manifests (`manifest`), masking of credentials in text, dumps and logs (`redact`)."""
