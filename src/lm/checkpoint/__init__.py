"""Checkpoint files behind one `Checkpointer` (checkpointer.py): names and reading, the format, local writes,
resume and the resume check, the bucket mirror, the save callback."""
