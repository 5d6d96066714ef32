"""`python -m jsparse ...`: the `jsparse` command (`jsparse.cli.main`)."""

import sys

from jsparse.cli import main

sys.exit(main())
