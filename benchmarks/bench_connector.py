#!/usr/bin/env python3
"""Connector benchmark: webhook deliveries/s from the durable outbox, and the data plane's cost.

    python benchmarks/bench_connector.py [--quick] [--only deliveries,live,conns] [--sinks 1,4]

The engine runs as its own process (``python -m spliceway run -c <tmp config>``,
launched as in run_e2e.py) with a socks5 inbound, the HTTP control API and
``api.event_sinks`` of type ``webhook`` with ``api.outbox_path`` set; every
receiver is a ``hookserver`` (C, epoll, keep-alive HTTP/1.1, answers 200 with an
empty body and appends every body's ``event_id`` to a file); loadgen and
tinyserver (C) make the flows.  Measured:

1. **deliveries**: per sink count K (``--sinks``, default 1 and 4), a fresh
   engine with K webhook sinks (``events: []``, every type), each pointing at a
   port where nothing listens yet.  loadgen drives ``--flows`` short connections
   through the socks5 inbound (3 events each: flow.started, flow.routed,
   flow.completed); the sinks get "connection refused" and back off (50..200 ms),
   so the events pile up in the outbox on disk (``pending`` in GET
   /api/v1/sinks).  Once ``pending`` is steady, K hookservers start on those
   ports and the backlog drains.  Per sink: events/s over the steady part
   (10 % .. 90 % of the backlog, from hookserver's once-a-second counts), the
   overall rate (backlog / time to deliver it), the best second; in all: events/s
   of all sinks, the engine's CPU s per 1,000 deliveries and the receivers' CPU.
   Every receiver's event_ids are checked: sequences contiguous (every type is
   subscribed), duplicates, unique ids against the engine's ``total_delivered``.
   Target >= 3,000 events/s per sink.
2. **live** (same engine and receivers, after the drain): loadgen paces
   ``--live-rate`` flows/s for ``--live-seconds`` with the receivers up;
   ``pending`` is sampled every 0.25 s: does it stay bounded, how long does the
   rest take to drain after the load stops.
3. **conns**: data-plane conn/s (loadgen rate, concurrency 64, tinyserver's
   100 B / 1 KiB exchange, as in run_e2e.py) through engine A (no sink) and
   engine B (one webhook sink subscribed to the four flow events, outbox on,
   one hookserver receiving), both running side by side, runs interleaved
   A B B A A B ... (``--reps`` each); medians of the undisturbed runs, the
   drop (target < 10 %), B's pending at the end of each run and how long the
   sink took to catch up (waited out before the next run), replay_gaps.  With
   ``--breakdown`` (the full run's default) engine C joins: the same sink with
   nothing listening, so its events reach the outbox but are never delivered
   (A B C, C B A, ...): the outbox intake's share of B's cost.

Prints tables and writes benchmarks/results/<timestamp>-connector.json (every
sample, per-run loadgen JSON, the configs, the git revision, load average) and
the engines' logs beside it.  Every server listens on 127.0.0.1; every loop is
bounded in count and time; only processes this script started are stopped, by
pid.  See benchmarks/README.md ("Connector").
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import http.client
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import bench_control  # noqa: E402
import run_e2e as e2e  # noqa: E402  (shared tooling: build, tinyserver, engine launch, /proc)
from bench_control import API, f1, header, ok  # noqa: E402
from run_e2e import log  # noqa: E402

TARGET_EVENTS_PER_S = 3000.0  # per sink, draining the outbox
TARGET_DROP_PCT = 10.0
FLOW_EVENTS = ["flow.started", "flow.routed", "flow.updated", "flow.completed"]
DISPATCHER = {
    "request_timeout_ms": 10000,
    "backoff_initial_ms": 50,
    "backoff_max_ms": 200,
    "retry_threshold": 10,
    "on_exhausted": "retry_forever",
}
STAT_RE = re.compile(r"(\w+)=(-?\d+)")
POLL_S = 0.25


def build_hookserver(cc: str) -> Path:
    """benchmarks/build/hookserver from hookserver.c (``cc -O2``), rebuilt when older."""
    return e2e.build_tool(cc, "hookserver")


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


def f0(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def fs_type(path: Path) -> str:
    """The file system ``path`` lives on (longest mount point prefix in /proc/self/mounts)."""
    best, kind = "", "?"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1]
                if str(path).startswith(mnt) and len(mnt) > len(best):
                    best, kind = mnt, f"{parts[2]} ({parts[0]} on {mnt})"
    except OSError:
        pass
    return kind


def du_bytes(path: Path) -> int:
    """Bytes allocated on disk under ``path``."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def family_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its direct children (0 once gone)."""
    total = e2e.pids_cpu_s([pid])
    for cpid, (_, ppid, cpu) in e2e.proc_table().items():
        if ppid == pid and cpid != pid:
            total += cpu
    return total


# --------------------------------------------------------------------------- processes


class Hook:
    """A hookserver on 127.0.0.1:``port``; its once-a-second lines are collected."""

    def __init__(
        self, exe: Path, port: int, ids: Path | None, seconds: float, err: Path, tick_ms: int
    ) -> None:
        cmd = [str(exe), "--port", str(port), "--seconds", str(int(seconds))]
        cmd += ["--tick-ms", str(tick_ms)]
        if ids is not None:
            cmd += ["--ids", str(ids)]
        self.cmd, self.ids = cmd, ids
        with open(err, "w") as ef:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=ef,
                text=True,
                preexec_fn=e2e.preexec,
            )
        self.pid = self.proc.pid
        self.t_start = time.monotonic()
        line = e2e.read_line(self.proc, 10)
        if not line or not line.startswith("port "):
            e2e.stop_child(self.proc, 2)
            raise SystemExit(f"hookserver did not start ({cmd}): {line!r} {err.read_text()}")
        self.port = int(line.split()[1])
        self.samples: list[dict] = []  # {"t": ms, "requests": n, ...} every --tick-ms
        self.final: dict | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            vals = {k: int(v) for k, v in STAT_RE.findall(line)}
            if "t" not in vals:
                continue
            if line.startswith("final"):
                self.final = vals
            else:
                self.samples.append(vals)

    def requests(self) -> int:
        return self.samples[-1]["requests"] if self.samples else 0

    def cpu(self) -> float:
        return e2e.pids_cpu_s([self.pid])

    def stop(self) -> dict:
        """SIGTERM (its pid only): the final line; SIGKILL after 5 s."""
        killed = e2e.stop_child(self.proc, 5.0)
        self._thread.join(3)
        return {"exit": self.proc.returncode, "killed": killed, "final": self.final}


