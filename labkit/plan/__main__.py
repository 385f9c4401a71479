"""``python -m labkit.plan``: see :mod:`labkit.plan.cli`."""

import sys

from .cli import main

sys.exit(main())
