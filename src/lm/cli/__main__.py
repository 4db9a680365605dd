"""`python -m lm.cli`: the `lm` command."""

from lm.cli import main

main()