class Engine(bench_control.Engine):
    """bench_control's engine, with sinks, polled with retries past any failed GET."""

    idle_timeout_s = 15.0
    stop_timeout_s = 20.0

    def result(self, path: str, tries: int = 20) -> dict:
        """The ``result`` of GET ``path``, retried (bounded) past a 429 or a slow answer."""
        last = ""
        for _ in range(tries):
            c = http.client.HTTPConnection("127.0.0.1", self.api_port, timeout=10)
            try:
                c.request("GET", path)
                r = c.getresponse()
                body = r.read()
                if r.status == 200:
                    doc = json.loads(body)
                    if doc.get("ok"):
                        return doc["result"]
                last = f"{r.status} {body[:200]!r}"
            except (OSError, http.client.HTTPException, ValueError) as ex:
                last = repr(ex)
            finally:
                c.close()
            if not self.m.alive():
                self.m.abort(f"{self.name}: the engine died")
            time.sleep(0.2)
        raise SystemExit(f"{self.name}: GET {path} kept failing: {last}")

    def sinks(self) -> list[dict]:
        return self.result(f"{API}/sinks")["sinks"]

    def stats(self) -> dict:
        return self.result(f"{API}/stats")

    def cpu(self) -> float:
        return family_cpu_s(self.pid)


def engine_config(sinks: list[dict], outbox: Path | None) -> dict:
    api: dict = {"control": bench_control.control_api(), "ipc": {"enabled": False}}
    if sinks:
        api.update(
            event_sinks=sinks,
            outbox_path=str(outbox),
            dispatcher=DISPATCHER,
            outbox_min_free_bytes=0,
            outbox_min_free_percent=0,
        )
    return {
        "inbounds": [e2e.socks_inbound()],
        "outbounds": [{"tag": "direct", "protocol": "direct"}],
        "runtime": {"stats_interval_ms": 1000},
        "api": api,
    }


def webhook(tag: str, port: int, events: list[str]) -> dict:
    return {"type": "webhook", "tag": tag, "url": f"http://127.0.0.1:{port}/hook", "events": events}


def sink_brief(s: dict) -> dict:
    """The figures of one GET /sinks entry that the tables use."""
    return {
        "name": s.get("name"),
        "pending": s.get("pending"),
        "total_delivered": s.get("total_delivered"),
        "total_failed": s.get("total_failed"),
        "replay_gaps": s.get("replay_gaps"),
        "last_error": s.get("last_error"),
    }


# --------------------------------------------------------------------------- analysis


def crossing(samples: list[tuple[float, int]], level: float) -> float | None:
    """The first time (s) the count reaches ``level``, interpolated between samples
    ((0, 0) is the receiver's start)."""
    prev = (0.0, 0)
    for t, n in samples:
        if n >= level:
            t0, n0 = prev
            return t0 + (t - t0) * (level - n0) / (n - n0) if n > n0 else t
        prev = (t, n)
    return None


def window_rates(
    pts: list[tuple[float, int]], lo: float, hi: float, width: float = 1.0
) -> list[float]:
    """Rates over back-to-back windows of >= ``width`` s between the samples in [lo, hi]."""
    rates = []
    i = next((x for x, p in enumerate(pts) if p[0] >= lo), None)
    while i is not None:
        j = next((x for x in range(i + 1, len(pts)) if pts[x][0] >= pts[i][0] + width), None)
        if j is None or pts[j][0] > hi:
            break
        rates.append((pts[j][1] - pts[i][1]) / (pts[j][0] - pts[i][0]))
        i = j
    return rates


def drain_rates(hook_samples: list[dict], backlog: int) -> dict:
    """Rates of one receiver draining ``backlog`` events, from its counts every --tick-ms."""
    pts = [(s["t"] / 1000.0, s["requests"]) for s in hook_samples]
    t10, t90 = crossing(pts, 0.1 * backlog), crossing(pts, 0.9 * backlog)
    t_first, t_done = crossing(pts, 1), crossing(pts, backlog)
    steady = t10 is not None and t90 is not None and t90 > t10
    per_s = window_rates(pts, t10, t90) if steady else []
    return {
        "backlog": backlog,
        "t_first_s": _r(t_first, 3),
        "t10_s": _r(t10, 3),
        "t90_s": _r(t90, 3),
        "t_done_s": _r(t_done, 3),
        "steady_per_s": _r(0.8 * backlog / (t90 - t10)) if steady else None,
        "overall_per_s": _r(backlog / t_done) if t_done else None,
        "median_second_per_s": _r(statistics.median(per_s)) if per_s else None,
        "worst_second_per_s": _r(min(per_s)) if per_s else None,
        "best_second_per_s": _r(max(per_s)) if per_s else None,
        "seconds_in_steady": len(per_s),
    }


def check_ids(path: Path | None, engine_delivered: int | None, contiguous: bool) -> dict:
    """What one receiver's --ids file holds: unique ids, duplicates, sequence gaps."""
    if path is None or not path.exists():
        return {"missing_file": True}
    ids = [x for x in path.read_text().split("\n") if x]
    counts = collections.Counter(ids)
    epochs: collections.Counter[str] = collections.Counter()
    seqs: set[int] = set()
    odd = 0
    for i in counts:
        epoch, _, seq = i.rpartition("-")
        if epoch and seq.isdigit():
            epochs[epoch] += 1
            seqs.add(int(seq))
        else:
            odd += 1
    out: dict = {
        "received": len(ids),
        "unique": len(counts),
        "duplicates": len(ids) - len(counts),
        "ids_received_twice_or_more": sum(1 for c in counts.values() if c > 1),
        "epochs": len(epochs),
        "unparsed_ids": odd,
        "first_seq": min(seqs) if seqs else None,
        "last_seq": max(seqs) if seqs else None,
        "engine_total_delivered": engine_delivered,
        "unique_minus_delivered": (len(counts) - engine_delivered)
        if engine_delivered is not None
        else None,
    }
    if contiguous and seqs:
        missing = [q for q in range(min(seqs), max(seqs) + 1) if q not in seqs]
        out["seq_gaps"] = len(missing)
        out["seq_gap_examples"] = missing[:10]
    return out


# --------------------------------------------------------------------------- bench


