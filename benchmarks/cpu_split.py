"""Where spliceway's CPU per connection goes: per thread, and kernel against user.

Runs the engine (one socks5 inbound to direct), tinyserver and ``loadgen rate`` at
concurrency 64 (100 B request, 1 KiB response, the run_peers workload), and reads
each engine thread's user and system time from ``/proc`` before and after each run.
The threads are the Python dispatcher (records, events, the control plane), the C
connection loop(s) (accept, handshake, route, dial, hand-off) and the C relay
loop(s); the kernel share of the C loops is what TCP on loopback costs whatever
program makes those calls, so it is the floor a proxy built this way can reach.

Run: python benchmarks/cpu_split.py [--runs 3] [--seconds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import run_e2e as e2e

_TICK_US = 1e6 / os.sysconf("SC_CLK_TCK")


def thread_times(pid: int) -> dict[str, tuple[float, float]]:
    """Per thread name (dispatcher, sw-conn-N, sw-relay-N, ...): (user, system) in µs."""
    out: dict[str, tuple[float, float]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        if int(tid) == pid:
            name = "main"
        elif name == "python" or name.startswith("spliceway"):
            name = name if name != "python" else "dispatcher"
        user, system = int(fields[11]) * _TICK_US, int(fields[12]) * _TICK_US
        u0, s0 = out.get(name, (0.0, 0.0))
        out[name] = (u0 + user, s0 + system)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the measurement and print a table; the JSON goes to benchmarks/results/."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--cc", default="cc")
    args = ap.parse_args(argv)
    tools = e2e.build_tools(args.cc)
    e2e.raise_nofile()
    budget = args.runs * (args.seconds + 5) + 60
    server = e2e.Server(tools["tinyserver"], None, budget, 1)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        proxy = e2e.Proxy("spliceway", None, Path(tmp))
        try:
            for _ in range(args.runs):
                before = thread_times(proxy.m.pid)
                cmd = [
                    str(tools["loadgen"]),
                    *e2e.rate_argv(server.rate, proxy.port, 64, args.seconds, 1),
                ]
                res = e2e.run_loadgen(cmd, args.seconds + 30)
                after = thread_times(proxy.m.pid)
                count = res.get("count") or 0
                per = {}
                for name, (u, s) in after.items():
                    u0, s0 = before.get(name, (0.0, 0.0))
                    if count and (u - u0 or s - s0):
                        per[name] = {
                            "user_us": round((u - u0) / count, 1),
                            "sys_us": round((s - s0) / count, 1),
                        }
                runs.append({"count": count, "conn_per_s": res.get("conn_per_s"), "threads": per})
        finally:
            proxy.m.stop(10)
            server.stop()
    names = sorted({n for r in runs for n in r["threads"]})
    print(f"{'thread':<14}{'user us/conn':>14}{'sys us/conn':>13}{'total':>9}   (median of runs)")
    grand = 0.0
    for name in names:
        u = statistics.median(r["threads"].get(name, {}).get("user_us", 0.0) for r in runs)
        s = statistics.median(r["threads"].get(name, {}).get("sys_us", 0.0) for r in runs)
        grand += u + s
        print(f"{name:<14}{u:>14.1f}{s:>13.1f}{u + s:>9.1f}")
    print(f"{'all':<14}{'':>14}{'':>13}{grand:>9.1f}")
    print("conn/s per run:", ", ".join(f"{r['conn_per_s']:.0f}" for r in runs))
    out = e2e.ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "cpu_split.json"
    path.write_text(json.dumps({"runs": runs}, indent=1))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
