#!/usr/bin/env python3
"""Data-plane conn/s under control-plane load: alone, with SSE streams and stats polling, with a
webhook sink.

    python benchmarks/bench_control_load.py [--quick] [--reps N] [--seconds S] [--sink-outbox]

``loadgen rate`` at concurrency 64 (tinyserver's 100 B request / 1 KiB response, as in
run_e2e.py) through spliceway's socks5 inbound, in three situations, all in one run:

(a) **alone**: engine A (control API on, idle, no sink);
(b) **SSE + stats**: engine A with 5 ``GET /api/v1/events/stream`` streams of every event
    type open, each read to the end by its own process (bench_control.py's raw-socket
    reader: it only ``recv()``s during the run, parses afterwards), and one process
    sending ``GET /api/v1/stats`` at 50/s on a keep-alive connection
    (``bench_control.Bench.load_run``);
(c) **webhook sink**: engine C, the same config plus one webhook sink subscribed to every
    flow event (flow.started, flow.routed, flow.updated, flow.completed) posting to a
    hookserver (C, epoll, answers 200 at once) on 127.0.0.1; in-memory queue (the default
    ``api.outbox_path: null``; ``--sink-outbox`` puts a durable outbox in the run's
    temporary directory instead).  Before each run the sink has caught up (pending 0),
    so a drain never overlaps a measurement (``bench_connector.Bench.conn_run``).

Runs are interleaved a b c, c b a, a b c, ... (``--reps``, default 5, quick 3); a run that
other processes disturbed (> 10 % of the machine's CPU) is repeated while ``--retries``
lasts and left out of the medians when clean runs exist.  Reported: the median conn/s of
each situation and its ratio to (a)'s median, p50/p99, the engine's CPU per flow, and
for (b) the stats requests' latency and the streams' latency / losses, for (c) the sink's
deliveries/s during the run, pending at its end, catch-up time and replay gaps.

Prints a table and writes benchmarks/results/<timestamp>-control-load.json with every run
and both engines' logs beside it.  Every server listens on 127.0.0.1; every loop is
bounded in count and time; only processes this script started are stopped, by pid.
See benchmarks/README.md ("Control-plane load").
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import bench_connector as bn  # noqa: E402  (hookserver, sink polling, conn_run)
import bench_control as bc  # noqa: E402  (engine with control API, SSE/stats clients, load_run)
import run_e2e as e2e  # noqa: E402  (build, tinyserver, /proc, quiet waits)
from run_e2e import log  # noqa: E402

KINDS = {
    "a": "(a) alone",
    "b": f"(b) {bc.SSE_STREAMS} SSE streams + GET /stats at 50/s",
    "c": "(c) webhook sink on every flow event",
}


def engine_config(sinks: list[dict], outbox: Path | None, ring: int) -> dict:
    """socks5 inbound, direct, the control API on 127.0.0.1 (no key), and ``sinks``."""
    api: dict = {"control": bc.control_api(), "ipc": {"enabled": False}}
    if sinks:
        api["event_sinks"] = sinks
        api["dispatcher"] = bn.DISPATCHER
        if outbox is not None:
            api.update(outbox_path=str(outbox), outbox_min_free_bytes=0, outbox_min_free_percent=0)
    return {
        "inbounds": [e2e.socks_inbound()],
        "outbounds": [{"tag": "direct", "protocol": "direct"}],
        "runtime": {"stats_interval_ms": 1000, "event_ring_capacity": ring},
        "api": api,
    }


def describe(r: dict) -> str:
    lat = r["loadgen"]["lat_us"]
    line = (
        f"  ({r['kind']}) {r['conn_per_s']:8.0f} conn/s  p50={lat['p50']:.0f}us "
        f"p99={lat['p99']:.0f}us  engine {r['engine_cpu_us_per_flow']} us/flow "
        f"other_cpu={r['other_cpu_s']:.2f}s"
    )
    if "stats_client" in r:
        sc = r["stats_client"]
        line += f"  stats p50={sc['latency_ms']['p50']}ms status={sc['status']}"
    if "sse" in r:
        line += f"  sse p99={r['sse']['all']['p99']}ms closed_early={r['sse']['closed_early']}"
    if "delivered_per_s_in_run" in r:
        line += (
            f"  delivered {r['delivered_per_s_in_run']:.0f}/s pending_at_end="
            f"{r['pending_at_end']} catch_up={r['catch_up_s']}s"
        )
    return line + ("  (disturbed)" if r["disturbed"] else "")


def summarise(runs: list[dict]) -> dict:
    """Median per situation: of the undisturbed runs when every situation has one, else of
    every run (a clean run of one is never set against disturbed runs of another)."""
    out: dict = {}
    kinds = [k for k in KINDS if any(r["kind"] == k for r in runs)]
    clean_only = all(any(r["kind"] == k and not r["disturbed"] for r in runs) for k in kinds)
    for kind in kinds:
        rs = [r for r in runs if r["kind"] == kind]
        clean = e2e.undisturbed(rs) if clean_only else rs
        vals = [r["conn_per_s"] for r in clean]
        mid = sorted(clean, key=lambda r: r["conn_per_s"])[len(clean) // 2]
        out[kind] = {
            "median_conn_per_s": round(statistics.median(vals), 1),
            "best_conn_per_s": round(max(vals), 1),
            "spread_pct": round(e2e.spread(vals), 1),
            "runs": len(rs),
            "runs_used": len(clean),
            "all_disturbed": all(r["disturbed"] for r in rs),
            "undisturbed_only": clean_only,
            "p50_us": mid["loadgen"]["lat_us"]["p50"],
            "p99_us": mid["loadgen"]["lat_us"]["p99"],
            "errors": sum(sum(r["loadgen"]["errors"].values()) for r in rs),
            "engine_us_per_flow": round(
                statistics.median(r["engine_cpu_us_per_flow"] or 0 for r in clean), 1
            ),
        }
    base = out.get("a", {}).get("median_conn_per_s")
    for s in out.values():
        s["ratio"] = round(s["median_conn_per_s"] / base, 3) if base else None
    return out


def report(res: dict) -> str:
    meta, summ, runs = res["meta"], res.get("summary", {}), res.get("runs", [])
    lines = [
        f"spliceway conn/s under control-plane load  {meta['timestamp']}  "
        f"({'quick' if meta['quick'] else 'full'} run)",
        f"machine: {meta['nproc']} CPUs ({meta['cpu_model']}), kernel {meta['kernel']}, "
        f"loadavg {' '.join(f'{x:.2f}' for x in meta['loadavg_before'])}",
        f"git: {meta['git']}; engines launched as {meta.get('launch', '?')}",
        "",
        f"loadgen rate, concurrency 64, {meta['seconds']} s per run, {meta['reps']} rep(s) "
        "interleaved a b c / c b a; medians of the undisturbed runs if every situation has "
        "one, else of all runs",
        f"   {'situation':<44}{'conn/s':>9}{'x (a)':>8}{'spread%':>9}{'runs':>6}"
        f"{'p50/p99 ms':>14}{'engine us/flow':>16}",
    ]
    for kind, label in KINDS.items():
        s = summ.get(kind)
        if not s:
            continue
        mark = ("*" if s["all_disturbed"] else "") + ("!" if s["errors"] else "")
        ratio = f"{s['ratio']:.2f}x" if s["ratio"] is not None else "-"
        lines.append(
            f"   {label:<44}{s['median_conn_per_s']:>8.0f}{mark:1}{ratio:>8}"
            f"{s['spread_pct']:>9.0f}{s['runs_used']:>6}"
            f"{s['p50_us'] / 1000:>8.1f}/{s['p99_us'] / 1000:<5.1f}{s['engine_us_per_flow']:>16.0f}"
        )
    lines.append("   (* every run disturbed by other processes; ! loadgen errors, see Notes)")
    bs = [r for r in runs if r["kind"] == "b"]
    if bs:
        lines.append("")
        lines.append("(b) per run: stats requests (50/s) and the SSE streams (every event type)")
        for r in bs:
            sc, sse = r.get("stats_client", {}), r.get("sse", {})
            lat = sc.get("latency_ms", {})
            lines.append(
                f"   {r['conn_per_s']:8.0f} conn/s  stats {sc.get('requests')} requests "
                f"{sc.get('status')} p50/p99 {lat.get('p50')}/{lat.get('p99')} ms; SSE "
                f"p50/p99 {sse.get('all', {}).get('p50')}/{sse.get('all', {}).get('p99')} ms, "
                f"closed early {sse.get('closed_early')}, gaps {sse.get('gaps')}"
            )
    cs = [r for r in runs if r["kind"] == "c"]
    if cs:
        lines.append("")
        lines.append(f"(c) per run: the sink ({meta['sink_queue']}) and its receiver (hookserver)")
        for r in cs:
            sa = r.get("sink_after", {})
            lines.append(
                f"   {r['conn_per_s']:8.0f} conn/s  {r['events_offered']} flow events offered "
                f"(3 per flow), delivered {r['delivered_per_s_in_run']:.0f}/s during the run, "
                f"pending {r['pending_at_end']} at its end, caught up in {r['catch_up_s']} s; "
                f"failed {sa.get('total_failed')}, replay gaps {sa.get('replay_gaps')}"
            )
    lines.extend(e2e.notes_section(res))
    return "\n".join(lines)


def collect_notes(res: dict) -> list[str]:
    notes = []
    runs = res.get("runs", [])
    busy = [r for r in runs if r["disturbed"]]
    if busy:
        notes.append(
            f"{len(busy)}/{len(runs)} runs were disturbed by other processes (>10% of the "
            "machine's CPU); the medians use only undisturbed runs when every situation has "
            "one, else all runs"
        )
    for r in runs:
        errs = {k: v for k, v in r["loadgen"]["errors"].items() if v}
        if errs:
            notes.append(f"({r['kind']}) run: loadgen errors {errs}")
        if r["kind"] == "c" and not r.get("caught_up", True):
            notes.append("(c) run: the sink did not catch up within --drain-timeout")
        if r["kind"] == "c" and (r.get("sink_after") or {}).get("replay_gaps"):
            notes.append(
                f"(c): the sink has {r['sink_after']['replay_gaps']} replay gaps (events the "
                "event ring dropped before the sink's intake took them)"
            )
        sse = r.get("sse") or {}
        if sse.get("closed_early"):
            notes.append(f"(b) run: {sse['closed_early']} SSE stream(s) ended early")
    for name, st in (res.get("engine_stops") or {}).items():
        notes += e2e.stop_notes(st, f"{name}: ", "engine")
    return notes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 reps of 3 s runs (about 1.5 min)")
    ap.add_argument("--reps", type=int, help="runs of each situation (default 5, quick 3)")
    ap.add_argument("--seconds", type=float, help="seconds per run (default 6, quick 3)")
    ap.add_argument("--stats-rate", type=float, default=50.0, help="GET /stats per second in (b)")
    ap.add_argument("--ring", type=int, default=8192, help="runtime.event_ring_capacity")
    ap.add_argument(
        "--sink-outbox",
        action="store_true",
        help="(c) with a durable outbox (api.outbox_path in the temporary directory)",
    )
    ap.add_argument("--drain-timeout", type=float, default=120.0)
    ap.add_argument("--tick-ms", type=int, default=100, help="hookserver's stats interval")
    ap.add_argument("--loadgen-threads", type=int, default=2)
    ap.add_argument("--server-threads", type=int, default=2)
    e2e.add_quiet_options(
        ap,
        budget_help="default 40 s, quick 10 s",
        retries_help="disturbed runs repeated (default 5, quick 2)",
    )
    a = ap.parse_args(argv)
    q = a.quick
    a.reps = a.reps or (3 if q else 5)
    a.seconds = a.seconds or (3.0 if q else 6.0)
    a.load_seconds = a.conn_seconds = a.seconds  # the names bench_control/bench_connector use
    if a.quiet_budget is None:
        a.quiet_budget = 10.0 if q else 40.0
    if a.retries is None:
        a.retries = 2 if q else 5
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    tools, stamp, base = bn.start_run(a, "control-load")
    res: dict = {
        "meta": {
            "timestamp": stamp,
            "quick": a.quick,
            "reps": a.reps,
            "seconds": a.seconds,
            "stats_rate": a.stats_rate,
            "sse_streams": bc.SSE_STREAMS,
            "sink_events": bn.FLOW_EVENTS,
            "sink_queue": "durable outbox" if a.sink_outbox else "in-memory queue",
            "dispatcher": bn.DISPATCHER,
            "loadgen_threads": a.loadgen_threads,
            "server_threads": a.server_threads,
            **e2e.host_meta(),
            "git": e2e.git_info(),
            "loadavg_before": os.getloadavg(),
        }
    }
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sw-bench-control-load-") as tmpd:
        tmp = Path(tmpd)
        ctl = bc.Bench(a, tools, tmp)  # (a) and (b): engine A, SSE readers, stats client
        con = bn.Bench(a, tools, tmp)  # (c): engine C with the sink, hookserver
        ea: bc.Engine | None = None
        old_term = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
        try:
            ctl.server = con.server = e2e.Server(tools["tinyserver"], None, 1800, a.server_threads)
            hook = con.hook(0, None, 3600)
            outbox = tmp / "outbox" if a.sink_outbox else None
            if outbox is not None:
                outbox.mkdir()
            cfg_a = engine_config([], None, a.ring)
            cfg_c = engine_config([bn.webhook("flows", hook.port, bn.FLOW_EVENTS)], outbox, a.ring)
            res["meta"]["config_a"], res["meta"]["config_c"] = cfg_a, cfg_c
            ea = ctl.engine = bc.Engine("engine-a", cfg_a, tmp, tmp / "engine-a.log")
            ec = con.engine("engine-c", cfg_c)
            res["meta"]["launch"] = ea.launch
            log(
                f"engine a pid {ea.pid} (socks5 :{ea.socks_port}, api :{ea.api_port}); "
                f"engine c pid {ec.pid} (socks5 :{ec.socks_port}, api :{ec.api_port}); "
                f"hookserver pid {hook.pid} :{hook.port}"
            )
            for name, port in (("a", ea.socks_port), ("c", ec.socks_port)):  # not recorded
                argv = e2e.rate_argv(ctl.server.rate, port, 16, 1.0, a.loadgen_threads)
                w = ctl.loadgen(argv, 40)
                log(f"warm-up engine {name}: {w['conn_per_s']:.0f} conn/s")
            con.wait_pending(ec, 0, a.drain_timeout)
            budget = e2e.RetryBudget(a.retries)
            runs: list[dict] = []

            def one(kind: str) -> dict:
                if kind == "c":
                    return {**con.conn_run("b", ec, ec, hook, a.seconds), "kind": "c"}
                return ctl.load_run(kind, a.seconds)

            for rep in range(a.reps):
                for kind in ("a", "b", "c") if rep % 2 == 0 else ("c", "b", "a"):
                    for r in budget.runs(lambda kind=kind: one(kind)):
                        runs.append(r)
                        log(describe(r))
            res["runs"] = runs
            res["summary"] = summarise(runs)
            res["sinks_final"] = ec.sinks()
            res["hook_stop"] = con.stop_hook(hook)
        finally:
            ctl.kids.reap()
            stops = {}
            if ea is not None:
                stops["engine-a"] = ea.stop()
            con.reap()
            stops.update(con.stops)
            if ctl.server is not None:
                ctl.server.stop()
            signal.signal(signal.SIGTERM, old_term)
            res["engine_stops"] = stops
            for name in ("engine-a", "engine-c"):
                src = tmp / f"{name}.log"
                if src.exists():
                    shutil.copy(src, f"{base}.{name}.log")
    res["meta"]["loadavg_after"] = os.getloadavg()
    res["meta"]["elapsed_s"] = round(time.monotonic() - t0, 1)
    res["notes"] = collect_notes(res)
    e2e.publish(res, report(res), base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
