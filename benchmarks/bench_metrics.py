#!/usr/bin/env python3
"""GET /metrics: scrape time and size with ~10,000 active flows and 20 policy groups, and the
data plane's conn/s with and without a Prometheus-style scrape every second.

    python benchmarks/bench_metrics.py [--quick] [--flows 10000] [--scrapes 50] [--reps 3]

The engine runs as its own process (``python -m spliceway run -c <tmp config>``, launched as
in run_e2e.py) with a socks5 inbound, the control API on 127.0.0.1 (no key) and 20 policy
groups: 5 ``url_test`` and 5 ``fallback`` groups probing a local HTTP origin that answers
204 (a ``hookserver --status 204``; interval 3600 s, so only the start-up round runs) and
10 selectors over them; ``route.final`` goes through ``sel-0`` -> ``ut-0`` -> a direct
outbound.  Measured:

1. **scrapes**: ``loadgen hold`` opens idle tunnels through the socks5 inbound to
   tinyserver's ``--idle`` echo listener in steps (``--ladder``, by default 0, 1/4, 1/2 and
   all of ``--flows``); at each step the sum of ``spliceway_flows_active`` must equal the
   tunnels open, then ``GET /metrics`` is scraped ``--scrapes`` times in each format (text
   0.0.4 and OpenMetrics 1.0.0, alternating, one keep-alive connection, 20 ms apart so the
   API's 100 queries/s limit is never hit): median / p95 / max latency (request sent to
   body read), body bytes, samples, and the engine's CPU per scrape.  The engine needs two
   fds per relayed flow; where the hard RLIMIT_NOFILE cannot be raised (20,000 on the
   shared machine, no CAP_SYS_RESOURCE) the top step is as many flows as fit (measured fds
   per flow, 64 fds of room), and the table shows it.
2. **conns**: a fresh engine with the same config; ``loadgen rate`` at concurrency 64
   (tinyserver's 100 B request / 1 KiB response, as in run_e2e.py), runs of ``--seconds``
   alternating a b b a a b ... (``--reps`` each): a = no scrapes, b = a scraper GETting
   /metrics once per second on a fixed schedule with a Prometheus-style Accept header that
   prefers OpenMetrics 1.0.0 (so the body is OpenMetrics).  Medians (of the undisturbed
   runs when both kinds have one), spread, the drop of b against a, the engine's CPU per
   flow, and the scrapes' latency during b.

Prints a table and writes benchmarks/results/<timestamp>-metrics.json (every run and
scrape series, the config, the git revision) and the engines' logs beside it.  Every
server listens on 127.0.0.1; every loop is bounded in count and time; only processes this
script started are stopped, by pid.  See benchmarks/README.md ("Metrics").
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om
from prometheus_client.parser import text_string_to_metric_families as parse_text

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import bench_connector as bn  # noqa: E402  (engine with control API, hookserver, loadgen, reap)
import bench_control as bc  # noqa: E402
import run_e2e as e2e  # noqa: E402  (build, tinyserver, hold, /proc, quiet waits, publish)
from run_e2e import log  # noqa: E402

FORMATS = {
    "text": "text/plain;version=0.0.4",
    "openmetrics": "application/openmetrics-text;version=1.0.0",
}
# A Prometheus-style scrape Accept header, OpenMetrics first (the scraper of part 2).
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)
FD_ROOM = 64  # fds left free in the engine besides the held flows


def engine_config(origin_port: int) -> dict:
    """socks5 inbound, control API, 5 url_test + 5 fallback + 10 selector groups."""
    url = f"http://127.0.0.1:{origin_port}/generate_204"
    outbounds = [{"tag": "direct", "protocol": "direct"}, {"tag": "block", "protocol": "block"}]
    outbounds += [{"tag": f"d{i}", "protocol": "direct"} for i in (1, 2, 3)]
    probe = {"url": url, "interval_seconds": 3600}
    groups = [
        {"tag": f"ut-{j}", "kind": "url_test", "outbounds": ["d1", "d2", "d3", "direct"], **probe}
        for j in range(5)
    ]
    groups += [
        {"tag": f"fb-{j}", "kind": "fallback", "outbounds": ["d1", "d2", "direct"], **probe}
        for j in range(5)
    ]
    groups += [
        {
            "tag": f"sel-{i}",
            "kind": "selector",
            "outbounds": [f"ut-{i % 5}", f"fb-{i % 5}", "direct", "block"],
        }
        for i in range(10)
    ]
    return {
        "inbounds": [e2e.socks_inbound()],
        "outbounds": outbounds,
        "outbound_groups": groups,
        "route": {"final": "sel-0"},
        "runtime": {"stats_interval_ms": 1000},
        "api": {"control": bc.control_api(), "ipc": {"enabled": False}},
    }


def stats_ms(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    v = sorted(values)
    return {
        "n": len(v),
        "median": round(statistics.median(v), 2),
        "p95": round(v[min(len(v) - 1, int(0.95 * len(v)))], 2),
        "max": round(v[-1], 2),
        "min": round(v[0], 2),
    }


class Scraper:
    """GET /metrics on one keep-alive connection (reopened when the server closes it)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: http.client.HTTPConnection | None = None

    def get(self, accept: str) -> tuple[int, float, bytes]:
        """(status, ms from sending the request to the end of the body, body)."""
        last: Exception | None = None
        for _ in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                self.conn.connect()
            t0 = time.perf_counter()
            try:
                self.conn.request("GET", "/metrics", headers={"Accept": accept})
                r = self.conn.getresponse()
                body = r.read()
            except (OSError, http.client.HTTPException) as ex:
                last = ex
                self.close()
                continue
            ms = 1000 * (time.perf_counter() - t0)
            if r.will_close:
                self.close()
            return r.status, ms, body
        raise SystemExit(f"GET /metrics failed twice: {last!r}")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def parse_body(fmt: str, body: bytes) -> dict:
    """Families, samples, and the sum of spliceway_flows_active in one scrape body."""
    fams = list((parse_om if fmt == "openmetrics" else parse_text)(body.decode()))
    active = sum(s.value for f in fams if f.name == "spliceway_flows_active" for s in f.samples)
    return {
        "families": len(fams),
        "samples": sum(len(f.samples) for f in fams),
        "flows_active_sum": int(active),
    }


