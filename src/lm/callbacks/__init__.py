"""Lightning callbacks of `lm`, one file per concern."""
