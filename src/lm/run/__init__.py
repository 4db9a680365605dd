"""One run: its composition (train), its preflight (doctor), a sweep's records and summary (sweep), its last word (report)."""
