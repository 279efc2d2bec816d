#!/usr/bin/env python3
"""What ``runtime.process_lookup`` costs: the lookup itself, and per flow through the engine.

    python benchmarks/bench_process_lookup.py [--quick] [--reps 3] [--seconds 3] [--conc 1,16]

**Part 1, the lookup alone** (in this process, spliceway.routing.process_lookup): lookups per
second of

- ``sock_diag exact``: one netlink ``inet_diag_req_v2`` round trip for a live socket;
- ``cached socket``: a socket looked up before (sock_diag, then one readlink to check
  the cached inode -> pid/fd, then the executable's readlink);
- ``new socket, known pid``: a fresh connection of a process that owned a socket looked
  up before (its descriptors are walked first): what a long-lived client (a browser, or
  loadgen below) costs per new connection;
- ``new process``: a fresh child process's connection (a full /proc walk, newest pid
  first, that finds it early): what a one-shot client (curl) costs;
- ``full /proc walk``: an inode nobody holds (every process of the user walked): the
  worst case, which grows with the number of processes (printed).

**Part 2, per flow through the engine**: engines side by side on 127.0.0.1 (one
``socks5`` inbound, ``direct``, as run_e2e.py starts them), loadgen ``rate`` through each
to tinyserver (100 B request, 1 KiB response), interleaved (a b c d e, e d c b a, ...):

- **none**: ``auto`` and no ``process_name`` rule: the C path, no lookup (the default).
- **python-path**: no lookup, but a first rule C cannot check (``domain_regex`` that
  never matches): what the deferral to Python alone costs, for comparison.
- **rule**: a first ``process_name`` rule that never matches: every flow (loopback
  client) waits for its lookup in Python, then is routed and dialled there.
- **rule-later**: a first rule (the server's port) routes every flow in C, then a
  ``process_name`` rule: C relays at once, the lookup runs beside it for the record.
- **always**: ``always`` and no rule: every local flow is looked up before routing.

Per run: conn/s, p50/p99 latency per connection, and the engine's CPU per connection
(utime + stime from /proc, the lookup thread included). Output: tables on stdout,
progress on stderr, every run in benchmarks/results/<timestamp>-process-lookup.json.
Bounded: each run stops at its duration, killed after 60 s; the default run takes about
2 minutes (``--quick``: about 25 s).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_e2e as e2e

sys.path.insert(0, str(e2e.ROOT))
from spliceway.routing.process_lookup import ProcessLookup, ProcTable, SockDiag

VARIANTS = ("none", "python-path", "rule", "rule-later", "always")
#: A rule C cannot check: reaching it defers every flow to Python (no lookup).
NEVER_REGEX = {"domain_regex": ["^never\\.invalid$"], "outbound": "direct"}
#: A process_name rule that never matches (no process is called that).
NEVER_PROCESS = {"process_name": ["no-such-process"], "action": "block"}


# -- part 1 ----------------------------------------------------------------------------


def _rate(fn: Callable[[], object], seconds: float) -> tuple[float, float]:
    """Calls per second of ``fn`` over about ``seconds``, and microseconds per call."""
    n, start = 0, time.perf_counter()
    deadline = start + seconds
    while True:
        fn()
        n += 1
        if n % 16 == 0 and time.perf_counter() >= deadline:
            break
    elapsed = time.perf_counter() - start
    return n / elapsed, elapsed / n * 1e6


def _pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    return client, accepted


def micro(seconds: float) -> dict[str, Any]:
    """Part 1: the lookup alone."""
    out: dict[str, Any] = {"processes": sum(n.isdigit() for n in os.listdir("/proc"))}
    listener = socket.create_server(("127.0.0.1", 0), backlog=512)
    server = listener.getsockname()
    lookup = ProcessLookup()
    diag = SockDiag()
    client, accepted = _pair(listener)
    peer = accepted.getpeername()
    tcp = socket.IPPROTO_TCP

    def exact() -> object:
        return diag.lookup(4, tcp, peer, server)

    out["sock_diag exact"] = _rate(exact, seconds)
    assert lookup.find(tcp, peer, server) is not None
    out["cached socket"] = _rate(lambda: lookup.find(tcp, peer, server), seconds)

    # New connections of this (known) process: each is found in its own descriptors.
    def new_socket() -> object:
        c, a = _pair(listener)
        try:
            return lookup.find(tcp, a.getpeername(), server)
        finally:
            c.close()
            a.close()

    # The connection's own cost (two sockets, accept, close) is measured and removed.
    def bare() -> None:
        c, a = _pair(listener)
        c.close()
        a.close()

    base = _rate(bare, seconds)[1]
    us = _rate(new_socket, seconds)[1]
    out["new socket, known pid"] = (1e6 / (us - base), us - base)

    # New processes: children that connect and wait; each is looked up once.
    script = (
        "import socket, sys; s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); "
        "sys.stdin.read()"
    )
    children = []
    times = []
    deadline = time.monotonic() + max(seconds, 1.0)
    while time.monotonic() < deadline and len(times) < 200:
        child = subprocess.Popen(
            [sys.executable, "-c", script, server[0], str(server[1])], stdin=subprocess.PIPE
        )
        children.append(child)
        a, peer2 = listener.accept()
        t0 = time.perf_counter()
        found = lookup.find(tcp, peer2, server)
        times.append(time.perf_counter() - t0)
        assert found is not None and found.pid == child.pid, (found, child.pid)
        a.close()
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    us = statistics.median(times) * 1e6
    out["new process"] = (1e6 / us, us)

    table = ProcTable()
    out["full /proc walk"] = _rate(lambda: table.find(2**32 - 7, None), seconds)
    client.close()
    accepted.close()
    diag.close()
    lookup.close()
    listener.close()
    return out


# -- part 2 ----------------------------------------------------------------------------


def engine_config(variant: str, server_port: int) -> dict[str, Any]:
    """The engine of ``variant``: run_e2e's, plus its rules and mode."""
    cfg = json.loads(json.dumps(e2e.SPLICEWAY_CONFIG))
    runtime: dict[str, Any] = {"stats_interval_ms": 60_000}
    if variant == "python-path":
        cfg["rules"] = [NEVER_REGEX]
    elif variant == "rule":
        cfg["rules"] = [NEVER_PROCESS]
    elif variant == "rule-later":
        cfg["rules"] = [{"port": str(server_port), "outbound": "direct"}, NEVER_PROCESS]
    elif variant == "always":
        runtime["process_lookup"] = "always"
    cfg["runtime"] = runtime
    return cfg


