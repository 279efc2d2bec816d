"""``python -m spliceway`` is the ``spliceway`` command."""

import sys

from spliceway.cli import main

sys.exit(main())
