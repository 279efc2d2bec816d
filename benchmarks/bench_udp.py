#!/usr/bin/env python3
"""UDP echo through SOCKS5 UDP ASSOCIATE: spliceway against its peers in one run.

    python benchmarks/bench_udp.py [--reps 3] [--seconds 4] [--peers spliceway,dante,...]

``udpload echo`` (benchmarks/udpload.c) is the UDP echo server on 127.0.0.1;
``udpload client`` is the client: ``--direct`` straight to the echo server, or through
a SOCKS5 proxy (TCP control connection, no authentication, UDP ASSOCIATE declaring
its UDP port, every datagram wrapped in the RFC 1928 header).  64-byte datagrams
(``--size``), ``--window`` 1 and 16 datagrams in flight; a datagram not answered
within ``--timeout-ms`` counts as lost and its slot is reused.

Paths, all running side by side on 127.0.0.1 (a proxy that is not installed is
skipped with a note): direct, spliceway (``python -m spliceway run -c CFG``, one
socks5 inbound, ``direct``: peers.py's config), dante (``danted``, with
``udpassociate``/``udpreply`` allowed), sing-box (socks inbound, UDP on by default),
mihomo (socks-port, UDP on by default), v2ray (socks inbound with ``udp: true``).
Before measuring, each proxy must echo 200 datagrams one at a time (a probe): a
proxy that relays no UDP is reported and left out.  Then, per window, ``--reps``
repetitions through every path, repetition k starting at path k and odd ones
backwards (run_peers.py's order), each after an unrecorded warm-up run per proxy.

run_e2e.py's ``Runner.measured`` does each run (quiet wait, the CPU of the proxy's
process tree, the other processes' CPU, the ``disturbed`` rule and one repeat of a
disturbed run while ``--retries`` lasts).  Reported per path and window: round
trips/s (datagrams echoed per second) of the best run and its ratio to direct's
best, p50/p99 of that run, lost and late datagrams over all runs, and the proxy's
CPU seconds per 1,000 round trips (over all runs).  Writes
benchmarks/results/<timestamp>-udp.json (every run, configs, versions) and the
proxies' logs in benchmarks/results/<timestamp>-udp.logs/.  Every run is bounded in
time; only processes this script started are stopped, by pid.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
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

import peers  # noqa: E402  (discovery, starting, CPU of process trees)
import run_e2e as e2e  # noqa: E402  (build, Managed, Runner.measured, QuietWait, notes)
import run_peers  # noqa: E402  (PeerRunner: several proxies side by side)
from run_e2e import log  # noqa: E402

DIRECT = "direct"
ORDER = ("spliceway", "dante", "sing-box", "mihomo", "v2ray")
TARGETS = {"ratio_w1": 0.75}
ISSUE_PEERS = {
    1: "dante 0.70x, sing-box 0.66x, mihomo 0.52x, v2ray 0.49x",
    16: "sing-box 0.25x, the others 0.17-0.18x",
}


# ------------------------------------------------------------------ the peers' UDP configs


def _dante_udp(binary: str) -> Callable[[Path, int], tuple[list[str], str]]:
    """peers.py's dante config with UDP ASSOCIATE and its replies allowed (as
    tests/helpers/upstreams.py's ``dante()``)."""

    # (dante's parser wants a "command:" list on a line of its own)
    return peers._dante(
        binary,
        (
            "socks pass {",
            "  from: 127.0.0.0/8 to: 127.0.0.0/8",
            "  command: connect udpassociate udpreply",
            "  log: error",
            "}",
        ),
    )


def _v2ray_udp(binary: str) -> Callable[[Path, int], tuple[list[str], str]]:
    """peers.py's v2ray config with the socks inbound's UDP on; ``ip`` is the address its
    UDP ASSOCIATE reply names (the relay socket listens there)."""

    return peers._v2ray(
        binary, {"auth": "noauth", "udp": True, "ip": "127.0.0.1"}, prompt_close=False
    )


# sing-box's socks inbound and mihomo's socks-port relay UDP ASSOCIATE as peers.py configures
# them (UDP is on by default in both); spliceway's socks5 inbound has ``udp: true`` by default.
UDP_WRITERS: dict[str, Callable[[str], Callable[[Path, int], tuple[list[str], str]]]] = {
    "dante": _dante_udp,
    "v2ray": _v2ray_udp,
}


