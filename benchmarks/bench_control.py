#!/usr/bin/env python3
"""Control-plane benchmark: SSE event latency and the data plane's cost of control traffic.

    python benchmarks/bench_control.py [--quick]

The engine runs as its own process (``python -m spliceway run -c <tmp config>``)
with a socks5 inbound and the HTTP control API; loadgen/tinyserver (C), every
SSE reader and every stats client are separate processes too, so none of them
shares the engine's GIL.  Measured:

1. SSE latency: 5 concurrent ``GET /api/v1/events/stream`` readers while
   loadgen paces 1,000 flows/s through the socks5 inbound; latency of an event
   = its arrival at the reader (``time.time()`` right after ``recv()``) minus
   ``occurred_at_unix_ms``; every stream is checked for gaps, duplicates and a
   ``flow.completed`` for every flow the engine started.
2. Data-plane conn/s (loadgen rate, concurrency 64) without control traffic (a)
   and with 5 SSE streams open plus 50 ``GET /api/v1/stats``/s (b), interleaved
   a, b, b, a, ...; the stats requests' latency.
3. ``GET /api/v1/stats`` closed loop from 4 keep-alive connections (the API's
   100 queries/s limit applies; 429s are counted, not hidden).

Prints a table and writes benchmarks/results/<timestamp>-control.json.  Every
server listens on 127.0.0.1; every loop is bounded in count and time; only
processes this script started are stopped, by pid.  See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import http.client
import itertools
import json
import os
import re
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import run_e2e as e2e  # noqa: E402  (shared tooling: build, tinyserver, engine launch, /proc)
from run_e2e import log  # noqa: E402

API = "/api/v1"
STREAM_PATH = f"{API}/events/stream"
SSE_STREAMS = 5
QUERY_LIMIT_PER_S = 100  # api/limits.py Limits.queries_per_second (burst = rate)
TARGET_SSE_P99_MS = 20.0
TARGET_DROP_PCT = 10.0
CONTROL_RE = re.compile(r"control API listening on http://([0-9.]+):(\d+)/")


def pct(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile of ``values`` (any order); None when empty."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]


def summary_ms(values: list[float]) -> dict:
    return {
        "n": len(values),
        "p50": _r(pct(values, 0.5)),
        "p99": _r(pct(values, 0.99)),
        "max": _r(max(values) if values else None),
        "mean": _r(statistics.fmean(values) if values else None),
    }


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


# =========================================================================== child: SSE reader


def sse_reader_main(argv: list[str]) -> int:
    """One SSE stream: connect, print ``ready``, record (arrival time, bytes) until stdin
    closes or --max-seconds pass, then parse the frames and write them to --out."""
    ap = argparse.ArgumentParser(prog="bench_control.py _sse")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--types", default="")
    ap.add_argument("--max-seconds", type=float, default=120.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    path = STREAM_PATH + (f"?types={a.types}" if a.types else "")
    # HTTP/1.0: the body is close-delimited, so no chunked framing to undo.
    request = (
        f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{a.port}\r\nAccept: text/event-stream\r\n\r\n"
    )
    sock = None
    head = b""
    status = 0
    retries_429 = 0
    for _ in range(60):  # a slot of a just-closed stream comes back within ~0.25 s
        sock = socket.create_connection(("127.0.0.1", a.port), timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(request.encode())
        head = b""
        while b"\r\n\r\n" not in head and len(head) < 65536:
            data = sock.recv(65536)
            if not data:
                break
            head += data
        status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
        if status != 429:
            break
        retries_429 += 1
        sock.close()
        time.sleep(0.25)
    assert sock is not None
    t_first = time.time()
    header, _, rest = head.partition(b"\r\n\r\n")
    print(f"ready {status}", flush=True)
    chunks: list[tuple[float, bytes]] = [(t_first, rest)] if rest else []
    closed_by_server = False
    sock.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, "sock")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
    buf = bytearray(1 << 18)
    view = memoryview(buf)
    recvs = 0
    end = time.monotonic() + a.max_seconds
    stop = status != 200
    while not stop:
        left = end - time.monotonic()
        if left <= 0:
            break
        for key, _ in sel.select(min(left, 1.0)):
            if key.data == "stdin":
                stop = True
                break
            try:
                n = sock.recv_into(buf)
            except BlockingIOError:
                continue
            except OSError:
                n = 0
            t = time.time()  # the arrival time of every frame this read completes
            if n == 0:
                closed_by_server = True
                stop = True
                break
            chunks.append((t, bytes(view[:n])))
            recvs += 1
    ru = resource.getrusage(resource.RUSAGE_SELF)
    cpu_at_stop = ru.ru_utime + ru.ru_stime
    sock.close()
    # Parse after the measurement: the reader did nothing but recv() while it mattered.
    events = []  # [sequence, event_type, occurred_at_unix_ms, arrival_unix_ms]
    comments = collections.Counter()
    pending = b""
    bad = 0
    for t, data in chunks:
        pending += data
        *frames, pending = pending.split(b"\n\n")
        for frame in frames:
            fields: dict[str, str] = {}
            for line in frame.split(b"\n"):
                if line.startswith(b":"):
                    comments[line[1:].strip().decode(errors="replace")[:60]] += 1
                    continue
                k, _, v = line.partition(b":")
                fields[k.decode()] = v[1:].decode() if v.startswith(b" ") else v.decode()
            if "data" not in fields:
                continue
            try:
                env = json.loads(fields["data"])
                events.append(
                    [env["sequence"], env["event_type"], env["occurred_at_unix_ms"], t * 1000.0]
                )
            except (ValueError, KeyError):
                bad += 1
    out = {
        "status": status,
        "retries_429": retries_429,
        "header": header.decode(errors="replace"),
        "closed_by_server": closed_by_server,
        "recvs": recvs,
        "bytes": sum(len(d) for _, d in chunks),
        "cpu_s": round(cpu_at_stop, 3),
        "comments": dict(comments),
        "unparsed_frames": bad,
        "trailing_bytes": len(pending),
        "events": events,
    }
    Path(a.out).write_text(json.dumps(out))
    return 0


# =========================================================================== child: stats client


def stats_client_main(argv: list[str]) -> int:
    """GET /api/v1/stats on one keep-alive connection, paced (--rate) or closed loop."""
    ap = argparse.ArgumentParser(prog="bench_control.py _stats")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--rate", type=float, default=0.0, help="requests/s; 0 = closed loop")
    ap.add_argument("--duration", type=float, required=True)
    ap.add_argument("--start-at", type=float, required=True, help="time.time() to begin at")
    a = ap.parse_args(argv)
    duration = min(a.duration, 300.0)
    cap = int(a.rate * duration) + 1 if a.rate > 0 else 1_000_000

    def connect() -> http.client.HTTPConnection:
        c = http.client.HTTPConnection("127.0.0.1", a.port, timeout=5)
        c.connect()
        c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return c

    conn = connect()
    reconnects = errors = late = not_ok_body = 0
    recs: list[tuple[float, int]] = []  # (latency ms, HTTP status)
    delay = a.start_at - time.time()
    if delay > 0:
        time.sleep(min(delay, 30.0))
    t0 = time.perf_counter()
    end = t0 + duration
    i = 0
    while i < cap:
        now = time.perf_counter()
        if now >= end:
            break
        if a.rate > 0:
            due = t0 + i / a.rate
            if due > now:
                time.sleep(due - now)
            elif now - due > 0.005:
                late += 1  # the previous request ran past this one's slot
        i += 1
        s = time.perf_counter()
        try:
            conn.request("GET", f"{API}/stats")
            resp = conn.getresponse()
            body = resp.read()
        except (OSError, http.client.HTTPException):
            errors += 1
            conn.close()
            with contextlib.suppress(OSError):
                conn = connect()
                reconnects += 1
            continue
        e = time.perf_counter()
        if resp.status == 200 and b'"ok":true' not in body:
            not_ok_body += 1
        recs.append((round((e - s) * 1000.0, 4), resp.status))
        if resp.will_close:
            conn.close()
            conn = connect()
            reconnects += 1
    elapsed = time.perf_counter() - t0
    conn.close()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(
        json.dumps(
            {
                "rate": a.rate,
                "elapsed_s": round(elapsed, 3),
                "records": recs,
                "errors": errors,
                "reconnects": reconnects,
                "late": late,
                "not_ok_body": not_ok_body,
                "cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
            }
        )
    )
    return 0


# =========================================================================== runner side


def control_api() -> dict:
    """``api.control`` on 127.0.0.1 with an OS-chosen port (read from the log), no key."""
    return {"enabled": True, "listen": {"address": "127.0.0.1", "port": 0}, "api_key_env": None}


class Engine:
    """``python -m spliceway run -c CFG`` with a socks5 inbound and the control API."""

    idle_timeout_s = 10.0  # wait_idle's bound
    stop_timeout_s = 10.0

    def __init__(self, name: str, config: dict, tmp: Path, log_path: Path) -> None:
        self.name, self.config, self.log_path = name, config, log_path
        self.m, self.launch = e2e.start_spliceway(config, tmp / f"{name}.json", log_path)
        # The CLI logs the inbound's line, then the control API's: wait for the second.
        m2 = self.m.wait_for(CONTROL_RE, 30)
        m1 = next(filter(None, map(e2e.LISTEN_RE.search, list(self.m.lines))), None)
        if m1 is None or m2 is None or not self.m.alive():
            refusal = [x for x in self.m.lines if "cannot run" in x or "unsupported" in x]
            if refusal:
                self.m.stop(3)
                raise SystemExit(f"{name}: the engine refused the config: {refusal[0]}")
            self.m.abort(f"{name}: spliceway did not report its socks5 and control ports")
        self.socks_port = int(m1.group(2))
        self.api_port = int(m2.group(2))
        self.pid = self.m.pid
        self.cmd = self.m.cmd

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, dict | None]:
        c = http.client.HTTPConnection("127.0.0.1", self.api_port, timeout=timeout)
        try:
            c.request("GET", path)
            r = c.getresponse()
            body = r.read()
        finally:
            c.close()
        try:
            return r.status, json.loads(body)
        except ValueError:
            return r.status, None

    def stats(self, tries: int = 20) -> dict:
        """``GET /api/v1/stats`` result, retried (bounded) past a 429."""
        for _ in range(tries):
            status, body = self.get(f"{API}/stats")
            if status == 200 and body and body.get("ok"):
                return body["result"]
            time.sleep(0.2)
        raise SystemExit(f"GET {API}/stats kept failing (last status {status})")

    def wait_idle(self) -> dict:
        """Stats once no flow is active (or after ``idle_timeout_s``)."""
        end = time.monotonic() + self.idle_timeout_s
        st = self.stats()
        while st.get("active_sessions") and time.monotonic() < end:
            time.sleep(0.2)
            st = self.stats()
        return st

    def stop(self) -> dict:
        info = self.m.stop(self.stop_timeout_s)
        info.update(
            self.m.stderr_report(),
            warnings=[x for x in self.m.lines if " WARNING " in x][:10],
            warning_count=sum(1 for x in self.m.lines if " WARNING " in x),
            log=str(self.log_path),
        )
        return info


class Bench:
    def __init__(self, args: argparse.Namespace, tools: dict[str, Path], tmp: Path) -> None:
        self.args = args
        self.tools = tools
        self.tmp = tmp
        self.kids = e2e.Children()
        self.server: e2e.Server | None = None
        self.engine: Engine | None = None
        self.quiet = e2e.QuietWait(args, self.our_cpu)
        self._n = 0

    # ------------------------------------------------------------------ helpers

    def loadgen(self, argv: list[str], timeout: float) -> dict:
        cmd = [str(self.tools["loadgen"]), *argv]
        p = self.kids.start(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as ex:
            raise SystemExit(f"loadgen exceeded {timeout:.0f}s: {cmd}") from ex
        finally:
            e2e.stop_child(p)
        return e2e.loadgen_result(cmd, p.returncode, out, err)

    def rate_argv(self, conc: int, duration: float, threads: int, rate: float = 0) -> list[str]:
        assert self.server is not None and self.engine is not None
        argv = e2e.rate_argv(self.server.rate, self.engine.socks_port, conc, duration, threads)
        return [*argv, "--rate", str(rate)] if rate else argv

    def client_cmd(self, mode: str, *argv: str) -> list[str]:
        """This script as one of its client processes (``_sse`` or ``_stats``) of the API."""
        assert self.engine is not None
        return [
            sys.executable,
            str(Path(__file__).resolve()),
            mode,
            "--port",
            str(self.engine.api_port),
            *argv,
        ]

    def start_readers(
        self, n: int, types: str, max_s: float
    ) -> list[tuple[subprocess.Popen, Path]]:
        assert self.engine is not None
        readers = []
        for _ in range(n):
            self._n += 1
            out = self.tmp / f"sse-{self._n}.json"
            cmd = self.client_cmd("_sse", "--max-seconds", str(max_s), "--out", str(out))
            if types:
                cmd += ["--types", types]
            p = self.kids.start(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            readers.append((p, out))
        for p, _ in readers:
            line = e2e.read_line(p, 30)
            if line != "ready 200":
                raise SystemExit(f"SSE reader did not open its stream: {line!r}")
        return readers

    def finish_readers(self, readers: list[tuple[subprocess.Popen, Path]]) -> list[dict]:
        for p, _ in readers:
            with contextlib.suppress(OSError):
                p.stdin.close()  # EOF: stop reading
        results = []
        for p, out in readers:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                e2e.stop_child(p)
            results.append(json.loads(out.read_text()) if out.exists() else {"missing": True})
        return results

    def start_stats_clients(
        self, n: int, rate: float, duration: float, start_at: float
    ) -> list[subprocess.Popen]:
        argv = ["--rate", str(rate), "--duration", str(duration), "--start-at", repr(start_at)]
        cmd = self.client_cmd("_stats", *argv)
        return [
            self.kids.start(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(n)
        ]

    def finish_stats_clients(self, procs: list[subprocess.Popen], timeout: float) -> list[dict]:
        out = []
        for p in procs:
            try:
                stdout, stderr = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                e2e.stop_child(p)
                stdout, stderr = p.communicate()
            if p.returncode != 0 or not stdout.strip():
                raise SystemExit(f"stats client failed ({p.returncode}):\n{stderr}")
            out.append(json.loads(stdout.strip().splitlines()[-1]))
        return out

    def our_pids(self, extra: list[int]) -> set[int]:
        """The runner, engine, tinyserver, the given helpers and every loadgen started."""
        return {os.getpid(), self.engine.pid, self.server.pid, *extra} | {
            p.pid for p in self.kids.procs
        }

    def our_cpu(self, extra_pids: tuple[int, ...] | list[int] = ()) -> float:
        t = os.times()
        return t.user + t.system + e2e.pids_cpu_s([self.engine.pid, self.server.pid, *extra_pids])

    def wait_quiet(self) -> tuple[float, float]:
        """Wait (bounded) until other processes use < --quiet-threshold of the CPUs."""
        waited, frac = self.quiet()
        return round(waited, 2), round(frac, 3)

    def watched_loadgen(
        self, argv: list[str], timeout: float, pids: list[int]
    ) -> tuple[dict, dict]:
        """One loadgen run, and what it cost: wall time, the engine's CPU, the CPU of processes
        that are not ours (``pids``: our helpers running alongside) and the biggest CPU users."""
        eng = self.engine
        m0, k0, c0 = e2e.machine_cpu()[0], e2e.kernel_threads_cpu(), self.our_cpu(pids)
        e0, pt0 = e2e.proc_cpu_s(eng.pid), e2e.proc_table()
        t0 = time.monotonic()
        lg = self.loadgen(argv, timeout)
        wall = time.monotonic() - t0
        e1, pt1 = e2e.proc_cpu_s(eng.pid), e2e.proc_table()
        m1, k1, c1 = e2e.machine_cpu()[0], e2e.kernel_threads_cpu(), self.our_cpu(pids)
        return lg, {
            "wall": wall,
            "engine_cpu_s": e1 - e0,
            "other_cpu_s": max(0.0, (m1 - m0) - (c1 - c0) - lg["cpu_s"] - (k1 - k0)),
            "top_cpu": e2e.top_cpu(pt0, pt1, self.our_pids(pids)),
        }

    # ------------------------------------------------------------------ 1. SSE latency

    def sse_latency(self) -> dict:
        a = self.args
        eng = self.engine
        rate, secs = a.sse_rate, a.sse_seconds
        waited, other_before = self.wait_quiet()
        readers = self.start_readers(SSE_STREAMS, a.sse_types, secs + 60)
        before = eng.wait_idle()
        pids = [p.pid for p, _ in readers]
        lg, cost = self.watched_loadgen(self.rate_argv(256, secs, 1, rate), secs + 30, pids)
        after = eng.wait_idle()
        time.sleep(1.5)  # the last events (and one stats.sampled) reach every stream
        streams = self.finish_readers(readers)
        other = cost["other_cpu_s"]
        started = after["total_started"] - before["total_started"]
        res = {
            "rate_target": rate,
            "seconds": secs,
            "types": a.sse_types or "*",
            "loadgen": lg,
            "engine_started": started,
            "engine_completed": after["completed_sessions"] - before["completed_sessions"],
            "engine_failed": after["failed_sessions"] - before["failed_sessions"],
            "engine_flows_per_s": round(started / lg["seconds"], 1) if lg["seconds"] else None,
            "engine_cpu_s": round(cost["engine_cpu_s"], 3),
            "other_cpu_s": round(other, 3),
            "top_cpu": cost["top_cpu"],
            "quiet_wait_s": waited,
            "other_share_before": other_before,
        }
        res.update(analyse_streams(streams, started, filtered=bool(a.sse_types)))
        res["disturbed"] = e2e.others_busy(other, lg["seconds"])
        return res

    # ------------------------------------------------------------ 2. conn/s under control load

    def load_run(self, kind: str, secs: float) -> dict:
        """One loadgen run; ``kind`` says what control traffic runs alongside it:
        a = none, b = 5 SSE streams (every type) + paced stats, b-sse / b-stats = one of them."""
        a = self.args
        eng = self.engine
        with_sse, with_stats = kind in ("b", "b-sse"), kind in ("b", "b-stats")
        waited, other_before = self.wait_quiet()
        readers: list[tuple[subprocess.Popen, Path]] = []
        stats_procs: list[subprocess.Popen] = []
        before = eng.wait_idle()
        if with_sse:
            readers = self.start_readers(SSE_STREAMS, "", secs + 60)
        if with_stats:
            start_at = time.time() + 1.0  # the client's interpreter is up by then
            stats_procs = self.start_stats_clients(1, a.stats_rate, secs, start_at)
            time.sleep(max(0.0, start_at - time.time()))
        pids = [p.pid for p, _ in readers] + [p.pid for p in stats_procs]
        argv = self.rate_argv(64, secs, a.loadgen_threads)
        lg, cost = self.watched_loadgen(argv, secs + 30, pids)
        wall, eng_cpu = cost["wall"], cost["engine_cpu_s"]
        res: dict = {
            "kind": kind,
            "loadgen": lg,
            "conn_per_s": lg["conn_per_s"],
            "wall_s": round(wall, 3),
            "engine_cpu_s": round(eng_cpu, 3),
            "engine_cpu_us_per_flow": round(1e6 * eng_cpu / lg["count"], 1)
            if lg["count"]
            else None,
            "quiet_wait_s": waited,
            "other_share_before": other_before,
        }
        if with_stats:
            clients = self.finish_stats_clients(stats_procs, secs + 30)
            recs = [r for c in clients for r in c["records"]]
            res["stats_client"] = {
                "requests": len(recs),
                "status": dict(collections.Counter(str(s) for _, s in recs)),
                "latency_ms": summary_ms([ms for ms, s in recs if s == 200]),
                "latency_all_ms": summary_ms([ms for ms, _ in recs]),
                "achieved_per_s": round(len(recs) / clients[0]["elapsed_s"], 1)
                if clients[0]["elapsed_s"]
                else None,
                **{k: sum(c[k] for c in clients) for k in ("errors", "late", "not_ok_body")},
                "cpu_s": round(sum(c["cpu_s"] for c in clients), 3),
            }
        if with_sse:
            after = eng.wait_idle()
            time.sleep(1.5)
            streams = self.finish_readers(readers)
            started = after["total_started"] - before["total_started"]
            res["sse"] = analyse_streams(streams, started)
        other = cost["other_cpu_s"]
        res["other_cpu_s"] = round(other, 3)
        res["top_cpu"] = cost["top_cpu"]
        res["disturbed"] = e2e.others_busy(other, wall)
        time.sleep(1.0)  # let the server release the stream slots and the query bucket refill
        return res

    def under_load(self) -> dict:
        a = self.args
        secs = a.load_seconds
        # warm-up (not recorded): the proxy's code paths, the relay's pools
        w = self.loadgen(self.rate_argv(16, 1.0, a.loadgen_threads), 40)
        log(f"  warm-up via proxy: {w['conn_per_s']:.0f} conn/s")
        plan = [k for rep in range(a.reps) for k in (("a", "b") if rep % 2 == 0 else ("b", "a"))]
        if a.breakdown:
            plan += ["b-sse", "b-stats"]
        runs = []
        for kind in plan:
            r = self.load_run(kind, secs)
            runs.append(r)
            lat = r["loadgen"]["lat_us"]
            line = (
                f"  ({kind}) {r['conn_per_s']:8.0f} conn/s  p50={lat['p50']:.0f}us"
                f" p99={lat['p99']:.0f}us  engine_cpu={r['engine_cpu_s']:.2f}s"
                f" ({r['engine_cpu_us_per_flow']} us/flow) other_cpu={r['other_cpu_s']:.2f}s"
            )
            if "stats_client" in r:
                sc = r["stats_client"]
                line += (
                    f"  stats p50={sc['latency_ms']['p50']}ms p99={sc['latency_ms']['p99']}ms"
                    f" status={sc['status']}"
                )
            if "sse" in r:
                line += (
                    f"  sse p99={r['sse']['all']['p99']}ms closed_early={r['sse']['closed_early']}"
                )
            log(line + ("  (disturbed)" if r["disturbed"] else ""))
        out: dict = {
            "seconds": secs,
            "conc": 64,
            "loadgen_threads": a.loadgen_threads,
            "runs": runs,
        }
        for kind in dict.fromkeys(plan):
            rs = [r for r in runs if r["kind"] == kind]
            clean = e2e.undisturbed(rs)
            vals = [r["conn_per_s"] for r in clean]
            out[kind] = {
                "median_conn_per_s": round(statistics.median(vals), 1),
                "best_conn_per_s": round(max(vals), 1),
                "runs_used": len(clean),
                "runs": len(rs),
            }
        ma, mb = out["a"]["median_conn_per_s"], out["b"]["median_conn_per_s"]
        ba, bb = out["a"]["best_conn_per_s"], out["b"]["best_conn_per_s"]
        out["drop_pct_median"] = round(100.0 * (1 - mb / ma), 1) if ma else None
        out["drop_pct_best"] = round(100.0 * (1 - bb / ba), 1) if ba else None
        for kind in ("b-sse", "b-stats"):
            if kind in out and ma:
                out[kind]["drop_pct_median"] = round(
                    100.0 * (1 - out[kind]["median_conn_per_s"] / ma), 1
                )
        return out

    # ------------------------------------------------------------------ 3. closed-loop stats

    def stats_closed(self) -> dict:
        a = self.args
        secs = a.closed_seconds
        waited, _ = self.wait_quiet()
        time.sleep(1.2)  # a full query bucket (burst 100) at the start, stated in the report
        start_at = time.time() + 1.0
        procs = self.start_stats_clients(a.closed_conns, 0.0, secs, start_at)
        clients = self.finish_stats_clients(procs, secs + 40)
        recs = [r for c in clients for r in c["records"]]
        elapsed = max(c["elapsed_s"] for c in clients)
        ok = [ms for ms, s in recs if s == 200]
        limited = [ms for ms, s in recs if s == 429]
        return {
            "connections": a.closed_conns,
            "seconds": secs,
            "elapsed_s": elapsed,
            "requests": len(recs),
            "requests_per_s": round(len(recs) / elapsed, 1) if elapsed else None,
            "ok": len(ok),
            "ok_per_s": round(len(ok) / elapsed, 1) if elapsed else None,
            "ok_per_s_after_burst": round((len(ok) - QUERY_LIMIT_PER_S) / elapsed, 1)
            if elapsed
            else None,
            "status": dict(collections.Counter(str(s) for _, s in recs)),
            "ok_latency_ms": summary_ms(ok),
            "limited_latency_ms": summary_ms(limited),
            "all_latency_ms": summary_ms([ms for ms, _ in recs]),
            "errors": sum(c["errors"] for c in clients),
            "client_cpu_s": round(sum(c["cpu_s"] for c in clients), 3),
            "quiet_wait_s": waited,
        }


def analyse_streams(streams: list[dict], started: int, filtered: bool = False) -> dict:
    """Latency per stream and overall; gaps/duplicates; flow.completed on every stream.

    With every event type a stream's sequences after its flow.snapshot watermark
    must be contiguous (``gaps``).  With a ``types`` filter only the cross-stream
    checks apply: every stream has every sequence any stream has in the window all
    of them were open, and every flow.completed.
    """
    per = []
    all_lat: list[float] = []
    completed_sets = []
    seq_sets = []
    window_lo, window_hi = 0, float("inf")
    for i, s in enumerate(streams, 1):
        if s.get("missing"):
            per.append({"stream": i, "missing": True})
            continue
        evs = s["events"]
        live = [e for e in evs if e[1] != "flow.snapshot"]
        lat = [e[3] - e[2] for e in live]
        all_lat += lat
        by_type: dict[str, list[float]] = collections.defaultdict(list)
        for e in live:
            by_type[e[1]].append(e[3] - e[2])
        seqs = [e[0] for e in live]
        snap = next((e[0] for e in evs if e[1] == "flow.snapshot"), None)
        # With every type, sequences after the snapshot's watermark are contiguous.
        gaps = dups = 0
        if seqs:
            first = snap + 1 if snap is not None else seqs[0]
            seen = collections.Counter(seqs)
            dups = sum(c - 1 for c in seen.values() if c > 1)
            window_lo = max(window_lo, first)
            window_hi = min(window_hi, max(seqs))
            if not filtered:
                gaps = sum(1 for q in range(first, max(seqs) + 1) if q not in seen)
        out_of_order = sum(1 for x, y in itertools.pairwise(seqs) if y <= x)
        completed = {e[0] for e in live if e[1] == "flow.completed"}
        completed_sets.append(completed)
        seq_sets.append(set(seqs))
        per.append(
            {
                "stream": i,
                "status": s["status"],
                "events": len(live),
                "flow_completed": len(completed),
                "first_seq": seqs[0] if seqs else None,
                "last_seq": seqs[-1] if seqs else None,
                "gaps": gaps,
                "duplicates": dups,
                "out_of_order": out_of_order,
                "closed_by_server": s["closed_by_server"],
                "retries_429": s["retries_429"],
                "recvs": s["recvs"],
                "bytes": s["bytes"],
                "reader_cpu_s": s["cpu_s"],
                "comments": s["comments"],
                "unparsed_frames": s["unparsed_frames"],
                "latency_ms": summary_ms(lat),
                "latency_by_type_ms": {t: summary_ms(v) for t, v in sorted(by_type.items())},
            }
        )
    union = set().union(*completed_sets) if completed_sets else set()
    missing = [len(union - c) for c in completed_sets]
    in_window = {q for ss in seq_sets for q in ss if window_lo <= q <= window_hi}
    missing_any = [len(in_window - ss) for ss in seq_sets]
    return {
        "streams": per,
        "all": summary_ms(all_lat),
        "flow_completed_union": len(union),
        "flow_completed_missing_per_stream": missing,
        "events_missing_per_stream": missing_any,
        "cross_check_window": [window_lo, window_hi if seq_sets else None],
        "every_completed_on_every_stream": bool(completed_sets)
        and all(m == 0 for m in missing)
        and len(union) >= started,
        "closed_early": sum(1 for p in per if p.get("closed_by_server") or p.get("missing")),
        "gaps": sum(p.get("gaps", 0) for p in per),
        "duplicates": sum(p.get("duplicates", 0) for p in per),
    }


# =========================================================================== report


def ok(flag: bool) -> str:
    return "ok" if flag else "MISS"


def f1(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def header(kind: str, meta: dict) -> list[str]:
    """A report's first lines: title and engine, machine, loadavg before/after."""
    la0, la1 = meta["loadavg_before"], meta.get("loadavg_after")
    return [
        f"spliceway {kind} benchmark  {meta['timestamp']}  engine: {meta.get('launch', '?')}"
        f"  ({'quick' if meta['quick'] else 'full'})",
        f"machine: {meta['nproc']} CPUs ({meta['cpu_model']}), kernel {meta['kernel']}, "
        f"Python {meta['python']}; git {meta['git']}",
        "loadavg before "
        + " ".join(f"{x:.2f}" for x in la0)
        + ("  after " + " ".join(f"{x:.2f}" for x in la1) if la1 else ""),
    ]


