"""``python -m sidecar ...``: the same commands as the ``sidecar`` script."""

import sys

from sidecar.cli import main

sys.exit(main())
