#!/usr/bin/env python3
"""spliceway against its peers in one run: conn/s, latency, bulk goodput, CPU, idle memory.

    python benchmarks/run_peers.py [--quick] [--peers spliceway,v2ray,...] [--only rate,bulk,rss]

One tinyserver (C) is the target; loadgen (C) is the client, speaking SOCKS5 or HTTP
CONNECT (``loadgen --http``) depending on the proxy.  Every installed proxy of
``peers.ORDER`` (spliceway with a socks5 inbound, spliceway with an http inbound,
tinyproxy, microsocks, v2ray, sing-box, mihomo, dante) runs at the same time, each
on its own 127.0.0.1 port as a plain proxy to direct (configs in peers.py); a proxy
that is not installed is skipped with a note.  Measured, each measurement through
every path (``direct`` = loadgen straight to tinyserver, then every proxy) before the
next one starts, interleaved (rotated order per repetition) so each measurement's
figures come from the same minutes:

1. connections/s at concurrency 64 (100 B request, 1 KiB response, server closes)
   with p50/p99, and the proxy's CPU per connection (utime+stime of its process
   tree, all threads, during those runs / connections completed);
2. p50/p99 latency of one connection at concurrency 1;
3. bulk goodput with 8 connections, upload and download, and the proxy's CPU
   seconds per GB relayed;
4. the proxy's RSS per idle relayed flow with 5,000 open tunnels, on a fresh
   process of each proxy (run_e2e.run_rss; PSS summed over the tree for dante).

The run_e2e.py tooling does the work: ``Runner.rate``/``bulk`` (quiet wait, CPU
accounting, disturbed runs), ``RetryBudget``, ``run_rss``.  Prints one table
(rows = measurements, columns = direct and the proxies) and writes
benchmarks/results/<timestamp>-peers.json (every run, versions, configs) with the
proxies' logs in benchmarks/results/<timestamp>-peers.logs/.  Every server listens
on 127.0.0.1; every load run is bounded in count and time; only processes this
script started are stopped, by pid.  ``--quick`` takes under 3 minutes, the full
run under 12.  See benchmarks/README.md ("Peers").
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import peers  # noqa: E402
import run_e2e as e2e  # noqa: E402  (shared tooling: build, tinyserver, runs, RSS)
from run_e2e import log  # noqa: E402

DIRECT = "direct"
CASES = {  # key -> (kind, connections, bulk direction)
    "rate64": ("rate", 64, ""),
    "rate1": ("rate", 1, ""),
    "bulk8up": ("bulk", 8, "up"),
    "bulk8down": ("bulk", 8, "down"),
}


class PeerRunner(e2e.Runner):
    """run_e2e's Runner with several proxies running side by side; ``self.proxy`` is set to
    the path under test before each run (None for direct)."""

    def __init__(self, args: argparse.Namespace, tools: dict[str, Path]) -> None:
        super().__init__(args, tools)
        self.running: dict[str, peers.Running] = {}
        self.failed: dict[str, str] = {}  # path -> why it is no longer measured
        self.deadline = time.monotonic() + args.time_budget
        self.cut = 0  # repetitions left out because the time budget was spent

    def our_cpu(self) -> float:
        """tinyserver and every proxy we run (idle ones included): not "other" processes."""
        return e2e.pids_cpu_s([self.server.pid]) + sum(p.cpu() for p in self.running.values())

    def usable(self, path: str) -> bool:
        if path == DIRECT:
            return True
        if path in self.failed:
            return False
        p = self.running.get(path)
        if p is None:
            return False
        if not p.alive():
            self.failed[path] = f"{path} (pid {p.pid}) exited during the runs; log: {p.log_path}"
            log(f"  !! {self.failed[path]}")
            return False
        return True

    def one(self, path: str, case: str) -> dict:
        """One measured loadgen run of ``case`` through ``path``."""
        a = self.args
        kind, conns, direction = CASES[case]
        via = path != DIRECT
        self.proxy = self.running[path] if via else None
        if kind == "rate":
            secs = a.rate_seconds if conns > 1 else a.p50_seconds
            res = self.rate(via, conns, secs)
        else:
            res = self.bulk(via, conns, direction, a.bulk_mib << 20)
        res["path"] = path
        return res


# --------------------------------------------------------------------------- measurements


def describe(case: str, path: str, res: dict) -> str:
    kind = CASES[case][0]
    if kind == "rate":
        per = 1e6 * res["proxy_cpu_s"] / res["count"] if res["count"] else 0.0
        text = (
            f"{res['conn_per_s']:9.0f}/s p50={res['lat_us']['p50']:7.0f}us "
            f"p99={res['lat_us']['p99']:8.0f}us"
            + (f" cpu/conn={per:5.0f}us" if path != DIRECT else "")
        )
    else:
        text = f"{res['mb_per_s']:8.1f} MB/s proxy_cpu={res['proxy_cpu_s']:.2f}s" + (
            " TRUNCATED" if res["truncated"] else ""
        )
    errors = sum(res["errors"].values())
    return (
        f"  {case:<10}{path:<16}{text} other_cpu={res['other_cpu_s']:.2f}s"
        + (f" errors={errors}" if errors else "")
        + ("  (disturbed)" if res["disturbed"] else "")
    )


def interleave(
    r: PeerRunner,
    what: str,
    paths: list[str],
    one: Callable[[str], dict],
    note: Callable[[str, dict], str],
) -> dict[str, list[dict]]:
    """``--reps`` runs (``one(path)``, each logged as ``note(path, result)``) through
    every path; repetition k starts at path k and odd repetitions go backwards, so no path
    always runs first or right after another; later repetitions of ``what`` are cut once
    --time-budget is spent."""
    runs: dict[str, list[dict]] = {p: [] for p in paths}
    reps = r.args.reps
    for rep in range(reps):
        if rep > 0 and time.monotonic() > r.deadline:
            r.cut += len(paths) * (reps - rep)
            log(f"  time budget spent: {reps - rep} repetition(s) of {what} left out")
            break
        k = rep % len(paths)
        order = paths[k:] + paths[:k]
        if rep % 2:
            order = order[::-1]
        for path in order:
            if not r.usable(path):
                continue
            for res in r.retries.runs(lambda path=path: one(path)):
                runs[path].append(res)
                log(note(path, res))
    return runs


def interleaved(r: PeerRunner, case: str, paths: list[str]) -> dict[str, list[dict]]:
    """``--reps`` runs of ``case`` through every path, in ``interleave``'s order."""
    return interleave(
        r, case, paths, lambda path: r.one(path, case), lambda path, res: describe(case, path, res)
    )


