"""`python -m strata`: the same command line as the `strata` script."""

import sys

from strata.cli import main

sys.exit(main())
