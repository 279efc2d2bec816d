"""Every C parser (csrc/parse.c, csrc/pkt.c; the SOCKS5 request and UDP header, HTTP
heads, TLS ClientHello/SNI, the upstream replies, the TUN's packets) under ASan and
UBSan in every CI run: benchmarks/fuzz_parse.py builds the driver with
``-fsanitize=address,undefined -fno-sanitize-recover=all`` and runs a bounded, seeded
slice of the fuzz campaign (the long runs are the benchmark's own). A sanitizer report
or a broken driver invariant exits non-zero with the failing input kept. The route
tables (csrc/route.c) get the same through benchmarks/fuzz_route.c."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _fuzz(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``benchmarks/<script> args`` run to a clean exit (its output's tails if not)."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return run


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_c_parsers_survive_a_sanitized_fuzz_run() -> None:
    run = _fuzz("fuzz_parse.py", "--count", "200000", "--seconds", "60", "--seed", "20261125")
    assert "fuzz_parse exited 0" in run.stdout + run.stderr


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_route_tables_survive_a_sanitized_fuzz_run() -> None:
    """csrc/route.c's builders and sw_table_decide under ASan/UBSan, through the same
    command as CI's fuzz slice (benchmarks/fuzz_slice.py), for a short seeded run."""
    run = _fuzz("fuzz_slice.py", "--only", "route", "--seconds", "5", "--seed", "20261125")
    assert "fuzz slice: all clean" in run.stdout