def summarise(case: str, rs: list[dict], clean_only: bool) -> dict | None:
    """The best run (run_e2e's rule: interference only slows a run down) among the undisturbed
    ones when ``clean_only``, the median and spread, errors, and the proxy's CPU over all runs
    of the path."""
    if not rs:
        return None
    kind = CASES[case][0]
    key = "conn_per_s" if kind == "rate" else "mb_per_s"
    clean = e2e.undisturbed(rs) if clean_only else rs
    top = max(clean, key=lambda x: x[key])
    vals = [x[key] for x in clean]
    out = {
        "best": round(top[key], 1),
        "median": round(e2e.median(vals), 1),
        "spread_pct": round(e2e.spread(vals), 1),
        "runs": len(rs),
        "runs_used": len(clean),
        "all_disturbed": all(x["disturbed"] for x in rs),
        "errors": sum(sum(x["errors"].values()) for x in rs),
        "proxy_cpu_s": round(sum(x["proxy_cpu_s"] for x in rs), 3),
    }
    if kind == "rate":
        count = sum(x["count"] for x in rs)
        out["p50_us"] = round(top["lat_us"]["p50"], 1)
        out["p99_us"] = round(top["lat_us"]["p99"], 1)
        out["count"] = count
        out["cpu_us_per_conn"] = round(1e6 * out["proxy_cpu_s"] / count, 1) if count else None
    else:
        moved = sum(x["bytes"] for x in rs)
        out["bytes"] = moved
        out["truncated"] = any(x["truncated"] for x in rs)
        out["cpu_s_per_gb"] = round(out["proxy_cpu_s"] / (moved / 1e9), 3) if moved else None
    return out


