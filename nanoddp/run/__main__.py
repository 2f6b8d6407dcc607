"""`python -m nanoddp.run ...` is `nanoddp run ...`."""

import sys

from nanoddp.run.command import main

sys.exit(main())
