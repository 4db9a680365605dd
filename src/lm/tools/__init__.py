"""The verbs around runs: bench, plan (budget), calibrate, sky, sweep, supervise, export."""