def measure(r: PeerRunner, paths: list[str], only: set[str]) -> dict:
    cases = [c for c in CASES if CASES[c][0] in only]
    out: dict = {}
    if "rate" in only:
        for path in paths[1:]:  # warm every proxy's code paths once (not recorded)
            if r.usable(path):
                r.proxy = r.running[path]
                argv = e2e.rate_argv(
                    r.server.rate, r.proxy.port, 16, r.args.warm_seconds, 2, r._proxy_flag()
                )
                w = e2e.run_loadgen([*r.loadgen_cmd(), *argv], 40)
                log(f"  warm-up {path:<16}{w['conn_per_s']:9.0f}/s")
    for case in cases:
        log(f"{case} ...")
        t0 = time.monotonic()
        runs = interleaved(r, case, paths)
        out.setdefault("phase_s", {})[case] = round(time.monotonic() - t0, 1)
        # Undisturbed runs only when every path has one; else every run of every path, so no
        # path's clean run is set against another's disturbed ones.
        clean_only = all(any(not x["disturbed"] for x in rs) for rs in runs.values() if rs)
        summary = {p: summarise(case, rs, clean_only) for p, rs in runs.items()}
        base = (summary.get(DIRECT) or {}).get("best")
        for s in summary.values():
            if s is not None:
                s["ratio"] = round(s["best"] / base, 3) if base else None
        out[case] = {"summary": summary, "runs": runs, "undisturbed_only": clean_only}
    if "bulk" in only:  # CPU per GB over both 8-connection directions
        gb = {}
        for path in paths[1:]:
            ss = [out[c]["summary"].get(path) for c in ("bulk8up", "bulk8down") if c in out]
            ss = [s for s in ss if s]
            moved = sum(s["bytes"] for s in ss)
            cpu = sum(s["proxy_cpu_s"] for s in ss)
            gb[path] = round(cpu / (moved / 1e9), 3) if moved else None
        out["bulk_cpu_s_per_gb"] = gb
    return out


def nofile_limit(pid: int) -> int | None:
    """The soft RLIMIT_NOFILE of a process (/proc/PID/limits)."""
    try:
        with open(f"/proc/{pid}/limits") as f:
            for line in f:
                if line.startswith("Max open files"):
                    return int(line.split()[3])
    except (OSError, ValueError, IndexError):
        pass
    return None


def probe(r: PeerRunner, tunnels: int = 100) -> dict:
    """Holds ``tunnels`` tunnels through ``r.proxy`` for a moment: does it relay at all, and how
    many fds does it hold per tunnel (so the RSS run can stay within its fd limit instead of
    stalling on a proxy that can no longer accept)?"""
    proxy = r.proxy
    before = proxy.fds()
    hp = r.hold(tunnels, 20)
    try:
        first = e2e.read_json_line(hp, 30) or {"established": 0, "errors": {}}
        during = proxy.fds()
    finally:
        with contextlib.suppress(OSError):
            hp.stdin.write("\n")
            hp.stdin.flush()
        try:
            hp.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            e2e.stop_child(hp)
    est = first["established"]
    return {
        "established": est,
        "errors": {k: v for k, v in first["errors"].items() if v},
        "fds_per_flow": (during - before) / est if est else None,
    }