def udp_specs(wanted: list[str]) -> tuple[list[peers.Spec], list[str]]:
    """The installed proxies of ``wanted`` (peers.discover(), with the UDP configs above),
    and a note for each one that is not installed."""
    specs, skipped = [], []
    for s in peers.discover():
        if s.name not in wanted:
            continue
        if not s.installed:
            skipped.append(f"{s.name} is not installed ({s.missing}): skipped")
            continue
        if s.name in UDP_WRITERS:
            s = dataclasses.replace(s, write_config=UDP_WRITERS[s.name](s.binary))
        specs.append(s)
    specs.sort(key=lambda s: wanted.index(s.name))
    return specs, skipped


# ------------------------------------------------------------------ the echo server and runs


class Echo:
    """``udpload echo`` on 127.0.0.1 (bounded by --max-seconds and the runner's life)."""

    def __init__(self, exe: Path, max_seconds: float) -> None:
        cmd = [str(exe), "echo", "--port", "0", "--max-seconds", str(int(max_seconds))]
        self.m = e2e.Managed("udpload-echo", cmd, stdout=subprocess.PIPE)
        line = e2e.read_line(self.m.proc, 10)
        if not line:
            self.m.abort("udpload echo did not start")
        info = json.loads(line)
        self.port, self.pid = int(info["port"]), self.m.pid

    def stop(self) -> dict:
        info = self.m.stop(3)
        info["last_lines"] = list(self.m.lines)[-3:]
        return info


class UdpRunner(run_peers.PeerRunner):
    """run_peers' PeerRunner (proxies side by side, ``our_cpu``, ``usable``) whose load
    generator is ``udpload client`` and whose server is the UDP echo server."""

    def loadgen_cmd(self) -> list[str]:
        return [str(self.tools["udpload"]), "client"]

    def argv(self, path: str, window: int, seconds: float, count: int = 0) -> list[str]:
        a = self.args
        out = ["--target", f"127.0.0.1:{self.server.port}"]
        out += (
            ["--direct"] if path == DIRECT else ["--socks", f"127.0.0.1:{self.running[path].port}"]
        )
        out += ["--window", str(window), "--size", str(a.size), "--seconds", str(seconds)]
        out += ["--timeout-ms", str(a.timeout_ms)]
        return out + (["--count", str(count)] if count else [])

    def udp_run(self, path: str, window: int) -> dict:
        """One measured run of ``window`` through ``path``."""
        via = path != DIRECT
        self.proxy = self.running[path] if via else None
        res = self.measured(via, self.argv(path, window, self.args.seconds), self.args.seconds + 30)
        res["path"] = path
        if res["error"] and via:
            self.failed[path] = (
                f"{path}: {res['error']} (window {window}); log: {self.proxy.log_path}"
            )
            log(f"  !! {self.failed[path]}")
        return res

    def unrecorded(self, path: str, window: int, seconds: float, count: int = 0) -> dict:
        """A run outside the measurements (probe, warm-up): udpload's JSON only."""
        argv = self.argv(path, window, seconds, count)
        return e2e.run_loadgen([*self.loadgen_cmd(), *argv], seconds + 30)


def describe(path: str, res: dict) -> str:
    lost = f" lost={res['lost']}" if res["lost"] else ""
    late = f" late={res['late']}" if res["late"] else ""
    per = (
        f" cpu/1k={1e3 * res['proxy_cpu_s'] / res['received']:.3f}s"
        if path != DIRECT and res["received"]
        else ""
    )
    return (
        f"  w{res['window']:<3}{path:<11}{res['rtt_per_s']:9.0f}/s "
        f"p50={res['lat_us']['p50']:7.1f}us p99={res['lat_us']['p99']:8.1f}us{lost}{late}{per} "
        f"other_cpu={res['other_cpu_s']:.2f}s"
        + (f" error={res['error']}" if res["error"] else "")
        + ("  (disturbed)" if res["disturbed"] else "")
    )


def probe(r: UdpRunner, path: str, count: int) -> dict:
    """``count`` datagrams one at a time through ``path``: does it relay UDP at all?"""
    res = r.unrecorded(path, 1, 10.0, count)
    ok = not res["error"] and res["received"] >= 0.9 * count
    out = {k: res[k] for k in ("relay", "received", "lost", "late", "bad", "foreign", "error")}
    out["p50_us"] = res["lat_us"]["p50"]
    out["ok"] = ok
    if not ok:
        why = res["error"] or (
            f"{res['received']}/{count} datagrams echoed (lost {res['lost']}, "
            f"bad {res['bad']}, foreign {res['foreign']})"
        )
        r.failed[path] = f"{path} does not relay UDP here: {why}; log: {r.running[path].log_path}"
        log(f"  !! {r.failed[path]}")
    return out


