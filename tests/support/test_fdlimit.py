"""spliceway.support.fdlimit: the RLIMIT_NOFILE raise (in a child, under prlimit), AcceptBackoff."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys

import pytest

from spliceway.support import fdlimit
from spliceway.support.fdlimit import BACKOFF_INITIAL_S, BACKOFF_MAX_S, AcceptBackoff

_RAISE = (
    "import json; from spliceway.support import fdlimit; before = fdlimit.nofile_limits(); "
    "after = fdlimit.raise_nofile_limit(); print(json.dumps([before, after, "
    "fdlimit.nofile_limits()]))"
)


@pytest.mark.skipif(not os.path.exists("/usr/bin/prlimit"), reason="needs prlimit")
def test_raise_nofile_limit_lifts_soft_to_hard() -> None:
    out = subprocess.run(
        ["prlimit", "--nofile=64:300", "--", sys.executable, "-c", _RAISE],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    before, after, now = json.loads(out)
    assert before == [64, 300]
    assert after == now == [300, 300]


def test_is_fd_exhaustion() -> None:
    for err in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
        assert fdlimit.is_fd_exhaustion(err)
    for other in (None, 0, errno.EAGAIN, errno.ECONNABORTED, errno.EINTR, errno.EPERM):
        assert not fdlimit.is_fd_exhaustion(other)


def test_backoff_grows_warns_once_per_outage(caplog: pytest.LogCaptureFixture) -> None:
    warned: list[str] = []
    backoff = AcceptBackoff("inbound 'x'", warned.append)
    before = fdlimit.backoff_stats()
    with caplog.at_level(logging.DEBUG, logger="spliceway.support.fdlimit"):
        assert backoff.failed(errno.ECONNABORTED) == 0.0  # not an exhaustion: no pause
        delays = [backoff.failed(errno.EMFILE) for _ in range(8)]
        assert backoff.in_outage
        backoff.accepted()
        backoff.accepted()  # no outage: nothing
        assert backoff.failed(errno.ENFILE) == BACKOFF_INITIAL_S
        backoff.accepted(failed=5)  # counted elsewhere (C): 5 in this outage
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    assert max(delays) == BACKOFF_MAX_S
    assert len(warned) == 2
    assert warned[0].startswith("inbound 'x' cannot accept connections: out of file descriptors")
    assert "(EMFILE; RLIMIT_NOFILE soft " in warned[0] and "(ENFILE;" in warned[1]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert [r.getMessage() for r in warnings] == warned
    assert infos == [
        "inbound 'x' accepts connections again (8 accepts failed)",
        "inbound 'x' accepts connections again (5 accepts failed)",
    ]
    assert (backoff.failures, backoff.outages) == (13, 2)
    after = fdlimit.backoff_stats()
    assert after["accept_failures"] - before["accept_failures"] == 13
    assert after["outages"] - before["outages"] == 2
    assert "inbound 'x'" not in after["listeners_in_outage"]


def test_backoff_survives_a_failing_warn() -> None:
    def warn(message: str) -> None:
        raise RuntimeError("sink down")

    backoff = AcceptBackoff("IPC socket /x", warn)
    assert backoff.failed(errno.EMFILE) == BACKOFF_INITIAL_S
    assert fdlimit.snapshot()["listeners_out_of_descriptors"].count("IPC socket /x") == 1
    backoff.accepted()
    assert "IPC socket /x" not in fdlimit.snapshot()["listeners_out_of_descriptors"]


def test_snapshot_shape() -> None:
    snap = fdlimit.snapshot()
    soft, hard = fdlimit.nofile_limits()
    assert (snap["soft_limit"], snap["hard_limit"]) == (soft, hard)
    assert snap["open"] >= 3
    assert set(snap) == {
        "soft_limit",
        "hard_limit",
        "open",
        "accept_failures",
        "accept_outages",
        "listeners_out_of_descriptors",
    }
