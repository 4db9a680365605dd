"""Lightning callbacks: one file per callback."""
