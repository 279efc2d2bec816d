"""``python -m spliceway`` is the ``spliceway`` command."""

import sys

from spliceway._console import main

sys.exit(main())