class Bench:
    def __init__(self, args: argparse.Namespace, tools: dict[str, Path], tmp: Path) -> None:
        self.a = args
        self.tools = tools
        self.tmp = tmp
        self.server: e2e.Server | None = None
        self.engines: list[Engine] = []
        self.hooks: list[Hook] = []
        self.loadgens: list[subprocess.Popen] = []
        self.quiet = e2e.QuietWait(args, self.our_cpu)
        self.logs: list[Path] = []
        self.stops: dict[str, dict] = {}
        self.launch = "?"

    # ------------------------------------------------------------------ processes

    def our_pids(self) -> list[int]:
        pids = [e.pid for e in self.engines] + [h.pid for h in self.hooks]
        return pids + ([self.server.pid] if self.server else [])

    def our_cpu(self) -> float:
        t = os.times()
        return t.user + t.system + e2e.pids_cpu_s(self.our_pids())

    def engine(self, name: str, config: dict) -> Engine:
        path = self.tmp / f"{name}.log"
        e = Engine(name, config, self.tmp, path)
        self.engines.append(e)
        self.logs.append(path)
        self.launch = e.launch
        log(
            f"  {name}: pid {e.pid}, socks5 127.0.0.1:{e.socks_port}, control "
            f"http://127.0.0.1:{e.api_port} ({e.launch})"
        )
        return e

    def stop_engine(self, e: Engine) -> dict:
        info = e.stop()
        self.engines.remove(e)
        self.stops[e.name] = info
        return info

    def hook(self, port: int, ids: Path | None, seconds: float) -> Hook:
        err = self.tmp / f"hook-{port}-{len(self.logs)}-{time.monotonic_ns()}.err"
        h = Hook(self.tools["hookserver"], port, ids, seconds, err, self.a.tick_ms)
        self.hooks.append(h)
        return h

    def stop_hook(self, h: Hook) -> dict:
        info = h.stop()
        self.hooks.remove(h)
        return info

    def loadgen(self, argv: list[str], timeout: float) -> dict:
        cmd = [str(self.tools["loadgen"]), *argv]
        p = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=e2e.preexec,
        )
        self.loadgens.append(p)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as ex:
            raise SystemExit(f"loadgen exceeded {timeout:.0f}s: {cmd}") from ex
        finally:
            e2e.stop_child(p)
            self.loadgens.remove(p)
        return e2e.loadgen_result(cmd, p.returncode, out, err)

    def rate_argv(self, e: Engine, conc: int, duration: float, **kw: float) -> list[str]:
        assert self.server is not None
        argv = e2e.rate_argv(self.server.rate, e.socks_port, conc, duration, self.a.loadgen_threads)
        for k, v in kw.items():
            argv += [f"--{k}", str(int(v) if float(v).is_integer() else v)]
        return argv

    def close(self, base: Path, res: dict, old_term: Any) -> None:
        """End the run: stop every process it started, restore SIGTERM's handler, keep
        the engines' logs beside the results and record how the engines stopped."""
        self.reap()
        if self.server is not None:
            self.server.stop()
        signal.signal(signal.SIGTERM, old_term)
        for p in self.logs:
            if p.exists():
                shutil.copy(p, f"{base}.{p.stem}.log")
        res["engine_stops"] = self.stops
        res["meta"]["launch"] = self.launch

    def reap(self) -> None:
        for p in list(self.loadgens):
            e2e.stop_child(p)
        for h in list(self.hooks):
            with contextlib.suppress(Exception):
                self.stop_hook(h)
        for e in list(self.engines):
            with contextlib.suppress(Exception):
                self.stop_engine(e)

    def wait_pending(
        self,
        e: Engine,
        below: int,
        timeout: float,
        series: list | None = None,
        stable_s: float = 0.0,
    ) -> tuple[float, list[dict], bool]:
        """Poll GET /sinks until every sink's pending <= ``below`` (for ``stable_s`` s on end),
        or ``timeout`` s, or no delivery for 30 s; (seconds waited until pending first got
        there, the last sinks, drained?)."""
        t0 = time.monotonic()
        end = t0 + timeout
        last_progress, last_total = t0, -1
        since: float | None = None
        while True:
            sinks = e.sinks()
            now = time.monotonic()
            if series is not None:
                series.append(
                    [round(now - t0, 3)]
                    + [[s["pending"], s["total_delivered"], s["total_failed"]] for s in sinks]
                )
            if all(s["pending"] <= below for s in sinks):
                since = now if since is None else since
                if now - since >= stable_s:
                    return since - t0, sinks, True
            else:
                since = None
            total = sum(s["total_delivered"] for s in sinks)
            if total != last_total:
                last_total, last_progress = total, now
            if now >= end or now - last_progress > 30:
                return now - t0, sinks, False
            time.sleep(POLL_S)

    # ------------------------------------------------------------------ 1. deliveries

    def backlog(self, e: Engine, flows: int) -> dict:
        """``flows`` short connections through ``e`` while no receiver runs; waits until the
        sinks' pending is steady (only stats.sampled still adds, 1/s)."""
        c0, t0 = e.cpu(), time.monotonic()
        lg = self.loadgen(
            self.rate_argv(e, 64, self.a.backlog_max_seconds, count=flows),
            self.a.backlog_max_seconds + 60,
        )
        e.wait_idle()
        end = time.monotonic() + self.a.settle_timeout
        prev = [s["pending"] for s in e.sinks()]
        steady = False
        while time.monotonic() < end:
            time.sleep(1.0)
            cur = [s["pending"] for s in e.sinks()]
            if all(c - p <= 2 for c, p in zip(cur, prev, strict=True)):
                steady = True
                break
            prev = cur
        wall = time.monotonic() - t0
        cpu = e.cpu() - c0
        sinks = e.sinks()
        st = e.stats()
        return {
            "flows_asked": flows,
            "loadgen": lg,
            "flows": lg["count"],
            "conn_per_s": lg["conn_per_s"],
            "errors": sum(lg["errors"].values()),
            "engine_total_started": st.get("total_started"),
            "engine_cpu_s": round(cpu, 3),
            "engine_cpu_us_per_flow": round(1e6 * cpu / lg["count"], 1) if lg["count"] else None,
            "wall_s": round(wall, 2),
            "steady": steady,
            "sinks": [sink_brief(s) for s in sinks],
            "pending": [s["pending"] for s in sinks],
            "engine_rss_kib": e2e.proc_rss_kib(e.pid),
        }

    def deliveries(self, k: int) -> dict:
        a = self.a
        ports: list[int] = []
        while len(ports) < k:  # distinct free ports, nothing listening on them yet
            p = e2e.free_port()
            if p not in ports:
                ports.append(p)
        outbox = a.outbox_dir / f"outbox-{k}-{os.getpid()}"
        shutil.rmtree(outbox, ignore_errors=True)
        outbox.mkdir(parents=True)
        sinks = [webhook(f"s{i + 1}", p, []) for i, p in enumerate(ports)]
        cfg = engine_config(sinks, outbox)
        out: dict = {"sinks": k, "outbox": str(outbox), "outbox_fs": fs_type(outbox), "config": cfg}
        e = self.engine(f"engine-deliveries-{k}", cfg)
        try:
            first = e.sinks()
            if len(first) != k:
                raise SystemExit(f"GET /sinks lists {len(first)} sinks, configured {k}: {first}")
            log(f"  building a backlog: {a.flows} flows, receivers down ...")
            b = self.backlog(e, a.flows)
            out["backlog"] = b
            out["outbox_bytes"] = du_bytes(outbox)
            events = sum(b["pending"])
            out["outbox_bytes_per_event"] = (
                round(out["outbox_bytes"] / events, 1) if events else None
            )
            log(
                f"  backlog: {b['flows']} flows at {b['conn_per_s']:.0f}/s, pending "
                f"{b['pending']} (steady: {b['steady']}), engine {b['engine_cpu_us_per_flow']} "
                f"us/flow, outbox {out['outbox_bytes'] >> 20} MiB, last_error "
                f"{b['sinks'][0]['last_error']!r}"
            )
            if b["sinks"][0]["total_delivered"]:
                log("  (odd: deliveries counted while no receiver listened)")
            # ---- drain
            hook_secs = a.drain_timeout + a.live_seconds + 300
            ids = [self.tmp / f"ids-{k}-{s['tag']}.txt" for s in sinks]
            for f in ids:
                f.unlink(missing_ok=True)
            delivered0 = [s["total_delivered"] for s in e.sinks()]
            pt0 = e2e.proc_table()
            c0 = e.cpu()
            hooks = [self.hook(p, f, hook_secs) for p, f in zip(ports, ids, strict=True)]
            h0 = sum(h.cpu() for h in hooks)
            m0 = e2e.machine_cpu()[0]
            series: list = []
            log(f"  draining with {k} hookserver(s) ...")
            waited, after, drained = self.wait_pending(e, 2, a.drain_timeout, series)
            time.sleep(max(0.2, 1.5 * a.tick_ms / 1000))  # one more line from every receiver
            c1, h1, m1 = e.cpu(), sum(h.cpu() for h in hooks), e2e.machine_cpu()[0]
            pt1 = e2e.proc_table()
            delivered = sum(s["total_delivered"] for s in e.sinks()) - sum(delivered0)
            # failures counted before a sink's first delivery: attempts while nothing listened
            out["failed_while_down"] = [
                next(
                    (row[1 + i][2] for row in series if row[1 + i][1] > delivered0[i]),
                    series[-1][1 + i][2],
                )
                for i in range(k)
            ]
            per = []
            for s, h, backlog in zip(sinks, hooks, b["pending"], strict=True):
                rates = drain_rates(list(h.samples), backlog)
                rates["tag"] = s["tag"]
                rates["hook_samples"] = [[x["t"], x["requests"]] for x in h.samples]
                per.append(rates)
            done = [r["t_done_s"] for r in per]
            total_backlog = sum(b["pending"])
            drain = {
                "drained": drained,
                "waited_s": round(waited, 2),
                "per_sink": per,
                "total_steady_per_s": _r(sum(r["steady_per_s"] or 0 for r in per)),
                "total_overall_per_s": _r(total_backlog / max(done))
                if all(done) and max(done)
                else None,
                "delivered": delivered,
                "engine_cpu_s": round(c1 - c0, 3),
                "engine_cpu_s_per_1k": round(1000 * (c1 - c0) / delivered, 4)
                if delivered
                else None,
                "receivers_cpu_s": round(h1 - h0, 3),
                "receivers_cpu_us_per_event": round(1e6 * (h1 - h0) / delivered, 2)
                if delivered
                else None,
                "machine_cpu_s": round(m1 - m0, 2),
                "top_cpu": e2e.top_cpu(pt0, pt1, {os.getpid(), *self.our_pids()}),
                "sinks_after": [sink_brief(s) for s in after],
                "series": series,
                "engine_rss_kib": e2e.proc_rss_kib(e.pid),
                "outbox_bytes_after": du_bytes(outbox),
            }
            out["drain"] = drain
            log(
                f"  drained={drained} in {waited:.1f}s: steady/sink "
                f"{[r['steady_per_s'] for r in per]} ev/s, overall/sink "
                f"{[r['overall_per_s'] for r in per]} ev/s, engine "
                f"{drain['engine_cpu_s_per_1k']} s/1k, receivers {drain['receivers_cpu_s']} s"
            )
            # ---- live
            if "live" in a.only and drained:
                out["live"] = self.live(e, hooks)
            # ---- let every event the engine still writes reach the receivers, stop them
            e.wait_idle()
            _, up, settled = self.wait_pending(e, 0, a.drain_timeout, stable_s=1.0)
            out["settled_before_stop"] = settled
            out["failed_after_up"] = [
                s["total_failed"] - f0 for s, f0 in zip(up, out["failed_while_down"], strict=True)
            ]
            out["receivers"] = [self.stop_hook(h) for h in list(hooks)]
            # ---- check the ids
            final = e.sinks()
            out["sinks_final"] = [sink_brief(s) for s in final]
            out["sinks_final_raw"] = final
            out["ids"] = [
                check_ids(f, s["total_delivered"], contiguous=True)
                for f, s in zip(ids, final, strict=True)
            ]
            if k > 1:  # every sink subscribes to everything: the same ids everywhere
                sets = [set(f.read_text().split()) for f in ids if f.exists()]
                union = set().union(*sets) if sets else set()
                out["ids_missing_vs_union"] = [len(union - s) for s in sets]
            for s, c in zip(final, out["ids"], strict=True):
                log(
                    f"  {s['name']}: delivered {s['total_delivered']}, failed {s['total_failed']},"
                    f" replay_gaps {s['replay_gaps']}, pending {s['pending']}; receiver: "
                    f"{c.get('unique')} unique ids, {c.get('duplicates')} dups, seq gaps "
                    f"{c.get('seq_gaps')} (seq {c.get('first_seq')}..{c.get('last_seq')})"
                )
        finally:
            for h in list(self.hooks):
                self.stop_hook(h)
            out["engine_stop"] = self.stop_engine(e)
            if not a.keep_outbox:
                shutil.rmtree(outbox, ignore_errors=True)
        return out

    # ------------------------------------------------------------------ 2. live

    def live(self, e: Engine, hooks: list[Hook]) -> dict:
        a = self.a
        rate, secs = a.live_rate, a.live_seconds
        log(f"  live: {rate:.0f} flows/s for {secs} s with the receivers up ...")
        series: list = []
        stop = threading.Event()

        def sample() -> None:
            t0 = time.monotonic()
            while not stop.is_set() and time.monotonic() - t0 < secs + 120:
                with contextlib.suppress(SystemExit):
                    ss = e.sinks()
                    series.append(
                        [round(time.monotonic() - t0, 3)]
                        + [[s["pending"], s["total_delivered"]] for s in ss]
                    )
                stop.wait(POLL_S)

        d0 = [s["total_delivered"] for s in e.sinks()]
        r0 = [h.requests() for h in hooks]
        c0, h0 = e.cpu(), sum(h.cpu() for h in hooks)
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        lg = self.loadgen(self.rate_argv(e, 256, secs, rate=rate), secs + 60)
        stop.set()
        th.join(5)
        at_end = e.sinks()
        c1 = e.cpu()
        drain_s, after, drained = self.wait_pending(e, 2, a.drain_timeout)
        d1 = [s["total_delivered"] for s in after]
        n = len(hooks)
        pend = [[row[1 + i][0] for row in series] for i in range(n)]
        offered = 3 * lg["count"] / lg["seconds"] if lg["seconds"] else 0.0
        out = {
            "rate": rate,
            "seconds": secs,
            "loadgen": lg,
            "flows_per_s": lg["conn_per_s"],
            "paced_no_slot": lg.get("paced_no_slot", 0),
            "events_per_s_per_sink_offered": round(offered, 1),
            "pending_max": [max(p) if p else None for p in pend],
            "pending_median": [statistics.median(p) if p else None for p in pend],
            "pending_at_end": [s["pending"] for s in at_end],
            "drain_after_s": round(drain_s, 2),
            "drained_after": drained,
            "delivered": [y - x for x, y in zip(d0, d1, strict=True)],
            "receiver_requests": [h.requests() - r for h, r in zip(hooks, r0, strict=True)],
            "engine_cpu_s": round(c1 - c0, 3),
            "engine_cpu_share": round((c1 - c0) / lg["seconds"], 3) if lg["seconds"] else None,
            "receivers_cpu_s": round(sum(h.cpu() for h in hooks) - h0, 3),
            "series": series,
        }
        # bounded: at the end of the load no sink is more than ~1 s of events behind
        out["bounded"] = all(p <= max(offered, 100) for p in out["pending_at_end"])
        log(
            f"  live: {lg['conn_per_s']:.0f} flows/s (~{offered:.0f} ev/s/sink), pending max "
            f"{out['pending_max']}, at end {out['pending_at_end']}, drained {drained} "
            f"{drain_s:.1f}s later; bounded={out['bounded']}"
        )
        return out

    # ------------------------------------------------------------------ 3. conns

    def conns(self) -> dict:
        a = self.a
        secs = a.conn_seconds
        outbox = a.outbox_dir / f"outbox-conns-{os.getpid()}"
        shutil.rmtree(outbox, ignore_errors=True)
        outbox.mkdir(parents=True)
        ids = self.tmp / "ids-conns.txt"
        ids.unlink(missing_ok=True)
        hook = self.hook(0, ids, 3600)
        cfg_a = engine_config([], None)
        cfg_b = engine_config([webhook("flows", hook.port, FLOW_EVENTS)], outbox)
        outbox_c = a.outbox_dir / f"outbox-conns-c-{os.getpid()}"
        cfg_c = engine_config([webhook("flows", e2e.free_port(), FLOW_EVENTS)], outbox_c)
        out: dict = {
            "seconds": secs,
            "conc": 64,
            "loadgen_threads": a.loadgen_threads,
            "outbox": str(outbox),
            "outbox_fs": fs_type(outbox),
            "config_a": cfg_a,
            "config_b": cfg_b,
            "breakdown": a.breakdown,
        }
        ea = self.engine("engine-conns-a", cfg_a)
        eb = self.engine("engine-conns-b", cfg_b)
        engines = {"a": ea, "b": eb}
        if a.breakdown:  # c: the same sink, nothing listening: outbox intake, no deliveries
            shutil.rmtree(outbox_c, ignore_errors=True)
            outbox_c.mkdir(parents=True)
            out["config_c"] = cfg_c
            engines["c"] = self.engine("engine-conns-c", cfg_c)
        order = ("a", "b", "c") if a.breakdown else ("a", "b")
        try:
            for e in engines.values():  # warm-up (not recorded)
                w = self.loadgen(self.rate_argv(e, 16, 1.0), 40)
                log(f"  warm-up {e.name}: {w['conn_per_s']:.0f} conn/s")
            self.wait_pending(eb, 0, a.drain_timeout)
            plan = [k for rep in range(a.reps) for k in (order if rep % 2 == 0 else order[::-1])]
            runs = []
            budget = e2e.RetryBudget(a.retries)
            for kind in plan:
                e = engines[kind]
                for r in budget.runs(lambda e=e, kind=kind: self.conn_run(kind, e, eb, hook, secs)):
                    runs.append(r)
                    log(describe_conn_run(r))
            out["runs"] = runs
            for kind in order:
                rs = [r for r in runs if r["kind"] == kind]
                clean = e2e.undisturbed(rs)
                vals = [r["conn_per_s"] for r in clean]
                out[kind] = {
                    "median_conn_per_s": round(statistics.median(vals), 1),
                    "best_conn_per_s": round(max(vals), 1),
                    "runs_used": len(clean),
                    "runs": len(rs),
                    "median_engine_us_per_flow": _r(
                        statistics.median(r["engine_cpu_us_per_flow"] or 0 for r in clean)
                    ),
                }
            ma, mb = out["a"]["median_conn_per_s"], out["b"]["median_conn_per_s"]
            out["ratio"] = round(mb / ma, 3) if ma else None
            out["drop_pct_median"] = round(100.0 * (1 - mb / ma), 1) if ma else None
            ba, bb = out["a"]["best_conn_per_s"], out["b"]["best_conn_per_s"]
            out["drop_pct_best"] = round(100.0 * (1 - bb / ba), 1) if ba else None
            if "c" in out and ma:
                out["c"]["drop_pct_median"] = round(
                    100.0 * (1 - out["c"]["median_conn_per_s"] / ma), 1
                )
            self.wait_pending(eb, 0, a.drain_timeout)
            out["hook_stop"] = self.stop_hook(hook)
            final = eb.sinks()
            out["sink_final"] = sink_brief(final[0])
            out["sink_final_raw"] = final[0]
            out["ids"] = check_ids(ids, final[0]["total_delivered"], contiguous=False)
        finally:
            if hook in self.hooks:
                self.stop_hook(hook)
            for e in engines.values():
                if e in self.engines:
                    out[f"engine_stop_{e.name[-1]}"] = self.stop_engine(e)
            if not a.keep_outbox:
                shutil.rmtree(outbox, ignore_errors=True)
                shutil.rmtree(outbox_c, ignore_errors=True)
        return out

    def conn_run(self, kind: str, e: Engine, eb: Engine, hook: Hook, secs: float) -> dict:
        """One loadgen rate run through engine ``e`` (a or b); B's sink state around it."""
        a = self.a
        pre_wait, _, pre_drained = self.wait_pending(eb, 0, a.drain_timeout)
        waited, other_before = self.quiet() if a.quiet_wait > 0 else (0.0, -1.0)
        sb0 = eb.sinks()[0]
        sc0 = e.sinks()[0] if kind == "c" else {}
        e.wait_idle()
        h0 = hook.cpu()
        m0, k0, o0 = e2e.machine_cpu()[0], e2e.kernel_threads_cpu(), self.our_cpu()
        c0, pt0 = e.cpu(), e2e.proc_table()
        cb0 = eb.cpu() if e is not eb else 0.0
        lg = self.loadgen(self.rate_argv(e, 64, secs), secs + 60)
        c1, pt1 = e.cpu(), e2e.proc_table()
        m1, k1, o1 = e2e.machine_cpu()[0], e2e.kernel_threads_cpu(), self.our_cpu()
        h1 = hook.cpu()
        cb1 = eb.cpu() if e is not eb else 0.0
        sb1 = eb.sinks()[0]
        sc1 = e.sinks()[0] if kind == "c" else {}
        other = max(0.0, (m1 - m0) - (o1 - o0) - lg["cpu_s"] - (k1 - k0))
        wall = lg["seconds"] or secs
        res: dict = {
            "kind": kind,
            "loadgen": lg,
            "conn_per_s": lg["conn_per_s"],
            "errors": sum(lg["errors"].values()),
            "engine_cpu_s": round(c1 - c0, 3),
            "engine_cpu_us_per_flow": round(1e6 * (c1 - c0) / lg["count"], 1)
            if lg["count"]
            else None,
            "idle_engine_b_cpu_s": round(cb1 - cb0, 3),
            "receiver_cpu_s": round(h1 - h0, 3),
            "other_cpu_s": round(other, 3),
            "top_cpu": e2e.top_cpu(pt0, pt1, {os.getpid(), *self.our_pids()}),
            "quiet_wait_s": round(waited, 2),
            "other_share_before": round(other_before, 3),
            "pre_drain_wait_s": round(pre_wait, 2),
            "pre_drained": pre_drained,
            "disturbed": e2e.others_busy(other, wall),
        }
        if kind == "c":
            res["outbox_written_in_run"] = sc1["pending"] - sc0["pending"]
            res["written_per_s_in_run"] = round(res["outbox_written_in_run"] / wall, 1)
            res["pending_at_end"] = sc1["pending"]
        if kind == "b":
            res["delivered_in_run"] = sb1["total_delivered"] - sb0["total_delivered"]
            res["delivered_per_s_in_run"] = round(res["delivered_in_run"] / wall, 1)
            res["pending_at_end"] = sb1["pending"]
            res["events_offered"] = 3 * lg["count"]
            catch, sb2, drained = self.wait_pending(eb, 0, a.drain_timeout)
            res["catch_up_s"] = round(catch, 2)
            res["caught_up"] = drained
            res["sink_after"] = sink_brief(sb2[0])
        return res


