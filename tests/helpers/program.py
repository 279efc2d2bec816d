"""The ``spliceway`` program run as a user runs it, in a subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SPLICEWAY = [sys.executable, "-m", "spliceway"]
REPO = Path(__file__).resolve().parents[2]


def python_json(script: str) -> Any:
    """Run ``script`` in a fresh interpreter at the repository root (nothing imported
    yet); the JSON of the last line it printed."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def events_over_ipc(sock_path: str | os.PathLike[str]) -> subprocess.Popen[str]:
    """``spliceway --ipc SOCK events --types policy.selected``, its stdout and stderr
    piped as text."""
    return subprocess.Popen(
        [*SPLICEWAY, "--ipc", os.fspath(sock_path), "events", "--types", "policy.selected"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


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


def write_config(tmp_path: Path, doc: dict[str, Any]) -> str:
    """``doc`` as ``tmp_path/config.json``; its path."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    return str(path)


def environ_without(*names: str) -> dict[str, str]:
    """This process's environment less ``names`` (a new user's shell has no key set)."""
    return {k: v for k, v in os.environ.items() if k not in names}


@contextmanager
def running(
    config: str | os.PathLike[str], env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """``spliceway run -c config`` with its stderr piped as text; killed on the way out
    if the test did not stop it, and its stderr closed either way."""
    proc = subprocess.Popen(
        [*SPLICEWAY, "run", "-c", os.fspath(config)], stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()