def interleaved(r: UdpRunner, window: int, paths: list[str]) -> dict[str, list[dict]]:
    """--reps runs of ``window`` through every path in run_peers.interleaved's order
    (repetition k starts at path k, odd repetitions backwards); later repetitions are left
    out once --time-budget is spent."""
    return run_peers.interleave(
        r, f"window {window}", paths, lambda path: r.udp_run(path, window), describe
    )


def summarise(rs: list[dict], clean_only: bool) -> dict | None:
    """The best run (interference only slows a run down) among the undisturbed ones when
    ``clean_only``; median and spread; losses and the proxy's CPU over all runs."""
    rs = [x for x in rs if not x["error"]]
    if not rs:
        return None
    clean = e2e.undisturbed(rs) if clean_only else rs
    top = max(clean, key=lambda x: x["rtt_per_s"])
    vals = [x["rtt_per_s"] for x in clean]
    received = sum(x["received"] for x in rs)
    cpu = sum(x["proxy_cpu_s"] for x in rs)
    return {
        "best": round(top["rtt_per_s"], 1),
        "median": round(e2e.median(vals), 1),
        "spread_pct": round(e2e.spread(vals), 1),
        "p50_us": top["lat_us"]["p50"],
        "p99_us": top["lat_us"]["p99"],
        "runs": len(rs),
        "runs_used": len(clean),
        "all_disturbed": all(x["disturbed"] for x in rs),
        "sent": sum(x["sent"] for x in rs),
        "received": received,
        "lost": sum(x["lost"] for x in rs),
        "late": sum(x["late"] for x in rs),
        "bad": sum(x["bad"] + x["foreign"] for x in rs),
        "send_errors": sum(x["send_errors"] + x["send_eagain"] for x in rs),
        "proxy_cpu_s": round(cpu, 3),
        "cpu_s_per_1k": round(1e3 * cpu / received, 4) if received else None,
        "client_cpu_s_per_1k": round(1e3 * sum(x["loadgen_cpu_s"] for x in rs) / received, 4)
        if received
        else None,
    }


def measure(r: UdpRunner, paths: list[str]) -> dict:
    a = r.args
    out: dict = {"probe": {}}
    for path in paths[1:]:
        if not r.usable(path):
            continue
        out["probe"][path] = pr = probe(r, path, a.probe_count)
        log(
            f"  probe {path:<10} {'ok' if pr['ok'] else 'FAILED'}: {pr['received']}/"
            f"{a.probe_count} echoed via {pr['relay'] or '-'}, p50 {pr['p50_us']:.0f} us"
        )
    for window in a.windows:
        log(f"window {window} ...")
        t0 = time.monotonic()
        for path in paths[1:]:  # warm every proxy once at this window (not recorded)
            if r.usable(path):
                w = r.unrecorded(path, window, a.warm_seconds)
                log(f"  warm-up w{window} {path:<10}{w['rtt_per_s']:9.0f}/s lost={w['lost']}")
        runs = interleaved(r, window, paths)
        # Undisturbed runs only when every path has one; else every run of every path.
        clean_only = all(any(not x["disturbed"] for x in rs) for rs in runs.values() if rs)
        summary = {p: summarise(rs, clean_only) for p, rs in runs.items()}
        base = (summary.get(DIRECT) or {}).get("best")
        for s in summary.values():
            if s is not None:
                s["ratio"] = round(s["best"] / base, 3) if base else None
        out[f"w{window}"] = {
            "summary": summary,
            "runs": runs,
            "undisturbed_only": clean_only,
            "phase_s": round(time.monotonic() - t0, 1),
        }
    return out


# ------------------------------------------------------------------ report


