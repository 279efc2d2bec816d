"""Micro benchmark of the C UDP datagram relay (csrc/udp.c) alone: UDP echo round trips
through it against the same echo without it, in the same run.

    python benchmarks/bench_udp_relay.py                    # windows 1 and 16, 64 B, 3 x 3 s
    python benchmarks/bench_udp_relay.py --windows 1,16,64 --size 512 --seconds 5 --reps 5
    python benchmarks/bench_udp_relay.py --loops 2 --json benchmarks/results/udp-relay.json
    python benchmarks/bench_udp_relay.py --pin 0,0,1 --busy-poll-us 100 --also dante=127.0.0.1:1080

No engine: this process is a minimal SOCKS5 control plane around ``spliceway.native.udp``
(a TCP listener answering UDP ASSOCIATE with a fresh association socket, whose one
destination it answers DIRECT to the echo server over one upstream socket), so the
figures are the data plane's.  The load is benchmarks/udpload.c (built with ``cc -O2``
into benchmarks/build/ when its source is newer): ``udpload echo`` is the server,
``udpload client --socks`` the SOCKS5 UDP client (one association per run) and
``udpload client --direct`` the baseline, alternating run by run.  Reported per
window and path: round trips/s (median of the runs), the ratio to direct, latency
p50/p99 (of the median run), datagrams lost, and for the relay its loops' CPU seconds
per million round trips (its threads, sw-udp-N, from /proc).  ``--also`` adds SOCKS5
proxies started by hand (danted, sing-box...) to the same alternation, for a
same-run comparison; ``--pin`` pins the client, the echo server and the relay loops.
Everything binds 127.0.0.1 and stops by itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from spliceway.native.udp import NewDest, UdpRelay

BENCH = Path(__file__).resolve().parent
BUILD = BENCH / "build"
LOOP = "127.0.0.1"


def build(cc: str) -> Path:
    BUILD.mkdir(exist_ok=True)
    exe, src = BUILD / "udpload", BENCH / "udpload.c"
    if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
        cmd = [cc, "-O2", "-Wall", "-Wextra", "-o", str(exe), str(src)]
        print("build: " + " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True)
    return exe


def relay_cpu_seconds() -> float:
    """CPU (user + system) of this process's sw-udp-N threads so far."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            if not Path(f"/proc/self/task/{tid}/comm").read_text().startswith("sw-udp"):
                continue
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


class ControlPlane:
    """A SOCKS5 server that only answers UDP ASSOCIATE, driving a UdpRelay."""

    def __init__(self, relay: UdpRelay, target: tuple[str, int]) -> None:
        self.relay, self.target = relay, target
        self.listener = socket.create_server((LOOP, 0))
        self.port = self.listener.getsockname()[1]
        self.upstreams: dict[int, int] = {}
        self.ended: list[Any] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._accept, daemon=True),
            threading.Thread(target=self._records, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        for t in self._threads:
            t.join(timeout=2)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._session, args=(conn,), daemon=True).start()

    def _session(self, conn: socket.socket) -> None:
        with conn:
            greeting = conn.recv(257)
            if greeting[:1] != b"\x05":
                return
            conn.sendall(b"\x05\x00")
            req = conn.recv(262)  # VER CMD RSV ATYP=1 ADDR(4) PORT: udpload sends IPv4
            if len(req) < 10 or req[1] != 3 or req[3] != 1:
                conn.sendall(b"\x05\x07\x00\x01" + bytes(6))
                return
            client_ip = socket.inet_ntoa(req[4:8])
            client_port = int.from_bytes(req[8:10], "big")
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            udp.bind((LOOP, 0))
            bnd = udp.getsockname()
            if client_ip == "0.0.0.0":
                client_ip = conn.getpeername()[0]
            assoc = self.relay.add_association(udp.detach(), client_ip, client_port, 300)
            conn.sendall(b"\x05\x00\x00\x01" + socket.inet_aton(bnd[0]) + bnd[1].to_bytes(2, "big"))
            with contextlib.suppress(OSError):
                while conn.recv(4096):
                    pass
            self.relay.close_association(assoc)

    def _records(self) -> None:
        while not self._stop.is_set():
            select.select([self.relay.fileno()], [], [], 0.2)
            for rec in self.relay.drain():
                if isinstance(rec, NewDest):
                    up = self.upstreams.get(rec.assoc)
                    if up is None:
                        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                        up = self.upstreams[rec.assoc] = self.relay.add_upstream(
                            rec.assoc, s.detach(), 300
                        )
                    self.relay.set_direct(rec.assoc, rec.dest, up, *self.target)
                else:
                    self.ended.append(rec)


