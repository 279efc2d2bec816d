"""The ``spliceway`` program run as a user runs it, in a subprocess."""

from __future__ import annotations

import re
import subprocess
import sys
import time

SPLICEWAY = [sys.executable, "-m", "spliceway"]


def wait_for_line(proc: subprocess.Popen, pattern: str, timeout: float = 20) -> re.Match[str]:
    """Read ``proc``'s text stderr until a line matches ``pattern``; fail at EOF or ``timeout``."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        if match := re.search(pattern, line):
            return match
    raise AssertionError(f"no stderr line matched {pattern!r}: {seen}")
