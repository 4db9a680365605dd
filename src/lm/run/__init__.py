"""One run: its composition (train), its preflight (doctor) and its last word (report)."""
