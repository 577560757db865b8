"""The README and docs/: every code block runs as written."""
