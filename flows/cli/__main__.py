"""`python -m flows.cli`: the `dlrm` command."""

import sys

from flows.cli import main

sys.exit(main())
