"""The storage wing: atomic writes, the run directory's files, the run lock, bench.json, object storage."""
