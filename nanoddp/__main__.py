"""`python -m nanoddp` is the `nanoddp` command."""

import sys

from nanoddp.cli import main

sys.exit(main())