def report(res: dict) -> str:
    meta = res["meta"]
    L = header("control-plane", meta)
    s = res.get("sse")
    if s:
        lg = s["loadgen"]
        L.append("")
        L.append(
            f"1. SSE latency: {len(s['streams'])} streams (types={s['types']}), loadgen paced "
            f"{s['rate_target']:.0f} flows/s for {s['seconds']} s through the socks5 inbound"
        )
        L.append(
            f"   achieved {lg['conn_per_s']:.1f} flows/s (loadgen: {lg['count']} flows in "
            f"{lg['seconds']:.2f} s, errors {sum(lg['errors'].values())}, "
            f"no free slot {lg.get('paced_no_slot', 0)}); engine total_started "
            f"+{s['engine_started']} ({f1(s['engine_flows_per_s'])}/s), failed "
            f"+{s['engine_failed']}; engine CPU {s['engine_cpu_s']:.2f} s"
        )
        fl = lg["lat_us"]
        saturated = lg.get("paced_no_slot", 0) > 0 or lg["conn_per_s"] < 0.97 * s["rate_target"]
        L.append(
            f"   flow latency (connect..EOF via the proxy) p50 {fl['p50'] / 1000:.1f} ms, p99 "
            f"{fl['p99'] / 1000:.1f} ms"
            + (
                "  -> the engine did NOT keep up with the offered rate (flows queued)"
                if saturated
                else ""
            )
        )
        L.append(
            "   latency = time.time() right after recv() at the reader - occurred_at_unix_ms "
            "(same host). occurred_at has 1 ms"
        )
        L.append(
            "   resolution (floored), so each figure reads 0-1 ms high; flow.snapshot excluded."
        )
        L.append(
            f"   {'stream':<8}{'events':>8}{'completed':>11}{'p50 ms':>9}{'p99 ms':>9}"
            f"{'max ms':>9}{'gaps':>6}{'dups':>6}{'closed':>8}{'ev/read':>9}{'reader cpu s':>14}"
        )
        for p in s["streams"]:
            if p.get("missing"):
                L.append(f"   {p['stream']:<8}(no result: reader died)")
                continue
            lat = p["latency_ms"]
            L.append(
                f"   {p['stream']:<8}{p['events']:>8}{p['flow_completed']:>11}{f1(lat['p50']):>9}"
                f"{f1(lat['p99']):>9}{f1(lat['max']):>9}{p['gaps']:>6}{p['duplicates']:>6}"
                f"{'yes' if p['closed_by_server'] else 'no':>8}"
                f"{p['events'] / max(1, p['recvs']):>9.1f}{p['reader_cpu_s']:>14.2f}"
            )
        al = s["all"]
        L.append(
            f"   {'all':<8}{al['n']:>8}{'':>11}{f1(al['p50']):>9}{f1(al['p99']):>9}"
            f"{f1(al['max']):>9}"
        )
        L.append(
            f"   every flow.completed on every stream: "
            f"{'yes' if s['every_completed_on_every_stream'] else 'NO'} "
            f"({s['flow_completed_union']} distinct, engine started {s['engine_started']}; "
            f"missing per stream {s['flow_completed_missing_per_stream']})"
        )
        p99 = al["p99"]
        L.append(
            f"   overall p99 {f1(p99)} ms  target <= {TARGET_SSE_P99_MS:.0f} ms  "
            f"{ok(p99 is not None and p99 <= TARGET_SSE_P99_MS)}"
            + ("   (run disturbed by other processes)" if s["disturbed"] else "")
        )
    u = res.get("load")
    if u:
        L.append("")
        L.append(
            f"2. Data-plane conn/s, socks5, concurrency {u['conc']}, {u['seconds']} s per run, "
            f"loadgen {u['loadgen_threads']} threads, in run order"
        )
        L.append(
            "   a = no control traffic; b = 5 SSE streams (every event type) + GET "
            f"/api/v1/stats paced at {res['meta']['stats_rate']:.0f}/s on one keep-alive"
        )
        L.append("   connection; b-sse / b-stats = only one of the two")
        L.append(
            f"   {'run':<9}{'conn/s':>7}{'p50 ms':>7}{'p99 ms':>7}{'err':>4}{'eng us/flow':>12}"
            f"{'other':>6} |{'stats n':>8}{'p50':>6}{'p99':>6}{'max':>6}{'!200':>5}"
            f" |{'sse ev/str':>11}{'p50':>5}{'p99':>6}{'max':>6}{'lost':>5}"
        )
        for r in u["runs"]:
            lg = r["loadgen"]
            row = (
                f"   {r['kind'] + (' *' if r['disturbed'] else ''):<9}{r['conn_per_s']:>7.0f}"
                f"{lg['lat_us']['p50'] / 1000:>7.1f}{lg['lat_us']['p99'] / 1000:>7.1f}"
                f"{sum(lg['errors'].values()):>4}{r['engine_cpu_us_per_flow'] or 0:>12.0f}"
                f"{r['other_cpu_s']:>6.2f} |"
            )
            if "stats_client" in r:
                sc = r["stats_client"]
                non200 = sc["requests"] - sc["status"].get("200", 0) + sc["errors"]
                row += (
                    f"{sc['requests']:>8}{f1(sc['latency_ms']['p50']):>6}"
                    f"{f1(sc['latency_ms']['p99']):>6}{f1(sc['latency_ms']['max']):>6}"
                    f"{non200:>5} |"
                )
            else:
                row += f"{'':>31} |"
            if "sse" in r:
                sse = r["sse"]
                evs = [p["events"] for p in sse["streams"] if not p.get("missing")]
                lost = (
                    sse["closed_early"]
                    + sse["gaps"]
                    + sum(sse["flow_completed_missing_per_stream"])
                )
                row += (
                    f"{(min(evs) if evs else 0):>11}{f1(sse['all']['p50']):>5}"
                    f"{f1(sse['all']['p99']):>6}{f1(sse['all']['max']):>6}{lost:>5}"
                )
            L.append(row.rstrip(" |"))
        L.append(
            f"   median a {u['a']['median_conn_per_s']:.0f} / b {u['b']['median_conn_per_s']:.0f}"
            f" conn/s: drop {f1(u['drop_pct_median'])} %  (best-of: a "
            f"{u['a']['best_conn_per_s']:.0f} / b {u['b']['best_conn_per_s']:.0f}, drop "
            f"{f1(u['drop_pct_best'])} %)  target < {TARGET_DROP_PCT:.0f} %  "
            f"{ok(u['drop_pct_median'] is not None and u['drop_pct_median'] < TARGET_DROP_PCT)}"
        )
        parts = [
            f"{k} {u[k]['median_conn_per_s']:.0f} conn/s ({f1(u[k]['drop_pct_median'])} %)"
            for k in ("b-sse", "b-stats")
            if k in u
        ]
        if parts:
            L.append("   breakdown (one run each, drop vs median a): " + ", ".join(parts))
        L.append(
            "   ms columns: flow latency (loadgen), stats request latency, SSE event latency;"
            " eng us/flow = engine CPU per flow;"
        )
        L.append(
            "   other = CPU s used by processes not ours; lost = SSE streams closed early +"
            " gaps + missing flow.completed;"
        )
        L.append(
            "   * = disturbed by other processes (left out of the medians when others are clean)"
        )
    c = res.get("closed")
    if c:
        lat, lim = c["ok_latency_ms"], c["limited_latency_ms"]
        L.append("")
        L.append(
            f"3. GET /api/v1/stats closed loop: {c['connections']} keep-alive connections "
            f"(one process each), {c['seconds']} s, relay idle"
        )
        L.append(
            f"   {c['requests_per_s']:.0f} requests/s answered in all; 200: {c['ok']} = "
            f"{c['ok_per_s']:.0f}/s ({c['ok_per_s_after_burst']:.0f}/s without the initial "
            f"burst of {QUERY_LIMIT_PER_S}); status {c['status']}; errors {c['errors']}"
        )
        L.append(
            f"   200 latency p50 {f1(lat['p50'])} / p99 {f1(lat['p99'])} / max {f1(lat['max'])} ms;"
            f" 429 latency p50 {f1(lim['p50'])} / p99 {f1(lim['p99'])} ms"
        )
        L.append(
            f"   the API allows {QUERY_LIMIT_PER_S} queries/s per engine (token bucket, burst "
            f"{QUERY_LIMIT_PER_S}, no config knob): the 200/s figure is the limiter's, the "
            "requests/s figure is what the server answers"
        )
    notes = res.get("notes") or []
    if notes:
        L.append("")
        L.append("Notes:")
        L.extend(f"   - {n}" for n in notes)
    return "\n".join(L)


