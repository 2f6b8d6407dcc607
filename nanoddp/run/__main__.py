"""`python -m nanoddp.run ...` is `nanoddp run ...`."""

import sys

from nanoddp.run.cli import main

sys.exit(main())
