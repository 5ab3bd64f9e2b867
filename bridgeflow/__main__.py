"""``python -m bridgeflow``: the same as the ``bridgeflow`` command."""

import sys

from .cli import main

sys.exit(main())
