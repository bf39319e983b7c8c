"""`python -m flows.cli`: the `dlrm` command."""

from flows.cli import entry

entry()