def rss_once(
    r: PeerRunner, spec: peers.Spec, flows: int, warm: int, tmp: Path, log_path: Path
) -> dict:
    """run_e2e.run_rss with ``flows`` tunnels on a fresh process of ``spec`` (fewer when its
    fd limit cannot hold that many: ``fit_flows``)."""
    try:
        proxy = spec.start(tmp, log_path)
    except SystemExit as ex:
        log(f"  !! {spec.name}: did not start for the RSS phase")
        return {"error": f"did not start: {str(ex)[:500]}"}
    r.running[spec.name] = proxy
    r.proxy = proxy
    res: dict = {}
    t0 = time.monotonic()
    try:
        pr = probe(r)
        if not pr["established"]:
            res = {"error": f"relays nothing (probe: {pr['errors']}); log: {log_path}"}
            log(f"  !! {spec.name}: {res['error']}")
            return res
        limit, per = nofile_limit(proxy.pid), pr["fds_per_flow"]
        n = flows
        # (the limit is per process: a multi-process proxy spreads its flows over many)
        if limit and per and per > 0 and not proxy.multiprocess:
            # room for the tunnels still in their handshake too (loadgen's 128 in flight)
            fit = int((limit - proxy.fds() - 128 * per - 300) / per) // 250 * 250
            if fit < flows:
                n = max(fit, warm + 250)
                log(
                    f"  {spec.name} holds {per:.1f} fds per flow and may open {limit}: "
                    f"{n} flows instead of {flows}"
                )
        log(f"  rss {spec.name} (pid {proxy.pid}), {n} flows ...")
        res = e2e.run_rss(r, n, warm)
        res["metric"] = "pss_tree" if proxy.multiprocess else "vmrss"
        res["complete"] = res["established"] >= 0.99 * n
        res["nofile"] = limit
        res["probe"] = pr
        if n != flows:
            res["fit_flows"] = n
        return res
    except SystemExit as ex:
        res = {"error": str(ex)[:500]}
        log(f"  !! {spec.name}: {res['error']}")
        return res
    finally:
        res["stop"] = proxy.stop()
        res["start_s"] = proxy.start_s
        res["launch"] = proxy.launch
        res["phase_s"] = round(time.monotonic() - t0, 1)
        del r.running[spec.name]
        r.proxy = None


def measure_rss(
    r: PeerRunner, specs: list[peers.Spec], tmp: Path, logs: Path, flows: int, warm: int
) -> dict:
    """run_e2e.run_rss on a fresh process of each proxy, one after the other.

    The fd limit: on a machine whose hard RLIMIT_NOFILE cannot be raised (20,000 here), a
    proxy that holds more than ~3.5 fds per flow (Go's splice pipes: 6) cannot hold 5,000
    flows; it is measured with the flows that fit (``fit_flows``; the table marks it @N).
    """
    out: dict = {}
    for spec in specs:
        res = rss_once(r, spec, flows, warm, tmp, logs / f"{spec.name}-rss.log")
        if "error" not in res:
            log(f"  rss {spec.name}: {res['kib_per_flow']} KiB/flow ({res['phase_s']} s)")
        out[spec.name] = res
    return out


# --------------------------------------------------------------------------- report


def cell(v: float | None, fmt: str = "{:.0f}", mark: str = "") -> str:
    return "-" if v is None else fmt.format(v) + mark


