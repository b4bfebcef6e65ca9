"""`python -m ddtree ...`: the same command line as the `ddtree` console script."""

import sys

from .cli import main

sys.exit(main())