def describe_conn_run(r: dict) -> str:
    lat = r["loadgen"]["lat_us"]
    line = (
        f"  ({r['kind']}) {r['conn_per_s']:8.0f} conn/s  p50={lat['p50']:.0f}us "
        f"p99={lat['p99']:.0f}us  engine {r['engine_cpu_us_per_flow']} us/flow  "
        f"other_cpu={r['other_cpu_s']:.2f}s"
    )
    if r["kind"] == "b":
        line += (
            f"  delivered {r['delivered_in_run']} in run, pending at end "
            f"{r['pending_at_end']}, caught up in {r['catch_up_s']}s"
        )
    if r["kind"] == "c":
        line += f"  outbox +{r['outbox_written_in_run']} events (no receiver)"
    return line + ("  (disturbed)" if r["disturbed"] else "")


# --------------------------------------------------------------------------- report


def report(res: dict) -> str:
    meta = res["meta"]
    L = header("connector", meta)
    L[-1] += f"; outbox on {meta['outbox_fs']}"
    dl = res.get("deliveries") or []
    if dl:
        L.append("")
        L.append(
            f"1. Deliveries/s draining the outbox (backlog of {meta['flows']} flows built with "
            "the receivers down; every sink events=[])"
        )
        L.append(
            f"   {'sinks':<6}{'backlog/sink':>13}{'drain s':>9}{'steady ev/s/sink':>18}"
            f"{'overall/sink':>14}{'total ev/s':>12}{'engine s/1k':>13}{'recv us/ev':>12}"
            f"{'flows/s in':>12}"
        )
        for d in dl:
            dr = d.get("drain")
            if not dr:
                L.append(f"   {d['sinks']:<6}(no drain result)")
                continue
            per = dr["per_sink"]
            steady = [r["steady_per_s"] for r in per if r["steady_per_s"]]
            overall = [r["overall_per_s"] for r in per if r["overall_per_s"]]
            backlogs = d["backlog"]["pending"]

            def rng(v: list[float]) -> str:
                if not v:
                    return "-"
                return f"{min(v):.0f}" if len(v) == 1 else f"{min(v):.0f}..{max(v):.0f}"

            L.append(
                f"   {d['sinks']:<6}{rng(backlogs):>13}{dr['waited_s']:>9.1f}{rng(steady):>18}"
                f"{rng(overall):>14}{f0(dr['total_steady_per_s']):>12}"
                f"{dr['engine_cpu_s_per_1k'] or 0:>13.3f}"
                f"{dr['receivers_cpu_us_per_event'] or 0:>12.1f}"
                f"{d['backlog']['conn_per_s']:>12.0f}" + ("" if dr["drained"] else "  NOT DRAINED")
            )
        L.append(
            "   steady = 10..90 % of the backlog (hookserver's counts every --tick-ms, "
            "interpolated); overall = backlog / time to"
        )
        L.append(
            "   deliver it from the receiver's start; total = sum of the sinks' steady rates; "
            "engine s/1k = engine CPU per 1,000"
        )
        L.append(
            "   deliveries during the drain; flows/s in = loadgen's rate while the backlog was "
            "written (receivers down); failed = attempts while the receivers were down + after"
        )
        for d in dl:
            dr = d.get("drain")
            if not dr:
                continue
            mins = [r["steady_per_s"] for r in dr["per_sink"]]
            worst = min((x for x in mins if x is not None), default=None)
            L.append(
                f"   {d['sinks']} sink(s): slowest sink {f0(worst)} ev/s  target >= "
                f"{TARGET_EVENTS_PER_S:.0f}  "
                f"{ok(worst is not None and worst >= TARGET_EVENTS_PER_S)}"
                f"; backlog written at {d['backlog']['engine_cpu_us_per_flow']} us engine CPU/flow,"
                f" outbox {d.get('outbox_bytes', 0) / 1e6:.1f} MB "
                f"({f0(d.get('outbox_bytes_per_event'))} B/event)"
            )
            down, up = d.get("failed_while_down", []), d.get("failed_after_up", [])
            for i, (s, c) in enumerate(
                zip(d.get("sinks_final", []), d.get("ids", []), strict=False)
            ):
                flag = ("  <-- REPLAY GAPS" if s["replay_gaps"] else "") + (
                    "  <-- SEQUENCE GAPS AT THE RECEIVER" if c.get("seq_gaps") else ""
                )
                failed = f"{down[i]}+{up[i]}" if i < len(up) else str(s["total_failed"])
                L.append(
                    f"     {s['name']}: delivered {s['total_delivered']} failed {failed}"
                    f" replay_gaps {s['replay_gaps']} pending {s['pending']} | receiver "
                    f"{c.get('unique')} unique ids (seq {c.get('first_seq')}..{c.get('last_seq')},"
                    f" gaps {c.get('seq_gaps')}), {c.get('duplicates')} duplicates, unique - "
                    f"delivered = {c.get('unique_minus_delivered')}{flag}"
                )
            lv = d.get("live")
            if lv:
                L.append(
                    f"     live: {lv['flows_per_s']:.0f} flows/s for {lv['seconds']} s "
                    f"(~{lv['events_per_s_per_sink_offered']:.0f} ev/s/sink offered, no free "
                    f"slot {lv['paced_no_slot']}): pending max {lv['pending_max']} median "
                    f"{lv['pending_median']}, at end {lv['pending_at_end']}; drained "
                    f"{lv['drain_after_s']} s later; engine busy {lv['engine_cpu_share']} CPU -> "
                    f"{'bounded' if lv['bounded'] else 'NOT bounded (falls behind)'}"
                )
    u = res.get("conns")
    if u and "runs" in u:
        L.append("")
        L.append(
            f"2. Data-plane conn/s, concurrency {u['conc']}, {u['seconds']} s per run, loadgen "
            f"{u['loadgen_threads']} threads, in run order"
        )
        L.append(
            "   a = engine without sinks; b = engine with one webhook sink (the 4 flow events,"
            " outbox on, hookserver up)"
        )
        L.append(
            f"   {'run':<5}{'conn/s':>8}{'p50 ms':>8}{'p99 ms':>8}{'err':>5}{'eng us/flow':>12}"
            f"{'other':>7} |{'deliv/s':>9}{'pending@end':>12}{'catch-up s':>11}{'recv cpu':>9}"
        )
        for r in u["runs"]:
            lg = r["loadgen"]
            row = (
                f"   {r['kind'] + (' *' if r['disturbed'] else ''):<5}{r['conn_per_s']:>8.0f}"
                f"{lg['lat_us']['p50'] / 1000:>8.2f}{lg['lat_us']['p99'] / 1000:>8.2f}"
                f"{r['errors']:>5}{r['engine_cpu_us_per_flow'] or 0:>12.0f}"
                f"{r['other_cpu_s']:>7.2f} |"
            )
            if r["kind"] == "b":
                row += (
                    f"{r['delivered_per_s_in_run']:>9.0f}{r['pending_at_end']:>12}"
                    f"{r['catch_up_s']:>11.1f}{r['receiver_cpu_s']:>9.2f}"
                )
            elif r["kind"] == "c":
                row += (
                    f"{'w ' + format(r['written_per_s_in_run'], '.0f'):>9}"
                    f"{'+' + str(r['outbox_written_in_run']):>12}"
                )
            L.append(row.rstrip(" |"))
        drop = u.get("drop_pct_median")
        L.append(
            f"   median a {u['a']['median_conn_per_s']:.0f} / b {u['b']['median_conn_per_s']:.0f}"
            f" conn/s: ratio {u['ratio']}, drop {f1(drop)} %  (best-of drop "
            f"{f1(u['drop_pct_best'])} %)  target < {TARGET_DROP_PCT:.0f} %  "
            f"{ok(drop is not None and drop < TARGET_DROP_PCT)}"
        )
        L.append(
            f"   engine CPU per flow (median): a {u['a']['median_engine_us_per_flow']} us, b "
            f"{u['b']['median_engine_us_per_flow']} us"
            + (f", c {u['c']['median_engine_us_per_flow']} us" if "c" in u else "")
        )
        if "c" in u:
            L.append(
                f"   breakdown: c = the same sink with nothing listening (events written to the "
                f"outbox, none delivered): median {u['c']['median_conn_per_s']:.0f} conn/s, drop "
                f"{f1(u['c'].get('drop_pct_median'))} % vs a"
            )
        sf, c = u.get("sink_final"), u.get("ids") or {}
        if sf:
            L.append(
                f"   sink at the end: delivered {sf['total_delivered']} failed {sf['total_failed']}"
                f" pending {sf['pending']} replay_gaps {sf['replay_gaps']}"
                + ("  <-- REPLAY GAPS" if sf["replay_gaps"] else "")
                + f"; receiver {c.get('unique')} unique ids, {c.get('duplicates')} duplicates,"
                f" unique - delivered = {c.get('unique_minus_delivered')}"
            )
        L.append(
            "   deliv/s = the sink's total_delivered growth during the run / run time; "
            "pending@end = right after loadgen stopped;"
        )
        L.append(
            "   catch-up = until pending reached 0 (waited out before the next run); * = "
            "disturbed (left out of the medians)"
        )
        if "c" in u:
            L.append(
                "   c rows: w N = events written to the outbox per second, +N = its pending growth"
                " in the run"
            )
    notes = res.get("notes") or []
    if notes:
        L.append("")
        L.append("Notes:")
        L.extend(f"   - {n}" for n in notes)
    return "\n".join(L)