class Origin:
    """The url_test/fallback groups' probe origin: a hookserver answering 204 to anything."""

    def __init__(self, exe: Path) -> None:
        cmd = [str(exe), "--port", "0", "--status", "204", "--seconds", "3600"]
        cmd += ["--tick-ms", "3600000"]  # no stats lines: nothing reads its stdout later
        self.m = e2e.Managed("origin-204", cmd, stdout=subprocess.PIPE)
        self.pid = self.m.pid
        line = e2e.read_line(self.m.proc, 10)
        if not line or not line.startswith("port "):
            self.m.stop(2)
            raise SystemExit(f"the probe origin did not start: {line!r}")
        self.port = int(line.split()[1])
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            c.request("HEAD", "/generate_204")
            status = c.getresponse().status
        finally:
            c.close()
        if status != 204:
            self.m.stop(2)
            raise SystemExit(f"the probe origin answered {status}, not 204")

    def stop(self) -> None:
        self.m.stop(3)


class Bench(bn.Bench):
    """bench_connector's process bookkeeping (engines, hookservers, loadgens, tinyserver)."""

    def __init__(self, args: argparse.Namespace, tools: dict[str, Path], tmp: Path) -> None:
        super().__init__(args, tools, tmp)
        self.holds: list[subprocess.Popen] = []
        self.origin: Origin | None = None

    def our_pids(self) -> list[int]:
        return super().our_pids() + ([self.origin.pid] if self.origin else [])

    def reap(self) -> None:
        for p in list(self.holds):
            e2e.stop_child(p, 10)
        super().reap()
        if self.origin is not None:
            self.origin.stop()

    def flows_active(self, e: bn.Engine) -> int:
        status, _, body = Scraper(e.api_port).get(FORMATS["text"])
        return parse_body("text", body)["flows_active_sum"] if status == 200 else -1

    def hold(self, e: bn.Engine, conns: int) -> tuple[subprocess.Popen, dict]:
        assert self.server is not None
        loadgen = [str(self.tools["loadgen"])]
        p = e2e.start_hold(loadgen, self.server.idle, e.socks_port, conns, 1200, 10000, 128)
        self.holds.append(p)
        first = e2e.read_json_line(p, 180)
        if first is None:
            raise SystemExit(f"loadgen hold ({conns} tunnels) did not report")
        return p, first

    def release(self, p: subprocess.Popen) -> dict:
        """Close a hold's tunnels (a line on its stdin); its second JSON line."""
        second: dict = {}
        try:
            assert p.stdin is not None
            p.stdin.write("\n")
            p.stdin.flush()
            out, _ = p.communicate(timeout=60)
            lines = [x for x in out.strip().splitlines() if x.startswith("{")]
            second = json.loads(lines[-1]) if lines else {}
        except (OSError, subprocess.TimeoutExpired):
            e2e.stop_child(p, 5)
        self.holds.remove(p)
        return second

    def wait_policies_probed(self, e: bn.Engine, timeout: float = 30.0) -> dict:
        """Until every probed group's members have been checked once."""
        end = time.monotonic() + timeout
        while True:
            pols = e.result(f"{bc.API}/policies")["policies"]
            probed = [p for p in pols if p["kind"] in ("url_test", "fallback")]
            members = [m for p in probed for m in p.get("url_test_members") or []]
            done = [m for m in members if m.get("last_checked_unix_ms")]
            if (members and len(done) == len(members)) or time.monotonic() > end:
                return {
                    "groups": len(pols),
                    "kinds": dict(collections.Counter(p["kind"] for p in pols)),
                    "probed_members": len(members),
                    "checked": len(done),
                    "healthy": sum(1 for m in members if m.get("healthy")),
                }
            time.sleep(0.5)

    # ------------------------------------------------------------------ 1. scrapes

    def scrape_series(self, e: bn.Engine, n: int) -> dict:
        sc = Scraper(e.api_port)
        lat: dict[str, list[float]] = {f: [] for f in FORMATS}
        size: dict[str, list[int]] = {f: [] for f in FORMATS}
        bad: dict[str, dict[int, int]] = {f: {} for f in FORMATS}
        last: dict[str, bytes] = {}
        m0, k0, o0 = e2e.machine_cpu()[0], e2e.kernel_threads_cpu(), self.our_cpu()
        c0, pt0 = e.cpu(), e2e.proc_table()
        t0 = time.monotonic()
        for i in range(n):
            order = list(FORMATS) if i % 2 == 0 else list(FORMATS)[::-1]
            for fmt in order:
                status, ms, body = sc.get(FORMATS[fmt])
                if status != 200:
                    bad[fmt][status] = bad[fmt].get(status, 0) + 1
                    time.sleep(1.0)
                    continue
                lat[fmt].append(ms)
                size[fmt].append(len(body))
                last[fmt] = body
                time.sleep(self.a.gap_ms / 1000)
        wall = time.monotonic() - t0
        cpu, pt1 = e.cpu() - c0, e2e.proc_table()
        m1, k1, o1 = e2e.machine_cpu()[0], e2e.kernel_threads_cpu(), self.our_cpu()
        other = max(0.0, (m1 - m0) - (o1 - o0) - (k1 - k0))
        sc.close()
        out: dict = {
            "scrapes_per_format": n,
            "wall_s": round(wall, 2),
            "other_cpu_s": round(other, 2),
            "disturbed": e2e.others_busy(other, wall),
            "top_cpu": e2e.top_cpu(pt0, pt1, {os.getpid(), *self.our_pids()}),
        }
        for fmt in FORMATS:
            out[fmt] = {
                "latency_ms": stats_ms(lat[fmt]),
                "bytes": statistics.median(size[fmt]) if size[fmt] else None,
                "bytes_min_max": [min(size[fmt]), max(size[fmt])] if size[fmt] else None,
                "non_200": bad[fmt],
                **(parse_body(fmt, last[fmt]) if fmt in last else {}),
            }
        ok = sum(len(v) for v in lat.values())
        out["engine_cpu_s"] = round(cpu, 3)
        out["engine_cpu_ms_per_scrape"] = round(1000 * cpu / ok, 2) if ok else None
        return out

    def fd_probe(self, e: bn.Engine) -> dict:
        """fds the engine holds per relayed flow (200 tunnels), and how many flows fit."""
        base = e2e.proc_fds(e.pid)
        p, first = self.hold(e, 200)
        with_flows = e2e.proc_fds(e.pid)
        self.release(p)
        time.sleep(1.0)
        est = first.get("established") or 0
        per = (with_flows - base) / est if est else 2.0
        if abs(per - round(per)) < 0.1:  # a stray fd (API connection, timer) in the sample
            per = float(round(per))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        limit = engine_nofile(e.pid) or soft
        fit = int((limit - base - FD_ROOM) // max(per, 1.0))
        return {
            "fds_idle": base,
            "fds_with_200": with_flows,
            "fds_per_flow": round(per, 3),
            "engine_nofile": limit,
            "flows_that_fit": fit,
        }

    def scrapes(self, origin: Origin) -> dict:
        a = self.a
        cfg = engine_config(origin.port)
        e = self.engine("engine-scrape", cfg)
        out: dict = {"config": cfg}
        holds: list[subprocess.Popen] = []
        try:
            out["policies"] = self.wait_policies_probed(e)
            log(f"  policies: {out['policies']}")
            out["fd_probe"] = fdp = self.fd_probe(e)
            top = min(a.flows, fdp["flows_that_fit"])
            out["flows_asked"], out["flows_top"] = a.flows, top
            if top < a.flows:
                log(
                    f"  the engine's fd limit {fdp['engine_nofile']} holds {fdp['flows_that_fit']} "
                    f"flows at {fdp['fds_per_flow']} fds each: top step {top} instead of {a.flows}"
                )
            ladder = sorted({min(top, x) for x in a.ladder} | {top})
            steps, open_now = [], 0
            for target in ladder:
                info: dict = {"target": target}
                if target > open_now:
                    t0 = time.monotonic()
                    p, first = self.hold(e, target - open_now)
                    holds.append(p)
                    info["hold"] = first
                    info["ramp_s"] = round(time.monotonic() - t0, 2)
                    open_now += first.get("established") or 0
                # flows_active must equal the tunnels open (bounded wait for the engine)
                end, seen = time.monotonic() + 30, -1
                while time.monotonic() < end:
                    seen = self.flows_active(e)
                    if seen == open_now:
                        break
                    time.sleep(0.5)
                info.update(
                    open_tunnels=open_now,
                    flows_active_sum=seen,
                    flows_active_matches=seen == open_now,
                    engine_rss_kib=e2e.proc_rss_kib(e.pid),
                    engine_fds=e2e.proc_fds(e.pid),
                    engine_threads=e2e.proc_threads(e.pid),
                )
                info["scrape"] = s = self.scrape_series(e, a.scrapes)
                steps.append(info)
                log(
                    f"  {open_now} flows (flows_active {seen}): text "
                    f"{s['text']['latency_ms'].get('median')} ms median "
                    f"{s['text']['latency_ms'].get('p95')} p95, {s['text']['bytes']} B, "
                    f"{s['text'].get('samples')} samples; openmetrics "
                    f"{s['openmetrics']['latency_ms'].get('median')} ms; engine "
                    f"{s['engine_cpu_ms_per_scrape']} ms CPU/scrape"
                )
            out["steps"] = steps
            out["released"] = [self.release(p) for p in holds]
            holds = []
            out["fit"] = linear_fit(
                [(st["open_tunnels"], st["scrape"]["text"]["latency_ms"]["median"]) for st in steps]
            )
        finally:
            for p in holds:
                if p in self.holds:
                    self.release(p)
            out["engine_stop"] = self.stop_engine(e)
        return out

    # ------------------------------------------------------------------ 2. conns

    def rate_run(self, e: bn.Engine, kind: str, secs: float) -> dict:
        a = self.a
        waited, before = self.quiet() if a.quiet_wait > 0 else (0.0, -1.0)
        e.wait_idle()
        scrapes: list[tuple[float, int, int]] = []
        stop = threading.Event()

        def scraper() -> None:
            sc, t0 = Scraper(e.api_port), time.monotonic()
            k = 0
            while not stop.is_set() and k < secs + 30:
                status, ms, body = sc.get(PROMETHEUS_ACCEPT)
                scrapes.append((ms, status, len(body)))
                k += 1
                stop.wait(max(0.0, t0 + k * a.scrape_interval - time.monotonic()))
            sc.close()

        th = threading.Thread(target=scraper, daemon=True) if kind == "b" else None
        m0, k0, o0 = e2e.machine_cpu()[0], e2e.kernel_threads_cpu(), self.our_cpu()
        c0, pt0 = e.cpu(), e2e.proc_table()
        if th:
            th.start()
        lg = self.loadgen(self.rate_argv(e, 64, secs), secs + 60)
        stop.set()
        if th:
            th.join(35)
        c1, pt1 = e.cpu(), e2e.proc_table()
        m1, k1, o1 = e2e.machine_cpu()[0], e2e.kernel_threads_cpu(), self.our_cpu()
        other = max(0.0, (m1 - m0) - (o1 - o0) - lg["cpu_s"] - (k1 - k0))
        wall = lg["seconds"] or secs
        res = {
            "kind": kind,
            "loadgen": lg,
            "conn_per_s": lg["conn_per_s"],
            "errors": sum(lg["errors"].values()),
            "engine_cpu_s": round(c1 - c0, 3),
            "engine_cpu_us_per_flow": round(1e6 * (c1 - c0) / lg["count"], 1)
            if lg["count"]
            else None,
            "other_cpu_s": round(other, 3),
            "top_cpu": e2e.top_cpu(pt0, pt1, {os.getpid(), *self.our_pids()}),
            "quiet_wait_s": round(waited, 2),
            "other_share_before": round(before, 3),
            "disturbed": e2e.others_busy(other, wall),
        }
        if kind == "b":
            res["scrapes"] = len(scrapes)
            res["scrape_status"] = sorted({s for _, s, _ in scrapes})
            res["scrape_ms"] = stats_ms([ms for ms, s, _ in scrapes if s == 200])
            res["scrape_bytes"] = statistics.median(b for _, _, b in scrapes) if scrapes else None
        return res

    def conns(self, origin: Origin) -> dict:
        a = self.a
        cfg = engine_config(origin.port)
        e = self.engine("engine-conns", cfg)
        out: dict = {"seconds": a.seconds, "conc": 64, "loadgen_threads": a.loadgen_threads}
        try:
            self.wait_policies_probed(e)
            w = self.loadgen(self.rate_argv(e, 16, 1.0), 40)
            log(f"  warm-up: {w['conn_per_s']:.0f} conn/s")
            plan = [
                k for rep in range(a.reps) for k in (("a", "b") if rep % 2 == 0 else ("b", "a"))
            ]
            runs: list[dict] = []
            budget = e2e.RetryBudget(a.retries)
            for kind in plan:
                for r in budget.runs(lambda kind=kind: self.rate_run(e, kind, a.seconds)):
                    runs.append(r)
                    lat = r["loadgen"]["lat_us"]
                    extra = (
                        f"  scrapes {r['scrapes']} {r['scrape_status']} median "
                        f"{r['scrape_ms'].get('median')} ms max {r['scrape_ms'].get('max')} ms"
                        if kind == "b"
                        else ""
                    )
                    log(
                        f"  ({kind}) {r['conn_per_s']:8.0f} conn/s p50={lat['p50']:.0f}us "
                        f"p99={lat['p99']:.0f}us engine {r['engine_cpu_us_per_flow']} us/flow "
                        f"other={r['other_cpu_s']:.2f}s{extra}"
                        + ("  (disturbed)" if r["disturbed"] else "")
                    )
            out["runs"] = runs
            clean_only = all(any(r["kind"] == k and not r["disturbed"] for r in runs) for k in "ab")
            out["undisturbed_only"] = clean_only
            for kind in "ab":
                rs = [r for r in runs if r["kind"] == kind]
                use = e2e.undisturbed(rs) if clean_only else rs
                vals = [r["conn_per_s"] for r in use]
                out[kind] = {
                    "median_conn_per_s": round(statistics.median(vals), 1),
                    "spread_pct": round(e2e.spread(vals), 1),
                    "runs": len(rs),
                    "runs_used": len(use),
                    "median_engine_us_per_flow": round(
                        statistics.median(r["engine_cpu_us_per_flow"] or 0 for r in use), 1
                    ),
                    "p50_us": statistics.median(r["loadgen"]["lat_us"]["p50"] for r in use),
                    "p99_us": statistics.median(r["loadgen"]["lat_us"]["p99"] for r in use),
                    "errors": sum(r["errors"] for r in rs),
                }
            ma, mb = out["a"]["median_conn_per_s"], out["b"]["median_conn_per_s"]
            out["drop_pct"] = round(100.0 * (1 - mb / ma), 1) if ma else None
            bs = [r for r in runs if r["kind"] == "b"]
            out["scrape_ms_all_b"] = stats_ms(
                [x for r in bs for x in [r["scrape_ms"].get("median")] if x is not None]
            )
            out["scrape_max_ms_b"] = (
                max((r["scrape_ms"].get("max") or 0) for r in bs) if bs else None
            )
        finally:
            out["engine_stop"] = self.stop_engine(e)
        return out


def engine_nofile(pid: int) -> int | None:
    """The soft 'Max open files' of a running process."""
    try:
        with open(f"/proc/{pid}/limits") as f:
            for line in f:
                if line.startswith("Max open files"):
                    return int(line.split()[3])
    except (OSError, ValueError, IndexError):
        pass
    return None


def linear_fit(points: list[tuple[int, float | None]]) -> dict | None:
    """Least squares ms = a + b * flows over the steps (for the 10,000-flow figure when
    fewer fit)."""
    pts = [(x, y) for x, y in points if y is not None]
    if len(pts) < 2:
        return None
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if not sxx:
        return None
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    a0 = my - b * mx
    return {
        "ms_at_0": round(a0, 3),
        "ms_per_1k_flows": round(1000 * b, 3),
        "ms_at_10k_extrapolated": round(a0 + 10000 * b, 2),
    }


# --------------------------------------------------------------------------- report


def report(res: dict) -> str:
    meta = res["meta"]
    L = bc.header("GET /metrics", meta)
    s = res.get("scrapes")
    if s:
        fdp = s["fd_probe"]
        L += [
            "",
            f"1. GET /metrics with idle relayed flows and {s['policies']['groups']} policy groups "
            f"{s['policies']['kinds']} ({s['policies']['probed_members']} probed members, "
            f"{s['policies']['healthy']} healthy); {meta['scrapes']} scrapes per format per step, "
            f"keep-alive, {meta['gap_ms']} ms apart",
            f"   engine fds: {fdp['fds_idle']} idle, {fdp['fds_per_flow']} per flow; "
            f"RLIMIT_NOFILE {fdp['engine_nofile']} -> {fdp['flows_that_fit']} flows fit"
            + (
                f" (asked {s['flows_asked']}: top step {s['flows_top']})"
                if s["flows_top"] < s["flows_asked"]
                else ""
            ),
            f"   {'flows':>6} {'active':>7} | {'format':<12}{'median ms':>10}{'p95 ms':>8}"
            f"{'max ms':>8}{'bytes':>8}{'samples':>8} | {'eng CPU ms/scrape':>17}{'RSS MiB':>8}"
            f"{'other s':>8}",
        ]
        for st in s["steps"]:
            sc = st["scrape"]
            for i, fmt in enumerate(FORMATS):
                f = sc[fmt]
                lat = f["latency_ms"]
                head = (
                    f"   {st['open_tunnels']:>6} {st['flows_active_sum']:>7}"
                    + ("" if st["flows_active_matches"] else "!")
                    if i == 0
                    else f"   {'':>6} {'':>7}"
                )
                tail = (
                    f"{sc['engine_cpu_ms_per_scrape']:>17}{st['engine_rss_kib'] / 1024:>8.0f}"
                    f"{sc['other_cpu_s']:>7.1f}{'*' if sc['disturbed'] else ''}"
                    if i == 0
                    else ""
                )
                L.append(
                    f"{head} | {fmt:<12}{lat.get('median'):>10}{lat.get('p95'):>8}"
                    f"{lat.get('max'):>8}{f['bytes']:>8.0f}{f.get('samples'):>8} | {tail}"
                )
        fit = s.get("fit")
        if fit:
            L.append(
                f"   text median vs flows (least squares over the steps): {fit['ms_at_0']} ms + "
                f"{fit['ms_per_1k_flows']} ms per 1,000 flows -> {fit['ms_at_10k_extrapolated']}"
                " ms at 10,000 (extrapolated)"
            )
        L.append(
            "   active = sum of spliceway_flows_active in the scrape (! = differs from the open "
            "tunnels); eng CPU = the engine's CPU over the step's scrapes / scrapes; other s = "
            "CPU of other processes during the step (* = over 10 % of the machine)"
        )
    u = res.get("conns")
    if u and "runs" in u:
        L += [
            "",
            f"2. Data-plane conn/s, loadgen rate concurrency {u['conc']}, {u['seconds']} s per run,"
            f" {meta['reps']} rep(s) each, a b b a ...; b = GET /metrics every "
            f"{meta['scrape_interval']} s (Accept prefers OpenMetrics)",
            f"   {'run':<5}{'conn/s':>9}{'p50 ms':>8}{'p99 ms':>8}{'err':>5}{'eng us/flow':>12}"
            f"{'other s':>8} | scrapes (median / max ms)",
        ]
        for r in u["runs"]:
            lat = r["loadgen"]["lat_us"]
            row = (
                f"   {r['kind'] + (' *' if r['disturbed'] else ''):<5}{r['conn_per_s']:>9.0f}"
                f"{lat['p50'] / 1000:>8.2f}{lat['p99'] / 1000:>8.2f}{r['errors']:>5}"
                f"{r['engine_cpu_us_per_flow'] or 0:>12.0f}{r['other_cpu_s']:>8.2f} |"
            )
            if r["kind"] == "b":
                row += (
                    f" {r['scrapes']} {r['scrape_status']} {r['scrape_ms'].get('median')} / "
                    f"{r['scrape_ms'].get('max')}"
                )
            L.append(row.rstrip(" |"))
        ua, ub = u["a"], u["b"]
        L.append(
            f"   median a {ua['median_conn_per_s']:.0f} (spread {ua['spread_pct']} %, "
            f"{ua['median_engine_us_per_flow']} us/flow) / b {ub['median_conn_per_s']:.0f} (spread "
            f"{ub['spread_pct']} %, {ub['median_engine_us_per_flow']} us/flow): drop "
            f"{bc.f1(u['drop_pct'])} %  ("
            + ("undisturbed runs" if u["undisturbed_only"] else "all runs, some disturbed")
            + "; * = disturbed)"
        )
    L.extend(e2e.notes_section(res))
    return "\n".join(L)


def collect_notes(res: dict) -> list[str]:
    notes: list[str] = []
    s = res.get("scrapes") or {}
    for st in s.get("steps", []):
        if not st["flows_active_matches"]:
            notes.append(
                f"{st['open_tunnels']} tunnels open but flows_active summed to "
                f"{st['flows_active_sum']}"
            )
        h = st.get("hold") or {}
        if h and any(h.get("errors", {}).values()):
            notes.append(f"hold step {st['target']}: loadgen errors {h['errors']}")
        for fmt in FORMATS:
            if st["scrape"][fmt]["non_200"]:
                notes.append(f"{st['target']} flows, {fmt}: non-200 {st['scrape'][fmt]['non_200']}")
    busy_steps = [st["open_tunnels"] for st in s.get("steps", []) if st["scrape"]["disturbed"]]
    if busy_steps:
        notes.append(f"scrape steps disturbed by other processes (flows): {busy_steps}")
    for rel in s.get("released", []):
        if rel.get("dropped"):
            notes.append(f"{rel['dropped']} held tunnels dropped while idle")
    u = res.get("conns") or {}
    busy = [r for r in u.get("runs", []) if r["disturbed"]]
    if busy:
        notes.append(
            f"{len(busy)}/{len(u['runs'])} conn/s runs disturbed by other processes (>10% of the "
            "machine); biggest others: "
            + ", ".join(
                sorted(
                    {f"{t['name']}" for r in busy for t in r.get("top_cpu", []) if not t["ours"]}
                )[:6]
            )
        )
    for r in u.get("runs", []):
        if r["errors"]:
            notes.append(f"({r['kind']}) run: loadgen errors {r['loadgen']['errors']}")
    for name, st in sorted((res.get("engine_stops") or {}).items()):
        notes += e2e.stop_notes(st, f"{name}: ", "engine")
    return notes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2,000 flows, 20 scrapes, 1 rep of 3 s")
    ap.add_argument("--only", default="scrapes,conns", help="comma list of scrapes,conns")
    ap.add_argument("--flows", type=int, help="idle flows at the top step (default 10000)")
    ap.add_argument("--ladder", help="flow counts to scrape at (default 0,F/4,F/2,F)")
    ap.add_argument("--scrapes", type=int, help="scrapes per format per step (default 50)")
    ap.add_argument("--gap-ms", type=float, default=20.0, help="pause between scrapes")
    ap.add_argument("--reps", type=int, help="a and b runs each (default 3, quick 1)")
    ap.add_argument("--seconds", type=float, help="seconds per conn/s run (default 5, quick 3)")
    ap.add_argument("--scrape-interval", type=float, default=1.0)
    ap.add_argument("--loadgen-threads", type=int, default=2)
    ap.add_argument("--server-threads", type=int, default=2)
    e2e.add_quiet_options(
        ap,
        budget_help="default 40 s, quick 10 s",
        retries_help="disturbed runs repeated (default 4, quick 1)",
    )
    a = ap.parse_args(argv)
    q = a.quick
    a.only = {x.strip() for x in a.only.split(",") if x.strip()}
    if a.only - {"scrapes", "conns"}:
        ap.error(f"unknown --only part(s): {sorted(a.only - {'scrapes', 'conns'})}")
    a.flows = a.flows or (2000 if q else 10000)
    a.ladder = (
        [int(x) for x in a.ladder.split(",")]
        if a.ladder
        else [0, a.flows // 4, a.flows // 2, a.flows]
    )
    a.scrapes = a.scrapes or (20 if q else 50)
    a.reps = a.reps or (1 if q else 3)
    a.seconds = a.seconds or (3.0 if q else 5.0)
    a.quiet_budget = a.quiet_budget if a.quiet_budget is not None else (10.0 if q else 40.0)
    a.retries = a.retries if a.retries is not None else (1 if q else 4)
    a.tick_ms = 1000  # hookserver's stats interval (bench_connector.Bench.hook)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    tools, stamp, base = bn.start_run(a, "metrics")
    t_start = time.monotonic()
    res: dict = {
        "meta": {
            "timestamp": stamp,
            "quick": a.quick,
            "only": sorted(a.only),
            "flows": a.flows,
            "ladder": a.ladder,
            "scrapes": a.scrapes,
            "gap_ms": a.gap_ms,
            "reps": a.reps,
            "seconds": a.seconds,
            "scrape_interval": a.scrape_interval,
            "formats": FORMATS,
            "prometheus_accept": PROMETHEUS_ACCEPT,
            "loadgen_threads": a.loadgen_threads,
            "server_threads": a.server_threads,
            "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
            **e2e.host_meta(),
            "git": e2e.git_info(),
            "loadavg_before": os.getloadavg(),
        }
    }
    with tempfile.TemporaryDirectory(prefix="sw-bench-metrics-") as tmpd:
        b = Bench(a, tools, Path(tmpd))
        old_term = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
        try:
            b.server = e2e.Server(tools["tinyserver"], None, 3600, a.server_threads)
            origin = b.origin = Origin(tools["hookserver"])
            if "scrapes" in a.only:
                log(f"1. scrapes with up to {a.flows} idle flows ...")
                res["scrapes"] = b.scrapes(origin)
            if "conns" in a.only:
                log("2. conn/s without and with a scrape every second ...")
                res["conns"] = b.conns(origin)
        finally:
            b.close(base, res, old_term)
    return bn.publish_run(res, base, t_start, report, collect_notes)


if __name__ == "__main__":
    sys.exit(main())
