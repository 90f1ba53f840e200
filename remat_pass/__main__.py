"""``python -m remat_pass``: the ``remat-pass`` command line."""

import sys

from .cli import main

sys.exit(main())