def report(res: dict) -> str:
    meta = res["meta"]
    paths = meta["paths"]
    m = res.get("measure", {})
    rss = res.get("rss", {})
    table: list[tuple[str, list[str]]] = [
        ("", list(paths)),
        ("client speaks", [meta["modes"].get(p, "-") for p in paths]),
    ]

    def row(label: str, fn: Callable[[str], str]) -> None:
        table.append((label, [fn(p) for p in paths]))

    def s_of(case: str, path: str) -> dict | None:
        return (m.get(case) or {}).get("summary", {}).get(path)

    def marks(s: dict) -> str:
        return ("!" if s["errors"] else "") + ("*" if s["all_disturbed"] else "")

    def val(case: str, key: str, fmt: str = "{:.0f}", direct: bool = True) -> Callable:
        def fn(p: str) -> str:
            s = s_of(case, p)
            if s is None or (p == DIRECT and not direct):
                return "-"
            mark = marks(s) if key in ("best", "p50_us") else ""
            mark += "T" if key == "best" and s.get("truncated") else ""
            return cell(s.get(key), fmt, mark)

        return fn

    def ratio(case: str) -> Callable:
        return lambda p: "-" if not s_of(case, p) else cell(s_of(case, p)["ratio"], "{:.2f}x")

    if "rate64" in m:
        row("conn/s, concurrency 64", val("rate64", "best"))
        row("  x direct", ratio("rate64"))
        row("  p50 / p99 ms", lambda p: _p50_p99(s_of("rate64", p)))
        row("proxy CPU us per conn (c=64)", val("rate64", "cpu_us_per_conn", direct=False))
    if "rate1" in m:
        row("p50 us, concurrency 1", val("rate1", "p50_us"))
        row("  p99 us", val("rate1", "p99_us"))
    for case, label in (
        ("bulk8up", "bulk 8 conns up, MB/s"),
        ("bulk8down", "bulk 8 conns down, MB/s"),
    ):
        if case in m:
            row(label, val(case, "best"))
            row("  x direct", ratio(case))
    if "bulk_cpu_s_per_gb" in m:
        gb = m["bulk_cpu_s_per_gb"]
        row("proxy CPU s/GB (bulk 8, up+down)", lambda p: cell(gb.get(p), "{:.3f}"))
    if rss:

        def kib(p: str) -> str:
            x = rss.get(p)
            if not x or "error" in x:
                return "-" if p == DIRECT else "fail"
            mark = ("" if x["complete"] else "?") + ("p" if x["metric"] == "pss_tree" else "")
            mark += f"@{x['fit_flows']}" if x.get("fit_flows") else ""
            return cell(x["kib_per_flow"], "{:.1f}", mark)

        def fds_threads(p: str) -> str:
            x = rss.get(p)
            if not x or "error" in x or not x["established"]:
                return "-"
            threads = (x["proxy_threads_after"] - x["proxy_threads_before"]) / x["established"]
            return f"{x['proxy_fds_per_flow']:.1f}/{threads:.2f}"

        row(f"idle KiB per flow ({meta['flows']:,} open)", kib)
        row("  fds / threads per flow", fds_threads)
    w0 = max(len(label) for label, _ in table) + 2
    widths = [max(len(cells[i]) for _, cells in table) + 2 for i in range(len(paths))]
    lines = [
        f"spliceway vs peers  {meta['timestamp']}  ({'quick' if meta['quick'] else 'full'} run, "
        f"{meta['reps']} rep(s), best run per path; only undisturbed runs where every path "
        "has one)",
        f"machine: {meta['nproc']} CPUs ({meta['cpu_model']}), kernel {meta['kernel']}, "
        f"loadavg at start {' '.join(f'{x:.2f}' for x in meta['loadavg_start'])}",
        f"git: {meta['git']}; spliceway launched as {meta.get('spliceway_launch', '?')}",
        "",
    ]
    lines += [
        f"{label:<{w0}}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True))
        for label, cells in table
    ]
    lines.append("")
    lines += [
        "marks: ! loadgen counted errors in some run (see Notes); * every run of the cell was",
        "  disturbed by other processes (>10% of the CPUs); T a bulk run was cut at",
        "  --bulk-max-seconds; ? fewer than 99% of the tunnels opened; p PSS summed over the",
        "  process tree (dante pre-forks processes); @N measured with N tunnels, as many as",
        "  fit the proxy's fd limit",
    ]
    lines.append("")
    lines.append("versions:")
    lines.extend(f"   {k:<16}{v}" for k, v in meta["versions"].items())
    lines.extend(e2e.notes_section(res))
    return "\n".join(lines)


def _p50_p99(s: dict | None) -> str:
    if not s:
        return "-"
    return f"{s['p50_us'] / 1000:.1f}/{s['p99_us'] / 1000:.1f}"