def collect_notes(res: dict) -> list[str]:
    st = res.get("engine_stop") or {}
    notes = e2e.stop_notes(st, "", "engine")
    if st.get("warning_count"):
        notes.append(
            f"{st['warning_count']} WARNING lines on the engine's stderr, e.g. "
            f"{st['warnings'][0][:160]!r}"
        )
    sse_sets = []
    if res.get("sse"):
        sse_sets.append(("SSE latency run", res["sse"]))
    for i, r in enumerate((res.get("load") or {}).get("runs", []), 1):
        if "sse" in r:
            sse_sets.append((f"load run {i} ({r['kind']})", r["sse"]))
        if "stats_client" in r:
            sc = r["stats_client"]
            if sc["status"].keys() - {"200"} or sc["errors"]:
                notes.append(
                    f"load run {i}: stats requests got {sc['status']}, errors {sc['errors']}"
                )
            if sc["late"]:
                notes.append(
                    f"load run {i}: {sc['late']} stats requests started > 5 ms behind their "
                    "slot (the previous one was still running)"
                )
    for name, s in sse_sets:
        if s["closed_early"]:
            notes.append(f"{name}: {s['closed_early']} SSE stream(s) ended by the server early")
        if s["gaps"] or s["duplicates"]:
            notes.append(f"{name}: SSE gaps {s['gaps']}, duplicates {s['duplicates']}")
        retried = sum(p.get("retries_429", 0) for p in s["streams"])
        if retried:
            notes.append(f"{name}: opening the streams met {retried} 429(s) (slot not yet free)")
        if not s["every_completed_on_every_stream"]:
            notes.append(f"{name}: not every flow.completed reached every stream")
    runs = (res.get("load") or {}).get("runs", [])
    busy = [r for r in runs if r["disturbed"]] + (
        [res["sse"]] if (res.get("sse") or {}).get("disturbed") else []
    )
    if busy:
        others: collections.Counter[str] = collections.Counter()
        for r in busy:
            for t in r.get("top_cpu", []):
                if not t["ours"]:
                    others[f"{t['name']} pid {t['pid']}"] += t["cpu_s"]
        top = ", ".join(f"{k} {v:.1f} s" for k, v in others.most_common(3))
        notes.append(
            f"{len(busy)} run(s) disturbed by other processes (>10% of the machine's CPU)"
            + (f"; biggest: {top}" if top else "")
        )
    return notes