def collect_notes(res: dict) -> list[str]:
    notes: list[str] = []
    stops = dict(res.get("engine_stops") or {})
    for name, st in sorted(stops.items()):
        notes += e2e.stop_notes(st, f"{name}: ", "engine")
        if st.get("warning_count"):
            notes.append(
                f"{name}: {st['warning_count']} WARNING lines on stderr, e.g. "
                f"{st['warnings'][0][:200]!r}"
            )
    for d in res.get("deliveries") or []:
        k = d["sinks"]
        b = d.get("backlog") or {}
        if b and not b.get("steady"):
            notes.append(f"{k} sink(s): pending was still growing when the receivers started")
        if b.get("errors"):
            notes.append(f"{k} sink(s): {b['errors']} loadgen errors while building the backlog")
        dr = d.get("drain") or {}
        if dr and not dr.get("drained"):
            notes.append(
                f"{k} sink(s): the backlog did NOT drain within the limit ({dr['waited_s']} s); "
                f"pending {[s['pending'] for s in dr['sinks_after']]}"
            )
        for s in d.get("sinks_final") or []:
            if s["replay_gaps"]:
                notes.append(f"{k} sink(s): {s['name']} REPLAY_GAPS = {s['replay_gaps']}")
        for s, n in zip(d.get("sinks_final") or [], d.get("failed_after_up") or [], strict=False):
            if n:
                notes.append(
                    f"{k} sink(s): {s['name']} counted {n} failed deliveries after its receiver "
                    "was up"
                )
        for c in d.get("ids") or []:
            if c.get("seq_gaps"):
                notes.append(
                    f"{k} sink(s): a receiver misses {c['seq_gaps']} sequence numbers, e.g. "
                    f"{c['seq_gap_examples']}"
                )
            if c.get("duplicates"):
                notes.append(f"{k} sink(s): a receiver got {c['duplicates']} duplicate deliveries")
            if c.get("unique_minus_delivered"):
                notes.append(
                    f"{k} sink(s): a receiver's unique ids - engine total_delivered = "
                    f"{c['unique_minus_delivered']}"
                )
        miss = d.get("ids_missing_vs_union") or []
        if any(miss):
            notes.append(f"{k} sinks: ids missing per receiver vs the union of all: {miss}")
        lv = d.get("live")
        if lv and not lv["bounded"]:
            notes.append(f"{k} sink(s): live pending at the end of the load {lv['pending_at_end']}")
    u = res.get("conns") or {}
    for r in u.get("runs", []):
        if not r.get("pre_drained"):
            notes.append(f"conns: a run started before sink b had caught up ({r['kind']})")
        if r["kind"] == "b" and not r.get("caught_up"):
            notes.append("conns: sink b did not catch up after a run within the limit")
    sf = u.get("sink_final")
    if sf and sf["replay_gaps"]:
        notes.append(f"conns: sink REPLAY_GAPS = {sf['replay_gaps']}")
    c = u.get("ids") or {}
    if c.get("duplicates"):
        notes.append(f"conns: the receiver got {c['duplicates']} duplicate deliveries")
    if c.get("unique_minus_delivered"):
        notes.append(f"conns: unique ids - total_delivered = {c['unique_minus_delivered']}")
    busy = [r for r in u.get("runs", []) if r["disturbed"]]
    if busy:
        others: collections.Counter[str] = collections.Counter()
        for r in busy:
            for t in r.get("top_cpu", []):
                if not t["ours"]:
                    others[f"{t['name']} pid {t['pid']}"] += t["cpu_s"]
        top = ", ".join(f"{k} {v:.1f} s" for k, v in others.most_common(3))
        notes.append(
            f"{len(busy)} conn/s run(s) disturbed by other processes (>10% of the machine)"
            + (f"; biggest: {top}" if top else "")
        )
    return notes


