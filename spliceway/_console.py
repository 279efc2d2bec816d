"""The ``spliceway`` command's first code.

Importing the CLI takes a moment (pydantic, orjson, the actors for ``run``). A Ctrl-C
then would be a KeyboardInterrupt raised inside some import: a traceback, or worse, a
crash inside a C extension's initialisation (seen with orjson). So SIGINT keeps the
system's default action, ending the process quietly by the signal (a shell shows 130),
until :func:`spliceway.cli.main.main` takes it over.
"""

from __future__ import annotations

import signal


def main() -> int:
    """Run the ``spliceway`` command."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    from spliceway.cli.main import main as cli_main

    return cli_main(take_sigint=True)
