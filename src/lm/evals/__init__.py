"""Benchmarks: CORE and the @olmo sets scored by lm itself, lm-evaluation-harness for the rest, one entry
(`lm.evals.evaluate.evaluate`) for `lm eval` and the milestone callback. Imported only when a run or a verb
asks for benchmarks: this file imports nothing."""
