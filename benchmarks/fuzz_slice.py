"""The bounded C fuzz slice CI runs: every C fuzz driver built under ASan and UBSan
(``-fsanitize=address,undefined -fno-sanitize-recover=all``) and run for a fixed time.

    python benchmarks/fuzz_slice.py                  # 20 s per driver, today's seed
    python benchmarks/fuzz_slice.py --seconds 5 --seed 7
    python benchmarks/fuzz_slice.py --only route

The drivers (each with its invariants in its header comment):

- ``parse``: benchmarks/fuzz_parse.c through benchmarks/fuzz_parse.py (its seed files
  included): csrc/parse.c (SOCKS5, HTTP CONNECT and forwarding heads, upstream
  replies, TLS/HTTP sniffing, the SOCKS5 UDP header), csrc/iplit.c (host literals)
  and csrc/pkt.c (TUN packets and their rewrites);
- ``route``: benchmarks/fuzz_route.c: csrc/route.c's table builders and
  ``sw_table_decide`` on random tables and hostile hosts.

The seed defaults to today's date (UTC, YYYYMMDD), so the slice covers new inputs each
day and a red run can be replayed: it prints the seed, and a failing driver prints or
keeps its input (benchmarks/build/fuzz-parse-failure.bin, or fuzz_route's replay line).
Exits 0 when every driver ran clean, 1 when any failed (sanitizer report, broken
invariant, build error or timeout).  Needs a C compiler with the ASan and UBSan
runtimes (Debian: gcc, which brings libasan8 and libubsan1); no clang.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
BUILD = BENCH / "build"
SANITIZE = [
    "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer",
]  # fmt: skip
SANITIZER_ENV = {
    "ASAN_OPTIONS": "abort_on_error=1:detect_leaks=1",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
}
#: The route driver's sources (rebuilt when any is newer than the binary).
ROUTE_SOURCES = (
    BENCH / "fuzz_route.c", ROOT / "csrc" / "route.c", ROOT / "csrc" / "route_set.c",
    ROOT / "csrc" / "iplit.c", ROOT / "csrc" / "route.h", ROOT / "csrc" / "route_int.h",
    ROOT / "csrc" / "iplit.h",
)  # fmt: skip
#: Far more inputs than a slice reaches: the time bound is what stops a driver.
UNBOUNDED = "1000000000000"


def build_route(cc: str) -> Path:
    """benchmarks/build/fuzz_route, compiled with the sanitizers and -Werror."""
    BUILD.mkdir(exist_ok=True)
    exe = BUILD / "fuzz_route"
    if exe.exists() and all(exe.stat().st_mtime >= src.stat().st_mtime for src in ROUTE_SOURCES):
        return exe
    c_files = [str(src) for src in ROUTE_SOURCES if src.suffix == ".c"]
    cmd = [cc, "-std=gnu11", "-O1", "-g", "-Wall", "-Wextra", "-Werror", *SANITIZE,
           f"-I{ROOT / 'csrc'}", "-o", str(exe), *c_files]  # fmt: skip
    print("build: " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    return exe


def parse_command(cc: str, seconds: float, seed: int) -> list[str]:
    """fuzz_parse.py builds its own driver (and writes its seed files)."""
    del cc  # fuzz_parse.py reads $CC, which run() passes on
    return [sys.executable, str(BENCH / "fuzz_parse.py"), "--count", UNBOUNDED,
            "--seconds", str(seconds), "--seed", str(seed)]  # fmt: skip


def route_command(cc: str, seconds: float, seed: int) -> list[str]:
    return [str(build_route(cc)), "-n", UNBOUNDED, "-t", str(seconds), "-s", str(seed)]


DRIVERS = {"parse": parse_command, "route": route_command}


def run(name: str, cc: str, seconds: float, seed: int) -> bool:
    """Builds and runs one driver; True when it exited 0 within its bound."""
    env = dict(os.environ, CC=cc, **SANITIZER_ENV)
    # fuzz_parse.py imports spliceway for its seeds: a plain checkout works too.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    start = time.monotonic()
    try:
        cmd = DRIVERS[name](cc, seconds, seed)
        # Building is the rest of the bound: a sanitized compile under load is slow.
        status = subprocess.run(cmd, cwd=ROOT, env=env, timeout=seconds + 240, check=False)
        code: int | str = status.returncode
    except subprocess.CalledProcessError as exc:
        code = f"build failed ({exc.returncode})"
    except subprocess.TimeoutExpired:
        code = "timed out"
    took = time.monotonic() - start
    print(f"fuzz slice: {name} exited {code} after {took:.1f} s", flush=True)
    return code == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20, help="run time per driver (default 20)")
    today = int(datetime.datetime.now(datetime.UTC).strftime("%Y%m%d"))
    ap.add_argument("--seed", type=int, default=today, help="PRNG seed (default: today, UTC)")
    ap.add_argument("--only", choices=sorted(DRIVERS), action="append", help="run just these")
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"))
    args = ap.parse_args()

    names = args.only or list(DRIVERS)
    print(f"fuzz slice: {', '.join(names)}, {args.seconds:g} s each, seed {args.seed}", flush=True)
    failed = [name for name in names if not run(name, args.cc, args.seconds, args.seed)]
    if failed:
        print(f"fuzz slice: FAILED {', '.join(failed)} (seed {args.seed})", flush=True)
        return 1
    print("fuzz slice: all clean", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
