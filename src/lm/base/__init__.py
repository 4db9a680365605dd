"""The base wing, below everything: exit codes and their exceptions, the doctor's `Finding`, Markdown tables."""