#: One engine as its own process, and its socks5 port.
Engine = e2e.EngineProcess


def run(loadgen: Path, target: int, engine: Engine, conc: int, seconds: float) -> dict:
    """One recorded loadgen rate run through ``engine``, with CPU per connection."""
    cpu0 = engine.cpu()
    argv = [*e2e.rate_argv(target, engine.port, conc, seconds, 1), "--warmup", "0.5"]
    res = e2e.run_loadgen([str(loadgen), *argv], timeout=seconds + 60)
    total = res["count"] + res.get("warmup_count", 0)
    res["engine_cpu_us"] = (engine.cpu() - cpu0) * 1e6 / max(total, 1)
    return res


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over the runs of one variant and concurrency."""
    return e2e.flow_medians(runs)


def report(results: dict[str, Any]) -> str:
    """The two tables."""
    m = results["micro"]
    lines = [
        f"process lookup alone ({m['processes']} processes in /proc, "
        f"{results['meta']['nproc']} CPUs)",
        "",
        f"{'case':<24} {'lookups/s':>10} {'us/lookup':>10}",
    ]
    for case in (
        "sock_diag exact",
        "cached socket",
        "new socket, known pid",
        "new process",
        "full /proc walk",
    ):
        rate, us = m[case]
        lines.append(f"{case:<24} {rate:10.0f} {us:10.1f}")
    lines += [
        "",
        f"per flow through the engine ({results['meta']['reps']} runs of "
        f"{results['meta']['seconds']} s each, medians)",
        "",
        f"{'conc':>4}  {'variant':<12} {'conn/s':>8} {'p50 us':>8} {'p99 us':>8} "
        f"{'engine CPU us/conn':>19}",
    ]
    for conc, by in results["summary"].items():
        for variant in VARIANTS:
            s = by[variant]
            lines.append(
                f"{conc:>4}  {variant:<12} {s['conn_per_s']:8.0f} {s['p50_us']:8.0f} "
                f"{s['p99_us']:8.0f} {s['engine_cpu_us']:19.1f}"
            )
        none, py, rule, later = by["none"], by["python-path"], by["rule"], by["rule-later"]
        lines.append(
            f"      rule vs none: p50 {rule['p50_us'] - none['p50_us']:+.0f} us, CPU "
            f"{rule['engine_cpu_us'] - none['engine_cpu_us']:+.1f} us/conn (of which the "
            f"lookup, rule vs python-path: p50 {rule['p50_us'] - py['p50_us']:+.0f} us, CPU "
            f"{rule['engine_cpu_us'] - py['engine_cpu_us']:+.1f}); rule-later vs none: p50 "
            f"{later['p50_us'] - none['p50_us']:+.0f} us, CPU "
            f"{later['engine_cpu_us'] - none['engine_cpu_us']:+.1f} us/conn"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    e2e.add_run_options(ap, reps=3)
    a = ap.parse_args(argv)
    if a.quick:
        a.reps, a.seconds = 1, 2.0
    concs = [int(x) for x in a.conc.split(",")]
    results: dict[str, Any] = {"runs": [], "summary": {}}
    e2e.log("part 1: the lookup alone")
    results["micro"] = micro(min(a.seconds, 2.0))
    tools = e2e.build_tools(a.cc)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    e2e.RESULTS.mkdir(exist_ok=True)
    out = e2e.RESULTS / f"{stamp}-process-lookup.logs"
    out.mkdir()
    tmp = Path(tempfile.mkdtemp(prefix="swpl-", dir="/tmp"))
    server = e2e.Server(tools["tinyserver"], None, 900, 1)
    engines: dict[str, Engine] = {}
    try:
        for variant in VARIANTS:
            engines[variant] = Engine(variant, engine_config(variant, server.rate), tmp, out)
        for variant, engine in engines.items():
            e2e.log(f"warm-up {variant}")
            run(tools["loadgen"], server.rate, engine, 4, 1.0)
        order = list(VARIANTS)
        for conc in concs:
            for rep in range(a.reps):
                for variant in order:
                    res = run(tools["loadgen"], server.rate, engines[variant], conc, a.seconds)
                    res.update(variant=variant, conc=conc, rep=rep)
                    results["runs"].append(res)
                    e2e.log(
                        f"conc {conc} rep {rep} {variant}: {res['conn_per_s']:.0f} conn/s, "
                        f"p50 {res['lat_us']['p50']:.0f} us, CPU {res['engine_cpu_us']:.0f} us"
                    )
                order.reverse()
            results["summary"][conc] = {
                v: summary([r for r in results["runs"] if r["conc"] == conc and r["variant"] == v])
                for v in VARIANTS
            }
    finally:
        results["engines"] = {v: e.stop() for v, e in engines.items()}
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    results["meta"] = {
        "nproc": os.cpu_count(),
        "reps": a.reps,
        "seconds": a.seconds,
        "concurrency": concs,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "loadavg_end": os.getloadavg(),
        "git": e2e.git_head(),
    }
    path = e2e.RESULTS / f"{stamp}-process-lookup.json"
    path.write_text(json.dumps(results, indent=1, default=str))
    print(report(results))
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