def client_run(exe: Path, args: list[str], seconds: float, pin: list[str]) -> dict[str, Any]:
    out = subprocess.run(
        [*pin, str(exe), "client", *args, "--seconds", str(seconds)],
        capture_output=True, text=True, timeout=seconds + 30, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result.get("error"):
        raise RuntimeError(f"udpload: {result['error']}")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--windows", default="1,16", help="datagrams in flight (default 1,16)")
    ap.add_argument("--size", type=int, default=64, help="payload bytes (default 64)")
    ap.add_argument("--seconds", type=float, default=3.0, help="per run (default 3)")
    ap.add_argument("--reps", type=int, default=3, help="runs per mode and window (default 3)")
    ap.add_argument("--loops", type=int, default=1, help="relay threads (default 1)")
    ap.add_argument("--busy-poll-us", type=int, default=0, help="UdpRelay busy_poll_us")
    ap.add_argument(
        "--pin", metavar="C,E,R",
        help="CPUs for the client, the echo server and the relay loops (e.g. 0,0,1)",
    )  # fmt: skip
    ap.add_argument(
        "--also", action="append", default=[], metavar="NAME=HOST:PORT",
        help="a SOCKS5 proxy already running (e.g. danted) measured in the same runs",
    )  # fmt: skip
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"))
    args = ap.parse_args()
    windows = [int(w) for w in args.windows.split(",")]

    exe = build(args.cc)
    pins = {"client": [], "echo": []}
    if args.pin:
        c, e, r = args.pin.split(",")
        pins = {"client": ["taskset", "-c", c], "echo": ["taskset", "-c", e]}
        # Threads started from now on (the relay loops) inherit this affinity.
        os.sched_setaffinity(0, {int(x) for x in r.split("+")})
    echo = subprocess.Popen(
        [*pins["echo"], str(exe), "echo", "--port", "0", "--bind", LOOP, "--max-seconds", "3600"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    relay = UdpRelay(loops=args.loops, busy_poll_us=args.busy_poll_us)
    plane = None
    try:
        echo_port = json.loads(echo.stdout.readline())["port"]
        plane = ControlPlane(relay, (LOOP, echo_port))
        target = f"{LOOP}:{echo_port}"
        results: dict[int, dict[str, list[dict[str, Any]]]] = {}
        print(f"cpus {os.cpu_count()}, pinned {args.pin or 'no'}, relay loops {args.loops}, "
              f"busy poll {args.busy_poll_us} us, {args.size} B payloads, "
              f"{args.reps} x {args.seconds:g} s per mode and window", flush=True)  # fmt: skip
        others = dict(a.split("=", 1) for a in args.also)
        for window in windows:
            runs: dict[str, list[dict[str, Any]]] = {"direct": [], "relay": []}
            runs.update({name: [] for name in others})
            common = ["--target", target, "--window", str(window), "--size", str(args.size)]
            for _ in range(args.reps):
                direct = client_run(exe, [*common, "--direct"], args.seconds, pins["client"])
                runs["direct"].append(direct)
                cpu0 = relay_cpu_seconds()
                socks = [*common, "--socks", f"{LOOP}:{plane.port}"]
                r = client_run(exe, socks, args.seconds, pins["client"])
                r["relay_cpu_s"] = relay_cpu_seconds() - cpu0
                runs["relay"].append(r)
                for name, addr in others.items():
                    socks = [*common, "--socks", addr]
                    runs[name].append(client_run(exe, socks, args.seconds, pins["client"]))
            results[window] = runs
        report(results)
        st = relay.stats()
        print(f"relay: {st.packets_sent} sent upstream, {st.packets_received} received, "
              f"{st.send_failures + st.client_send_failures} send failures, "
              f"{st.dropped_pending} held and dropped", flush=True)  # fmt: skip
        if args.json:
            args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                             "results": results}, indent=1))  # fmt: skip
    finally:
        if plane:
            plane.close()
        relay.close()
        echo.terminate()
        echo.wait(timeout=10)
    return 0


def report(results: dict[int, dict[str, list[dict[str, Any]]]]) -> None:
    """Per window and path: median rt/s, ratio to direct, the median run's p50/p99."""
    print(f"{'window':>6} {'path':<10} {'rt/s':>10} {'ratio':>6} {'p50 us':>8} {'p99 us':>8} "
          f"{'lost':>5} {'relay cpu s/M rt':>16}")  # fmt: skip
    for window, runs in results.items():
        d_rate = statistics.median(x["rtt_per_s"] for x in runs["direct"])
        for path, rs in runs.items():
            ordered = sorted(rs, key=lambda r: r["rtt_per_s"])
            mid = ordered[len(ordered) // 2]
            rate = statistics.median(x["rtt_per_s"] for x in rs)
            trips = sum(x["received"] for x in rs)
            cpu = ""
            if path == "relay" and trips:
                cpu = f"{sum(x['relay_cpu_s'] for x in rs) / trips * 1e6:.2f}"
            print(
                f"{window:>6} {path:<10} {rate:>10,.0f} {rate / d_rate:>6.2f} "
                f"{mid['lat_us']['p50']:>8.1f} {mid['lat_us']['p99']:>8.1f} "
                f"{sum(x['lost'] for x in rs):>5} {cpu:>16}",
                flush=True,
            )


if __name__ == "__main__":
    sys.exit(main())