# --------------------------------------------------------------------------- main


def start_run(a: argparse.Namespace, name: str) -> tuple[dict[str, Path], str, Path]:
    """What every connector-style benchmark does first: raise the fd limit, build the
    tools (tinyserver, loadgen, hookserver), and name the run: ``(tools, stamp, base)``
    with ``base`` = ``<out>/<stamp>-<name>``."""
    e2e.raise_nofile()
    tools = dict(e2e.build_tools(a.cc))
    tools["hookserver"] = build_hookserver(a.cc)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    a.out.mkdir(parents=True, exist_ok=True)
    return tools, stamp, a.out / f"{stamp}-{name}"


def publish_run(
    res: dict,
    base: Path,
    t_start: float,
    report: Callable[[dict], str],
    notes: Callable[[dict], list[str]],
) -> int:
    """Stamp the run's end, add its notes, print the report and write the results."""
    res["meta"]["loadavg_after"] = os.getloadavg()
    res["meta"]["elapsed_s"] = round(time.monotonic() - t_start, 1)
    res["notes"] = notes(res)
    e2e.publish(res, report(res), base)
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short runs (2-3 minutes)")
    ap.add_argument(
        "--only", default="deliveries,live,conns", help="comma list of deliveries,live,conns"
    )
    ap.add_argument("--sinks", default="1,4", help="sink counts for the deliveries part")
    ap.add_argument("--reps", type=int, help="a/b runs each in the conns part (default 3, quick 1)")
    ap.add_argument("--flows", type=int, help="backlog flows (default 40000, quick 5000)")
    ap.add_argument("--backlog-max-seconds", type=float, default=120.0)
    ap.add_argument(
        "--settle-timeout",
        type=float,
        default=120.0,
        help="wait at most this long for pending to stop growing",
    )
    ap.add_argument("--drain-timeout", type=float, help="default 300 s, quick 120 s")
    ap.add_argument("--live-rate", type=float, default=1000.0, help="flows/s in the live part")
    ap.add_argument("--live-seconds", type=float, help="default 10, quick 4")
    ap.add_argument("--conn-seconds", type=float, help="conns run length (default 5, quick 3)")
    ap.add_argument(
        "--tick-ms", type=int, default=100, help="hookserver's stats interval (drain timeline)"
    )
    ap.add_argument(
        "--breakdown",
        action=argparse.BooleanOptionalAction,
        help="conns also runs engine c: the same sink with nothing listening (outbox intake "
        "without deliveries); default on, off with --quick",
    )
    ap.add_argument("--loadgen-threads", type=int, default=2)
    ap.add_argument("--server-threads", type=int, default=2)
    ap.add_argument(
        "--outbox-dir",
        type=Path,
        default=None,
        help="where the outboxes go (default: the run's temporary directory)",
    )
    ap.add_argument("--keep-outbox", action="store_true")
    e2e.add_quiet_options(
        ap,
        budget_help="default 40 s, quick 10 s",
        retries_help="conn/s runs disturbed by other processes that may be repeated "
        "(default 4, quick 1)",
    )
    a = ap.parse_args(argv)
    q = a.quick
    a.only = {x.strip() for x in a.only.split(",") if x.strip()}
    bad = a.only - {"deliveries", "live", "conns"}
    if bad:
        ap.error(f"unknown --only part(s): {sorted(bad)}")
    if "live" in a.only:
        a.only.add("deliveries")  # live runs on the deliveries engine, after its drain
    a.sinks = [int(x) for x in a.sinks.split(",") if x.strip()]
    a.reps = a.reps or (1 if q else 3)
    a.flows = a.flows or (5000 if q else 40000)
    a.drain_timeout = a.drain_timeout or (120.0 if q else 300.0)
    a.live_seconds = a.live_seconds or (4.0 if q else 10.0)
    a.conn_seconds = a.conn_seconds or (3.0 if q else 5.0)
    if a.quiet_budget is None:
        a.quiet_budget = 10.0 if q else 40.0
    if a.breakdown is None:
        a.breakdown = not q
    if a.retries is None:
        a.retries = 1 if q else 4
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    tools, stamp, base = start_run(a, "connector")
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sw-bench-connector-") as tmpd:
        tmp = Path(tmpd)
        a.outbox_dir = a.outbox_dir.resolve() if a.outbox_dir else tmp
        res: dict = {
            "meta": {
                "timestamp": stamp,
                "quick": a.quick,
                "only": sorted(a.only),
                "sinks": a.sinks,
                "flows": a.flows,
                "reps": a.reps,
                "drain_timeout": a.drain_timeout,
                "live_rate": a.live_rate,
                "live_seconds": a.live_seconds,
                "conn_seconds": a.conn_seconds,
                "loadgen_threads": a.loadgen_threads,
                "server_threads": a.server_threads,
                "dispatcher": DISPATCHER,
                "outbox_fs": fs_type(a.outbox_dir.resolve()),
                **e2e.host_meta(),
                "git": e2e.git_info(),
                "loadavg_before": os.getloadavg(),
            }
        }
        b = Bench(a, tools, tmp)
        old_term = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
        try:
            b.server = e2e.Server(tools["tinyserver"], None, 3600, a.server_threads)
            if "deliveries" in a.only:
                res["deliveries"] = []
                for k in a.sinks:
                    log(f"1. deliveries with {k} sink(s) ...")
                    res["deliveries"].append(b.deliveries(k))
            if "conns" in a.only:
                log("3. data-plane conn/s with and without a sink ...")
                res["conns"] = b.conns()
        finally:
            b.close(base, res, old_term)
    return publish_run(res, base, t_start, report, collect_notes)


if __name__ == "__main__":
    sys.exit(main())