def collect_notes(res: dict, r: PeerRunner) -> list[str]:
    notes = list(res["meta"]["skipped"])
    notes += list(r.failed.values())
    m = res.get("measure", {})
    runs = [x for c in CASES if c in m for rs in m[c]["runs"].values() for x in rs]
    busy = [x for x in runs if x["disturbed"]]
    if busy:
        notes.append(
            f"{len(busy)}/{len(runs)} runs were disturbed by other processes (>10% of the "
            "machine's CPU); a measurement uses only undisturbed runs when every path has "
            "one, else all runs (the JSON says which: undisturbed_only)"
        )
    hot = [
        x
        for x in runs
        if x["path"] != DIRECT
        and x.get("loadgen_cpu_s", 0) > 0.9 * x["wall_s"] * x.get("threads", 1)
    ]
    if hot:
        notes.append(
            f"{len(hot)} proxied runs had loadgen above 90% of its threads' CPU "
            "(the generator may have limited them)"
        )
    for c in CASES:
        for path, s in ((m.get(c) or {}).get("summary") or {}).items():
            if s and s["errors"]:
                errs: dict[str, int] = {}
                for x in m[c]["runs"][path]:
                    for k, v in x["errors"].items():
                        errs[k] = errs.get(k, 0) + v
                firsts = {k: v for x in m[c]["runs"][path] for k, v in x["first_errors"].items()}
                nz = {k: v for k, v in errs.items() if v}
                notes.append(f"{c} {path}: loadgen errors {nz} (first: {firsts})")
    if r.cut:
        notes.append(f"time budget spent: {r.cut} runs left out (--time-budget)")
    for path, x in (res.get("rss") or {}).items():
        if "error" in x:
            notes.append(f"rss {path}: {x['error']}")
        elif not x["complete"]:
            errs = {k: v for k, v in x["errors"].items() if v}
            notes.append(
                f"rss {path}: only {x['established']}/{x['flows']} tunnels opened "
                f"(errors {errs}); its figure includes the failed flows' garbage"
            )
        if x.get("fit_flows"):
            notes.append(
                f"rss {path}: measured with {x['fit_flows']} tunnels, not {res['meta']['flows']}: "
                f"it holds {x['probe']['fds_per_flow']:.1f} fds per flow and its fd limit is "
                f"{x['nofile']} (the hard RLIMIT_NOFILE here)"
            )
    for path, st in (res.get("stops") or {}).items():
        notes += e2e.stop_notes(st, f"{path}: ", "proxy")
    for path, x in (res.get("rss") or {}).items():
        if x.get("stop"):
            notes += e2e.stop_notes(x["stop"], f"{path} (rss): ", "proxy")
    return notes


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short runs (under 3 minutes)")
    ap.add_argument(
        "--peers",
        default=",".join(peers.ORDER),
        help="comma list of proxies (default: every installed one of peers.ORDER)",
    )
    ap.add_argument("--only", default="rate,bulk,rss", help="comma list of rate,bulk,rss")
    ap.add_argument("--reps", type=int, help="repetitions of each run (default 3, quick 1)")
    ap.add_argument(
        "--rate-seconds", type=float, help="seconds per c=64 run (default 4, quick 1.2)"
    )
    ap.add_argument("--p50-seconds", type=float, help="seconds per c=1 run (default 2, quick 0.6)")
    ap.add_argument("--bulk-mib", type=int, help="MiB per bulk run (default 1024, quick 256)")
    ap.add_argument(
        "--bulk-max-seconds", type=float, help="cap on a bulk run (default 10, quick 5)"
    )
    ap.add_argument("--buf", type=int, default=256 * 1024, help="loadgen/tinyserver I/O buffer")
    ap.add_argument(
        "--warm-seconds", type=float, help="unrecorded conn/s run per proxy (default 1, quick 0.5)"
    )
    ap.add_argument("--flows", type=int, default=5000, help="idle flows for the RSS measurement")
    ap.add_argument("--warm-flows", type=int, default=200)
    ap.add_argument(
        "--time-budget",
        type=float,
        help="seconds for the rate/bulk phases; later repetitions are left out once spent "
        "(default 480, quick 110)",
    )
    ap.add_argument("--server-threads", type=int, default=2)
    ap.add_argument("--loadgen-threads", type=int, default=2)
    e2e.add_quiet_options(
        ap,
        budget_help="default 60, quick 10",
        retries_help="disturbed runs repeated (default 8, quick 2)",
    )
    a = ap.parse_args(argv)
    q = a.quick
    a.reps = a.reps or (1 if q else 3)
    a.rate_seconds = a.rate_seconds or (1.2 if q else 4.0)
    a.p50_seconds = a.p50_seconds or (0.6 if q else 2.0)
    a.warm_seconds = a.warm_seconds or (0.5 if q else 1.0)
    a.bulk_mib = a.bulk_mib or (256 if q else 1024)
    a.bulk_max_seconds = a.bulk_max_seconds or (5.0 if q else 10.0)
    a.time_budget = a.time_budget if a.time_budget is not None else (110.0 if q else 480.0)
    a.quiet_budget = a.quiet_budget if a.quiet_budget is not None else (10.0 if q else 60.0)
    a.retries = a.retries if a.retries is not None else (2 if q else 8)
    # run_e2e.Runner reads these too
    a.pin_load = a.pin_proxy = None
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    only = {x.strip() for x in a.only.split(",") if x.strip()}
    wanted = [x.strip() for x in a.peers.split(",") if x.strip()]
    unknown = [x for x in wanted if x not in peers.ORDER]
    if unknown:
        raise SystemExit(f"unknown peers {unknown}; known: {', '.join(peers.ORDER)}")
    e2e.raise_nofile()
    tools = e2e.build_tools(a.cc)
    specs = [s for s in peers.discover() if s.name in wanted]
    skipped = [
        f"{s.name} is not installed ({s.missing}): skipped" for s in specs if not s.installed
    ]
    for n in skipped:
        print(f"note: {n}", flush=True)
    specs = [s for s in specs if s.installed]
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    a.out.mkdir(parents=True, exist_ok=True)
    base = a.out / f"{stamp}-peers"
    logs = Path(f"{base}.logs")
    logs.mkdir()
    res: dict = {
        "meta": {
            "timestamp": stamp,
            "quick": a.quick,
            "reps": a.reps,
            "rate_seconds": a.rate_seconds,
            "p50_seconds": a.p50_seconds,
            "bulk_mib": a.bulk_mib,
            "bulk_max_seconds": a.bulk_max_seconds,
            "flows": a.flows,
            "loadgen_threads": a.loadgen_threads,
            "server_threads": a.server_threads,
            **e2e.host_meta(),
            "loadavg_start": os.getloadavg(),
            "git": e2e.git_info(),
            "skipped": skipped,
            "versions": {s.name: s.version for s in specs},
            "modes": {DIRECT: "-", **{s.name: s.mode for s in specs}},
            "logs": str(logs),
        }
    }
    t0 = time.monotonic()
    r = PeerRunner(a, tools)
    stops: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="sw-peers-") as tmpd:
        tmp = Path(tmpd)
        r.server = e2e.Server(tools["tinyserver"], None, 1800, a.server_threads)
        try:
            started = []
            if only & {"rate", "bulk"}:
                for spec in specs:
                    try:
                        p = spec.start(tmp, logs / f"{spec.name}.log")
                    except SystemExit as ex:
                        r.failed[spec.name] = f"{spec.name} did not start: {str(ex)[:400]}"
                        log(f"  !! {r.failed[spec.name]}")
                        continue
                    r.running[spec.name] = p
                    started.append(spec.name)
                    log(f"{spec.name}: pid {p.pid}, {p.mode} on 127.0.0.1:{p.port} ({p.start_s} s)")
                    if spec.name.startswith("spliceway"):
                        res["meta"]["spliceway_launch"] = p.launch
                res["meta"]["configs"] = {n: p.config for n, p in r.running.items()}
                res["meta"]["cmds"] = {n: p.cmd for n, p in r.running.items()}
                try:
                    res["measure"] = measure(r, [DIRECT, *[s.name for s in specs]], only)
                finally:
                    for name in list(r.running):
                        stops[name] = r.running.pop(name).stop()
            if "rss" in only:
                log("RSS per idle flow (a fresh process of each proxy) ...")
                t1 = time.monotonic()
                res["rss"] = measure_rss(r, specs, tmp, logs, a.flows, a.warm_flows)
                res["meta"]["rss_phase_s"] = round(time.monotonic() - t1, 1)
                if "spliceway" in res["rss"]:
                    res["meta"].setdefault(
                        "spliceway_launch", res["rss"]["spliceway"].get("launch")
                    )
                log(f"  (RSS phase: {res['meta']['rss_phase_s']} s)")
        finally:
            for name in list(r.running):
                stops[name] = r.running.pop(name).stop()
            r.server.stop()
    res["stops"] = stops
    res["meta"]["paths"] = [DIRECT, *[s.name for s in specs]]
    res["meta"]["elapsed_s"] = round(time.monotonic() - t0, 1)
    res["notes"] = collect_notes(res, r)
    if not any(logs.iterdir()):
        shutil.rmtree(logs, ignore_errors=True)
    e2e.publish(res, report(res), base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
