"""Checkpoint files: their names and reading, local saves and resume, the bucket mirror, the save callback."""
