"""`python -m nanoddp.run ...` is `nanoddp run ...`."""

import sys

from nanoddp.run import main

sys.exit(main())
