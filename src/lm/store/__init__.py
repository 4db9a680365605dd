"""The bottom wing: atomic writes, the run directory's files, the run lock, exit codes, object storage, tables, findings."""
