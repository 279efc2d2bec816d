"""The CLI when its reader goes away or it is interrupted: the shell's status, never a
traceback (``spliceway config-schema | head -1``, Ctrl-C on ``spliceway events``)."""

from __future__ import annotations

import fcntl
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spliceway import Engine
from tests.conftest import base_config
from tests.helpers.program import SPLICEWAY, events_over_ipc

F_SETPIPE_SZ = 1031
SMALL_PIPE = 4096


def _closed_after_first_bytes(argv: list[str], trigger: Any = None) -> tuple[int, bytes]:
    """Run ``argv`` with stdout into a one-page pipe that is closed after 10 bytes, so the
    program's later writes fail with EPIPE whatever their size; call ``trigger`` (to make
    an engine publish events) until the program has ended, 20 s at most."""
    r, w = os.pipe()
    fcntl.fcntl(r, F_SETPIPE_SZ, SMALL_PIPE)
    proc = subprocess.Popen(argv, stdout=w, stderr=subprocess.PIPE)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 20)
        assert ready, "the program wrote nothing in 20 s"
        assert os.read(r, 10)
    finally:
        os.close(r)
    deadline = time.monotonic() + 20
    while proc.poll() is None and time.monotonic() < deadline:
        if trigger is not None:
            trigger()
        time.sleep(0.02)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
        raise AssertionError("the program did not end after its reader went away")
    assert proc.stderr is not None
    err = proc.stderr.read()
    proc.stderr.close()
    return proc.returncode, err


def test_a_closed_stdout_ends_quietly_with_141():
    # The schema is about 66 kB: most of it is written after the reader went away.
    status, err = _closed_after_first_bytes([*SPLICEWAY, "config-schema"])
    assert (status, err) == (141, b"")


@pytest.fixture
def engine(sock_path: Path) -> Iterator[Engine]:
    # Enough groups that `policies --json` is several pages, more than the pipe holds.
    groups = [
        {"tag": f"group-{i:02d}", "kind": "selector", "outbounds": ["direct", "block"]}
        for i in range(40)
    ]
    eng = Engine(
        base_config(
            outbound_groups=groups,
            api={"control": {"enabled": False}, "ipc": {"path": str(sock_path)}},
        )
    ).start()
    try:
        yield eng
    finally:
        eng.stop()


_TARGETS = iter(["block", "direct"] * 10_000)


def _select(engine: Engine) -> None:
    """Switch a selector, for a ``policy.selected`` event."""
    engine.execute("policies.select", {"policy_tag": "group-00", "target_tag": next(_TARGETS)})


def test_policies_into_a_closed_pipe_ends_quietly_with_141(engine, sock_path):
    status, err = _closed_after_first_bytes(
        [*SPLICEWAY, "--ipc", str(sock_path), "policies", "--json"]
    )
    assert (status, err) == (141, b"")


def test_events_into_a_closed_pipe_ends_quietly_with_141(engine, sock_path):
    status, err = _closed_after_first_bytes(
        [*SPLICEWAY, "--ipc", str(sock_path), "events"], trigger=lambda: _select(engine)
    )
    assert (status, err) == (141, b"")


def test_sigint_during_events_ends_quietly_with_130(engine, sock_path):
    proc = events_over_ipc(sock_path)
    try:
        # The subscription is in place once an event comes through it.
        deadline = time.monotonic() + 20
        while not select.select([proc.stdout], [], [], 0.05)[0]:
            assert time.monotonic() < deadline, "no event reached spliceway events"
            _select(engine)
        assert '"policy.selected"' in proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 130
        assert proc.stderr.read() == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_sigint_while_the_cli_is_imported_ends_it_quietly_by_the_signal():
    """A Ctrl-C during the command's imports: SIGINT is sent from inside the import of
    spliceway.cli.main (the bulk of the start-up); the process ends by the signal, silently."""
    script = (
        "import builtins, os, signal, sys\n"
        "real = builtins.__import__\n"
        "def hooked(name, *args, **kwargs):\n"
        "    if name == 'spliceway.cli.main':\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return real(name, *args, **kwargs)\n"
        "builtins.__import__ = hooked\n"
        "sys.argv = ['spliceway', 'build-info']\n"
        "from spliceway._console import main\n"
        "sys.exit(main())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, timeout=30, check=False
    )
    assert (done.returncode, done.stdout, done.stderr) == (-signal.SIGINT, b"", b"")


def test_sigint_after_the_imports_is_130_and_silent():
    script = (
        "import os, signal, sys\n"
        "sys.argv = ['spliceway', 'build-info']\n"
        "from spliceway import _console\nfrom spliceway.cli import main as cli\n"
        "real = cli._dispatch\n"
        "def interrupted(argv):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    return real(argv)\n"
        "cli._dispatch = interrupted\n"
        "sys.exit(_console.main())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, timeout=30, check=False
    )
    assert (done.returncode, done.stdout, done.stderr) == (130, b"", b"")


@pytest.mark.parametrize(
    ("how", "message"),
    [("closed", "Bad file descriptor"), ("full", "No space left on device")],
)
def test_stdout_that_cannot_be_written_is_one_line_and_1(how, message):
    # A shell closes fd 1 and execs the program. Not a preexec_fn: that makes subprocess
    # fork() instead of vfork(), which runs gRPC's atfork handlers in a test process that
    # imported grpc earlier; the poller they start dies when close_fds closes its epoll
    # fd (SIGABRT before the exec, seen with pytest-xdist).
    argv = ["sh", "-c", 'exec "$@" >&-', "sh"] if how == "closed" else []
    with open("/dev/full", "wb") as full:
        done = subprocess.run(
            [*argv, *SPLICEWAY, "config-schema"],
            stdout=full if how == "full" else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=30,
            check=False,
        )
    assert done.returncode == 1
    assert done.stderr.decode() == f"spliceway: cannot write standard output: {message}\n"