def report(res: dict) -> str:
    meta = res["meta"]
    m = res.get("measure", {})
    lines = [
        f"UDP echo through SOCKS5 UDP ASSOCIATE  {meta['timestamp']}  ({meta['size']}-byte "
        f"datagrams, {meta['seconds']} s per run, {meta['reps']} rep(s), best run per path; "
        f"timeout {meta['timeout_ms']} ms)",
        f"machine: {meta['nproc']} CPUs ({meta['cpu_model']}), kernel {meta['kernel']}, "
        f"loadavg at start {' '.join(f'{x:.2f}' for x in meta['loadavg_start'])}",
        f"git: {meta['git']}; spliceway launched as {meta.get('spliceway_launch', '?')}",
    ]
    head = (
        f"   {'path':<11}{'rtt/s':>9}{'ratio':>8}{'p50 us':>9}{'p99 us':>9}{'spread%':>9}"
        f"{'lost':>7}{'late':>6}{'proxy CPU s/1k':>16}"
    )
    for window in meta["windows"]:
        w = m.get(f"w{window}")
        if not w:
            continue
        lines += ["", f"window {window}  [issue's peers: {ISSUE_PEERS.get(window, '-')}]", head]
        for path in meta["paths"]:
            s = w["summary"].get(path)
            if not s:
                lines.append(f"   {path:<11}{'-':>9}   (not measured; see Notes)")
                continue
            mark = "*" if s["all_disturbed"] else ""
            cpu = "-" if path == DIRECT or s["cpu_s_per_1k"] is None else f"{s['cpu_s_per_1k']:.4f}"
            ratio = "-" if s["ratio"] is None else f"{s['ratio']:.2f}x"
            lines.append(
                f"   {path:<11}{s['best']:>9.0f}{ratio:>8}{s['p50_us']:>9.1f}{s['p99_us']:>9.1f}"
                f"{s['spread_pct']:>9.0f}{s['lost']:>7}{s['late']:>6}{cpu:>16}{mark}"
            )
        proxies = {p: s for p, s in w["summary"].items() if p != DIRECT and s}
        sw = proxies.get("spliceway")
        if sw and sw["ratio"] is not None:
            if window == 1:
                goal = TARGETS["ratio_w1"]
                lines.append(
                    f"   spliceway {sw['ratio']:.2f}x direct; target >= {goal}x: "
                    f"{e2e.ok(sw['ratio'] >= goal)}"
                )
            others = {p: s["best"] for p, s in proxies.items() if p != "spliceway"}
            if others:
                top = max(others, key=lambda p: others[p])
                lines.append(
                    f"   spliceway {sw['best']:.0f}/s vs the best peer ({top}) "
                    f"{others[top]:.0f}/s: "
                    + ("ahead" if sw["best"] > others[top] else "behind")
                    + (" (target at window 16: ahead of every peer)" if window == 16 else "")
                )
    lines += [
        "",
        "rtt/s = datagrams echoed per second (each a round trip client -> proxy -> echo server",
        "  and back); ratio to direct's best; p50/p99 of the best run; lost = no reply within the",
        "  timeout, late = a reply after it (both over all runs); proxy CPU s/1k = utime+stime of",
        "  the proxy's process tree per 1,000 round trips, over all runs; * every run disturbed",
        "",
        "probe (200 datagrams one at a time before measuring):",
    ]
    for path, pr in (m.get("probe") or {}).items():
        lines.append(
            f"   {path:<11}{'ok' if pr['ok'] else 'FAILED'}  {pr['received']} echoed, relay "
            f"{pr['relay'] or '-'}" + (f", error: {pr['error']}" if pr["error"] else "")
        )
    lines += ["", "versions:"]
    lines += [f"   {k:<11}{v}" for k, v in meta["versions"].items()]
    lines.extend(e2e.notes_section(res))
    return "\n".join(lines)