# =========================================================================== main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_sse"]:
        return sse_reader_main(argv[1:])
    if argv[:1] == ["_stats"]:
        return stats_client_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short runs (about 45 s)")
    ap.add_argument("--sse-rate", type=float, default=1000.0, help="paced flows/s for part 1")
    ap.add_argument("--sse-seconds", type=float, help="part 1 duration (default 10, quick 4)")
    ap.add_argument(
        "--sse-types",
        default="",
        help="types= filter of part 1's streams (default: every type, so sequences must be "
        "contiguous)",
    )
    ap.add_argument("--load-seconds", type=float, help="part 2 run length (default 8, quick 4)")
    ap.add_argument("--reps", type=int, help="(a)/(b) pairs in part 2 (default 2, quick 1)")
    ap.add_argument("--stats-rate", type=float, default=50.0, help="stats requests/s in (b)")
    ap.add_argument("--closed-seconds", type=float, help="part 3 duration (default 5, quick 3)")
    ap.add_argument("--closed-conns", type=int, default=4)
    ap.add_argument(
        "--breakdown",
        action=argparse.BooleanOptionalAction,
        help="part 2 also runs SSE-only and stats-only once each (default: on, off with --quick)",
    )
    ap.add_argument("--loadgen-threads", type=int, default=2)
    ap.add_argument("--server-threads", type=int, default=2)
    ap.add_argument("--ring", type=int, default=8192, help="runtime.event_ring_capacity")
    ap.add_argument("--only", default="sse,load,closed", help="comma list of sse,load,closed")
    e2e.add_quiet_options(ap, budget_help="default 40 s, quick 15 s")
    args = ap.parse_args(argv)
    q = args.quick
    args.sse_seconds = args.sse_seconds or (4.0 if q else 10.0)
    args.load_seconds = args.load_seconds or (4.0 if q else 8.0)
    args.reps = args.reps or (1 if q else 2)
    if args.breakdown is None:
        args.breakdown = not q
    args.closed_seconds = args.closed_seconds or (3.0 if q else 5.0)
    if args.quiet_budget is None:
        args.quiet_budget = 15.0 if q else 40.0
    only = {x.strip() for x in args.only.split(",") if x.strip()}

    e2e.raise_nofile()
    tools = e2e.build_tools(args.cc)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / f"{stamp}-control"
    res: dict = {
        "meta": {
            "timestamp": stamp,
            "quick": q,
            **e2e.host_meta(),
            "git": e2e.git_info(),
            "loadavg_before": os.getloadavg(),
            "sse_streams": SSE_STREAMS,
            "sse_rate": args.sse_rate,
            "sse_seconds": args.sse_seconds,
            "load_seconds": args.load_seconds,
            "reps": args.reps,
            "stats_rate": args.stats_rate,
            "closed_seconds": args.closed_seconds,
            "closed_conns": args.closed_conns,
            "loadgen_threads": args.loadgen_threads,
            "server_threads": args.server_threads,
            "query_limit_per_s": QUERY_LIMIT_PER_S,
        }
    }
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sw-bench-control-") as tmpd:
        tmp = Path(tmpd)
        b = Bench(args, tools, tmp)
        try:
            b.server = e2e.Server(tools["tinyserver"], None, 900, args.server_threads)
            config = {
                "inbounds": [e2e.socks_inbound()],
                "outbounds": [{"tag": "direct", "protocol": "direct"}],
                "runtime": {"stats_interval_ms": 1000, "event_ring_capacity": args.ring},
                "api": {"control": control_api(), "ipc": {"enabled": False}},
            }
            b.engine = Engine("spliceway-control", config, tmp, Path(f"{base}.proxy.log"))
            res["meta"]["launch"] = b.engine.launch
            res["meta"]["engine_cmd"] = b.engine.cmd
            res["meta"]["engine_config"] = b.engine.config
            log(
                f"engine pid {b.engine.pid}: socks5 127.0.0.1:{b.engine.socks_port}, control "
                f"http://127.0.0.1:{b.engine.api_port}; tinyserver pid {b.server.pid} "
                f"rate={b.server.rate}"
            )
            # warm-up (not recorded)
            w = b.loadgen(b.rate_argv(16, 1.0, args.loadgen_threads), 40)
            log(f"warm-up via proxy: {w['conn_per_s']:.0f} conn/s")
            if "sse" in only:
                log(f"1. SSE latency at {args.sse_rate:.0f} flows/s ...")
                res["sse"] = b.sse_latency()
                s = res["sse"]
                log(
                    f"  {s['loadgen']['conn_per_s']:.0f} flows/s, overall p50={s['all']['p50']}ms "
                    f"p99={s['all']['p99']}ms max={s['all']['max']}ms, closed_early="
                    f"{s['closed_early']} gaps={s['gaps']}"
                )
            if "load" in only:
                log("2. conn/s with and without control traffic ...")
                res["load"] = b.under_load()
            if "closed" in only:
                log("3. GET /api/v1/stats closed loop ...")
                res["closed"] = b.stats_closed()
            res["meta"]["engine_rss_kib_end"] = e2e.proc_rss_kib(b.engine.pid)
        finally:
            b.kids.reap()
            if b.engine is not None:
                res["engine_stop"] = b.engine.stop()
            if b.server is not None:
                b.server.stop()
    res["meta"]["loadavg_after"] = os.getloadavg()
    res["meta"]["elapsed_s"] = round(time.monotonic() - t_start, 1)
    res["notes"] = collect_notes(res)
    e2e.publish(res, report(res), base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
