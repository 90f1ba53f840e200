"""``python -m remat_pass.cli``: the same command line as the ``remat-pass`` script."""

import sys

from .main import main

sys.exit(main())