def collect_notes(res: dict, r: UdpRunner) -> list[str]:
    notes = list(res["meta"]["skipped"]) + list(r.failed.values())
    m = res.get("measure", {})
    runs = [x for k, v in m.items() if k.startswith("w") for rs in v["runs"].values() for x in rs]
    busy = [x for x in runs if x["disturbed"]]
    if busy:
        notes.append(
            f"{len(busy)}/{len(runs)} runs were disturbed by other processes (>10% of the "
            "machine's CPU); a window uses only undisturbed runs when every path has one"
        )
    for k, v in m.items():
        if not k.startswith("w"):
            continue
        for path, s in v["summary"].items():
            if s and (s["lost"] or s["late"] or s["bad"] or s["send_errors"]):
                notes.append(
                    f"{k} {path}: {s['lost']} lost, {s['late']} late, {s['bad']} bad/foreign "
                    f"replies, {s['send_errors']} send errors of {s['sent']} datagrams sent"
                )
    hot = [x for x in runs if x.get("loadgen_cpu_s", 0) > 0.9 * x["wall_s"]]
    if hot:
        notes.append(
            f"{len(hot)}/{len(runs)} runs had udpload above 90% of a CPU "
            "(the client may have limited them)"
        )
    if r.cut:
        notes.append(f"time budget spent: {r.cut} runs left out (--time-budget)")
    for path, st in (res.get("stops") or {}).items():
        notes += e2e.stop_notes(st, f"{path}: ", "proxy")
    return notes


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 rep of 1.5 s runs (about a minute)")
    ap.add_argument(
        "--udp-busy-poll-us",
        type=int,
        default=0,
        help="spliceway's runtime.udp_busy_poll_us (default 0: the engine's own default)",
    )
    ap.add_argument("--peers", default=",".join(ORDER), help="comma list of proxies")
    ap.add_argument("--windows", default="1,16", help="datagrams in flight, comma list")
    ap.add_argument("--reps", type=int, help="repetitions of each run (default 3, quick 1)")
    ap.add_argument("--seconds", type=float, help="seconds per run (default 4, quick 1.5)")
    ap.add_argument("--size", type=int, default=64, help="payload bytes per datagram")
    ap.add_argument("--timeout-ms", type=int, default=200, help="a datagram is lost after this")
    ap.add_argument("--probe-count", type=int, default=200)
    ap.add_argument("--warm-seconds", type=float, help="unrecorded run per proxy and window")
    ap.add_argument("--time-budget", type=float, help="seconds for the runs (default 480)")
    e2e.add_quiet_options(
        ap,
        budget_help="default 60, quick 10",
        retries_help="disturbed runs repeated (default 8, quick 2)",
    )
    a = ap.parse_args(argv)
    q = a.quick
    a.reps = a.reps or (1 if q else 3)
    a.seconds = a.seconds or (1.5 if q else 4.0)
    a.warm_seconds = a.warm_seconds or (0.3 if q else 0.5)
    a.time_budget = a.time_budget if a.time_budget is not None else (120.0 if q else 480.0)
    a.quiet_budget = a.quiet_budget if a.quiet_budget is not None else (10.0 if q else 60.0)
    a.retries = a.retries if a.retries is not None else (2 if q else 8)
    a.windows = [int(x) for x in a.windows.split(",") if x.strip()]
    a.pin_load = a.pin_proxy = None  # run_e2e.Runner reads these
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.udp_busy_poll_us:
        peers.SPLICEWAY_RUNTIME["udp_busy_poll_us"] = a.udp_busy_poll_us
    wanted = [x.strip() for x in a.peers.split(",") if x.strip()]
    unknown = [x for x in wanted if x not in ORDER]
    if unknown:
        raise SystemExit(f"unknown peers {unknown}; known: {', '.join(ORDER)}")
    e2e.raise_nofile()
    tools = e2e.build_tools(a.cc, ("udpload",))
    specs, skipped = udp_specs(wanted)
    for n in skipped:
        print(f"note: {n}", flush=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    a.out.mkdir(parents=True, exist_ok=True)
    base = a.out / f"{stamp}-udp"
    logs = Path(f"{base}.logs")
    logs.mkdir()
    paths = [DIRECT, *[s.name for s in specs]]
    res: dict = {
        "meta": {
            "timestamp": stamp,
            "quick": a.quick,
            "reps": a.reps,
            "seconds": a.seconds,
            "size": a.size,
            "windows": a.windows,
            "timeout_ms": a.timeout_ms,
            **e2e.host_meta(),
            "loadavg_start": os.getloadavg(),
            "git": e2e.git_info(),
            "skipped": skipped,
            "versions": {s.name: s.version for s in specs},
            "paths": paths,
            "logs": str(logs),
            "command": " ".join(["python", "benchmarks/bench_udp.py", *(argv or sys.argv[1:])]),
        }
    }
    t0 = time.monotonic()
    r = UdpRunner(a, tools)
    stops: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="sw-udp-") as tmpd:
        tmp = Path(tmpd)
        budget = a.time_budget + 600  # the echo server outlives every run, never the runner
        r.server = Echo(tools["udpload"], budget)
        try:
            for spec in specs:
                try:
                    p = spec.start(tmp, logs / f"{spec.name}.log")
                except SystemExit as ex:
                    r.failed[spec.name] = f"{spec.name} did not start: {str(ex)[:400]}"
                    log(f"  !! {r.failed[spec.name]}")
                    continue
                r.running[spec.name] = p
                log(f"{spec.name}: pid {p.pid} on 127.0.0.1:{p.port} ({p.start_s} s)")
                if spec.name == "spliceway":
                    res["meta"]["spliceway_launch"] = p.launch
            res["meta"]["configs"] = {n: p.config for n, p in r.running.items()}
            res["meta"]["cmds"] = {n: p.cmd for n, p in r.running.items()}
            res["measure"] = measure(r, paths)
        finally:
            for name in list(r.running):
                stops[name] = r.running.pop(name).stop()
            res["echo_stop"] = r.server.stop()
    res["stops"] = stops
    res["meta"]["elapsed_s"] = round(time.monotonic() - t0, 1)
    res["notes"] = collect_notes(res, r)
    if not any(logs.iterdir()):
        shutil.rmtree(logs, ignore_errors=True)
    e2e.publish(res, report(res), base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
