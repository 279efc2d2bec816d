#!/usr/bin/env python3
"""Chained and encrypted outbounds: spliceway against v2ray and ss-local, in the same run.

    python benchmarks/bench_chain.py [--quick] [--parts relay,ss] [--only peers]

Two comparisons, every server on 127.0.0.1 with free ports, loadgen and
tinyserver (C, built by ``run_e2e.build_tools``) as client and target:

1. **relay** of two socks5 hops: loadgen -> PROXY (socks5 inbound) ->
   microsocks A -> microsocks B -> tinyserver.  PROXY is spliceway (outbounds
   ``hop-a``/``hop-b`` and a ``relay`` group ``chain`` = [hop-a, hop-b] as
   ``route.final``) or v2ray 4.x (outbound ``hop-b`` with
   ``proxySettings.tag = hop-a``; routing sends everything to hop-b; level 0's
   ``uplinkOnly`` is 0, see ``v2ray_relay_config``).  A
   reference path without a chaining proxy (loadgen -> microsocks B, one hop) is
   measured too in the full run (``--ref``).  Measured: bulk goodput with 1 and
   8 connections (MB/s, download and upload; download only with --quick) and
   connections/s at concurrency 64 (100 B request, 1 KiB response, server
   closes), with p50/p99 per connection.
2. **ss**: shadowsocks outbound vs ss-local.  One ``ss-server`` (TCP) per
   cipher; loadgen -> PROXY -> ss-server -> tinyserver, PROXY = spliceway
   (outbound ``shadowsocks`` as ``route.final``) or ``ss-local`` on the same
   ss-server.  Measured: bulk goodput with 1 and 8 connections.

Before measuring, every path is checked end to end: two tunnels held open
through it (loadgen ``hold``, 16 bytes echoed by tinyserver) while the
established TCP sockets of every process in the chain are read from
/proc/PID/fd and /proc/net/tcp, so "PROXY dials A, A dials B, B dials the
target, PROXY never dials B or the target" is verified, not assumed.

Each path's bulk runs are sized from an unrecorded calibration run to last about
``--bulk-seconds``.  Runs are interleaved per case (A B, B A, A B, ...; with three
paths A B C, B C A, ...), ``--reps`` each, bounded in bytes and seconds (loadgen
cuts a bulk run at ``--bulk-max-seconds``); a run disturbed by other processes (more
than 10% of the machine's CPU, as in run_e2e.py) is repeated once while the
retry budget lasts.  Tables show the **median** of the undisturbed runs with
the spread ((max - min) / median) and the tested proxy's CPU per GB (bulk) or
per connection (conn/s).  Once ``--time-budget`` is spent, remaining cases run
once.  ``--quick`` takes under a minute, the full run under 5.

spliceway is started as in run_e2e.py (``python -m spliceway run -c CFG`` or
the in-tree shim); when it refuses a config ("this build cannot run: ...") or
accepts it but the check above fails, the script stops with a message and a
non-zero exit.  ``--only peers`` measures v2ray, ss-local (and the reference)
alone.  Output: the table on stdout, progress on stderr, every run in
benchmarks/results/<timestamp>-chain.json (git revision, load average, nproc,
package versions, configs) and the spliceway engines' logs beside it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import json
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import run_e2e as e2e  # noqa: E402  (shared tooling: build, tinyserver, engine launch, /proc)
from run_e2e import log  # noqa: E402

CIPHERS = ("aes-128-gcm", "aes-256-gcm", "chacha20-ietf-poly1305")
SW = "spliceway"
TAIL = 30  # lines of a failed peer's log shown in the error


# --------------------------------------------------------------------------- processes


class Peer:
    """A peer daemon (microsocks, v2ray, ss-server, ss-local) listening on ``port``.

    Its stdout and stderr go to a file (microsocks logs every connection, so no
    pipe that this process would have to drain during the runs).
    """

    def __init__(self, name: str, cmd: list[str], port: int, log_path: Path | None) -> None:
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        out = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=e2e.preexec,
            )
        finally:
            if log_path:
                out.close()  # type: ignore[union-attr]
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float = 15.0) -> None:
        if not e2e.wait_port(self.port, timeout) or self.proc.poll() is not None:
            self.stop()
            raise SystemExit(
                f"{self.name} ({' '.join(self.cmd)}) is not accepting on "
                f"127.0.0.1:{self.port}:\n{self.tail()}"
            )

    def tail(self) -> str:
        if not self.log_path or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-TAIL:])

    def stop(self) -> dict:
        killed = e2e.stop_child(self.proc, 5.0)
        return {"exit": self.proc.returncode, "killed": killed}


class Engine:
    """A spliceway engine (``run_e2e.start_spliceway``) with one socks5 inbound."""

    def __init__(self, name: str, config: dict, tmp: Path) -> None:
        self.name, self.config = name, config
        self.log_path = tmp / f"{name}.log"
        self.m, self.launch = e2e.start_spliceway(config, tmp / f"{name}.json", self.log_path)
        self.cmd = self.m.cmd
        self.pid = self.m.pid
        self.port = 0

    def wait_ready(self, timeout: float = 30.0) -> str | None:
        """None once the socks5 inbound listens, else why spliceway did not start."""
        m = self.m.wait_for(e2e.LISTEN_RE, timeout)
        if m is not None and self.m.alive():
            self.port = int(m.group(2))
            return None
        lines = list(self.m.lines)
        refusal = [x for x in lines if "cannot run" in x]
        self.stop()
        code = self.m.proc.returncode
        why = refusal[0] if refusal else "\n".join(lines[-TAIL:]) or "(no output)"
        return f"{self.name}: spliceway exited with status {code}: {why}"

    def stop(self) -> dict:
        return self.m.finish()


def v2ray_cmd(cfg: Path) -> list[str]:
    """v2ray 4.x takes ``-config FILE``; v5 moved to ``run -c FILE``."""
    try:
        out = subprocess.run(
            ["v2ray", "-version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    m = re.search(r"V2Ray (\d+)\.", out)
    if m and int(m.group(1)) >= 5:
        return ["v2ray", "run", "-c", str(cfg)]
    return ["v2ray", "-config", str(cfg)]


def package_version(pkg: str) -> str:
    return e2e.dpkg_version(pkg) or "?"


# --------------------------------------------------------------------------- configs


def spliceway_relay_config(port_a: int, port_b: int) -> dict:
    return {
        "inbounds": [e2e.socks_inbound()],
        "outbounds": [
            {"tag": "hop-a", "protocol": "socks5", "server": "127.0.0.1", "port": port_a},
            {"tag": "hop-b", "protocol": "socks5", "server": "127.0.0.1", "port": port_b},
        ],
        "outbound_groups": [{"tag": "chain", "kind": "relay", "outbounds": ["hop-a", "hop-b"]}],
        "route": {"final": "chain"},
        "api": e2e.NO_API,
    }


def spliceway_ss_config(port: int, method: str, password: str) -> dict:
    return {
        "inbounds": [e2e.socks_inbound()],
        "outbounds": [
            {
                "tag": "ss",
                "protocol": "shadowsocks",
                "server": "127.0.0.1",
                "port": port,
                "method": method,
                "password": password,
            }
        ],
        "route": {"final": "ss"},
        "api": e2e.NO_API,
    }


def v2ray_relay_config(listen: int, port_a: int, port_b: int, default_policy: bool) -> dict:
    """socks inbound -> hop-b (socks to B) whose connection is dialled through hop-a (A).

    v2ray's default policy keeps a connection open ``uplinkOnly`` = 1 s after the server's
    side has ended, so a client that waits for the server's close waits 1 s more; level 0
    gets 0 s (close once the server's side is done, as spliceway and microsocks do) unless
    ``default_policy``.
    """

    def socks_out(tag: str, port: int) -> dict:
        return {
            "tag": tag,
            "protocol": "socks",
            "settings": {"servers": [{"address": "127.0.0.1", "port": port}]},
        }

    return {
        # no access log: one line per connection would be v2ray-only work
        "log": {"loglevel": "warning", "access": "none"},
        "inbounds": [
            {
                "tag": "socks-in",
                "listen": "127.0.0.1",
                "port": listen,
                "protocol": "socks",
                "settings": {"auth": "noauth", "udp": False},
            }
        ],
        "outbounds": [
            {**socks_out("hop-b", port_b), "proxySettings": {"tag": "hop-a"}},
            socks_out("hop-a", port_a),
        ],
        **({} if default_policy else {"policy": {"levels": {"0": {"uplinkOnly": 0}}}}),
        "routing": {
            "domainStrategy": "AsIs",
            "rules": [{"type": "field", "inboundTag": ["socks-in"], "outboundTag": "hop-b"}],
        },
    }


# --------------------------------------------------------------------------- /proc sockets


def established_remote_ports(pid: int) -> list[int]:
    """Remote ports of the ESTABLISHED TCP sockets that ``pid`` holds (IPv4 and IPv6)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            next(f, None)
            for line in f:
                parts = line.split()
                if len(parts) > 9 and parts[3] == "01" and int(parts[9]) in inodes:
                    ports.append(int(parts[2].rsplit(":", 1)[1], 16))
    return ports


@dataclass
class Subject:
    """One path under test: loadgen speaks socks5 to ``port``; ``pid`` is the tested proxy."""

    name: str
    kind: str  # "spliceway" | "peer" | "ref"
    port: int
    pid: int
    hop_pids: list[int]
    # (label, pid, remote port it must be connected to) for the end-to-end check
    expect: list[tuple[str, int, int]] = field(default_factory=list)
    # (label, pid, remote port it must NOT be connected to)
    forbid: list[tuple[str, int, int]] = field(default_factory=list)


# --------------------------------------------------------------------------- the bench


@dataclass
class Case:
    key: str
    mode: str  # "bulk" | "rate"
    conns: int
    direction: str = ""

    @property
    def label(self) -> str:
        if self.mode == "rate":
            return f"conn/s c={self.conns}"
        return f"bulk {self.conns} {self.direction}"


class Bench:
    def __init__(self, args: argparse.Namespace, tools: dict[str, Path]) -> None:
        self.args = args
        self.tools = tools
        self.server: e2e.Server | None = None
        self.pids: list[int] = []  # every long-running process we started
        self.quiet = e2e.QuietWait(args, self.our_cpu)
        self.retries = e2e.RetryBudget(args.retries)
        self.deadline = time.monotonic() + args.time_budget
        self.cut = 0  # repetitions skipped because the time budget was spent
        self.sizes: dict[tuple[str, str], int] = {}  # (subject, bulk case) -> bytes per run

    def our_cpu(self) -> float:
        t = os.times()
        return t.user + t.system + e2e.pids_cpu_s(self.pids)

    def loadgen(self, argv: list[str], timeout: float) -> dict:
        return e2e.run_loadgen([str(self.tools["loadgen"]), *argv], timeout)

    def argv(self, case: Case, port: int, total: int | None = None) -> tuple[list[str], float]:
        """loadgen arguments for ``case`` through the socks5 port ``port``; a bulk run moves
        ``total`` bytes split over its connections, a rate run lasts --rate-seconds (or
        0.5 s when ``total`` is 0: a warm-up)."""
        a = self.args
        assert self.server is not None
        threads = min(case.conns, a.loadgen_threads)
        if case.mode == "rate":
            secs = 0.5 if total == 0 else a.rate_seconds
            return e2e.rate_argv(self.server.rate, port, case.conns, secs, threads), secs + 30
        assert total
        argv = e2e.bulk_argv(
            self.server.bulk,
            port,
            case.conns,
            total,
            case.direction,
            a.bulk_max_seconds,
            256 * 1024,
            threads,
        )
        return argv, a.bulk_max_seconds + 30

    def run(self, subj: Subject, case: Case) -> dict:
        """One loadgen run through ``subj`` with the CPU of every process involved."""
        assert self.server is not None
        waited, frac = self.quiet() if self.args.quiet_wait > 0 else (0.0, -1.0)
        argv, timeout = self.argv(case, subj.port, self.sizes.get((subj.name, case.key)))
        watched = [subj.pid, *subj.hop_pids, self.server.pid]
        pt0 = e2e.proc_table()
        c0 = {pid: e2e.proc_cpu_s(pid) for pid in watched}
        o0, m0, k0 = self.our_cpu(), e2e.machine_cpu()[0], e2e.kernel_threads_cpu()
        t0 = time.monotonic()
        res = self.loadgen(argv, timeout)
        wall = time.monotonic() - t0
        o1, m1, k1 = self.our_cpu(), e2e.machine_cpu()[0], e2e.kernel_threads_cpu()
        c1 = {pid: e2e.proc_cpu_s(pid) for pid in watched}
        top = e2e.top_cpu(pt0, e2e.proc_table(), {os.getpid(), *self.pids})
        for row in top:
            row["ours"] = row["ours"] or row["name"] == "loadgen"
        res["top_cpu"] = top
        d = {pid: c1[pid] - c0[pid] for pid in watched}
        res["loadgen_cpu_s"] = res.pop("cpu_s", 0.0)
        res["proxy_cpu_s"] = round(d[subj.pid], 3) if subj.kind != "ref" else 0.0
        res["hops_cpu_s"] = round(sum(d[p] for p in subj.hop_pids), 3)
        res["server_cpu_s"] = round(d[self.server.pid], 3)
        res["wall_s"] = round(wall, 3)
        res["kernel_threads_cpu_s"] = round(k1 - k0, 3)
        ours = (o1 - o0) + res["loadgen_cpu_s"]
        res["other_cpu_s"] = round(max(0.0, (m1 - m0) - ours - (k1 - k0)), 3)
        res["quiet_wait_s"] = round(waited, 2)
        res["other_share_before"] = round(frac, 3)
        res["disturbed"] = e2e.disturbed(res)
        return res

    def warm(self, subjects: list[Subject], cases: list[Case]) -> None:
        """Unrecorded runs through every subject: a 0.5 s conn/s run, and per bulk case a
        --calib-mib run whose goodput sizes that subject's bulk runs to --bulk-seconds."""
        a = self.args
        for subj in subjects:
            for case in cases:
                if case.mode == "rate":
                    self.loadgen(*self.argv(case, subj.port, 0))
                    continue
                res = self.loadgen(*self.argv(case, subj.port, a.calib_mib << 20))
                want = int(res["mb_per_s"] * 1e6 * a.bulk_seconds)
                size = min(a.bulk_mib << 20, max(a.calib_mib << 20, want)) >> 20 << 20
                self.sizes[(subj.name, case.key)] = size
                log(
                    f"  calibrate {case.label:<14} {subj.name:<24}{res['mb_per_s']:8.1f} MB/s"
                    f" -> {size >> 20} MiB per run"
                )

    def compare(self, subjects: list[Subject], cases: list[Case], tag: str) -> dict:
        """Every case through every subject, interleaved, ``--reps`` times each."""
        out: dict = {}
        for case in cases:
            runs: dict[str, list[dict]] = {s.name: [] for s in subjects}
            for rep in range(self.args.reps):
                if rep > 0 and time.monotonic() > self.deadline:
                    self.cut += len(subjects) * (self.args.reps - rep)
                    break
                k = rep % len(subjects)  # rotate: A B / B A / A B ... (A B C / B C A / ...)
                order = subjects[k:] + subjects[:k]
                for subj in order:
                    for res in self.retries.runs(lambda s=subj, c=case: self.run(s, c)):
                        runs[subj.name].append(res)
                        log(f"  {tag} {describe(case, subj.name, res)}")
            out[case.key] = {
                "case": case.__dict__,
                "subjects": {name: summarise(case, rs) for name, rs in runs.items()},
                "runs": runs,
            }
        return out

    def check(self, subj: Subject) -> dict:
        """Hold 2 tunnels through ``subj`` (echo verified) and read who is connected to whom
        (counts above those seen before, so a closing tunnel of an earlier check is not one)."""
        assert self.server is not None
        conns = 2
        pairs = subj.expect + subj.forbid
        before = {label: established_remote_ports(pid).count(port) for label, pid, port in pairs}
        p = e2e.start_hold(
            [str(self.tools["loadgen"])], self.server.idle, subj.port, conns, 20, 5000
        )
        try:
            first = e2e.read_json_line(p, 15) or {}
            time.sleep(0.1)
            seen = {
                label: established_remote_ports(pid).count(port) - before[label]
                for label, pid, port in pairs
            }
            with contextlib.suppress(OSError):
                assert p.stdin is not None
                p.stdin.write("\n")
                p.stdin.flush()
            p.communicate(timeout=15)
        finally:
            e2e.stop_child(p, 2.0)
        problems = []
        est = first.get("established", 0)
        if est != conns:
            problems.append(
                f"{est}/{conns} tunnels echoed 16 bytes end to end "
                f"(errors {first.get('first_errors') or first.get('errors')})"
            )
        problems += [
            f"{label}: {seen[label]} connection(s), expected >= {conns}"
            for label, _, _ in subj.expect
            if seen[label] < conns
        ]
        problems += [
            f"{label}: {seen[label]} connection(s), expected none"
            for label, _, _ in subj.forbid
            if seen[label]
        ]
        return {"ok": not problems, "established": est, "seen": seen, "problems": problems}


def describe(case: Case, name: str, res: dict) -> str:
    if case.mode == "rate":
        fig = f"{res['conn_per_s']:8.0f} conn/s p50={res['lat_us']['p50']:.0f}us"
    else:
        fig = f"{res['mb_per_s']:8.1f} MB/s" + ("  TRUNCATED" if res["truncated"] else "")
    errs = {k: v for k, v in res["errors"].items() if v}
    return (
        f"{case.label:<14} {name:<24}{fig}  proxy_cpu={res['proxy_cpu_s']:.2f}s "
        f"hops_cpu={res['hops_cpu_s']:.2f}s other_cpu={res['other_cpu_s']:.2f}s"
        + (f"  errors={errs}" if errs else "")
        + ("  (disturbed)" if res["disturbed"] else "")
    )


def summarise(case: Case, runs: list[dict]) -> dict:
    used = e2e.undisturbed(runs)
    metric = "conn_per_s" if case.mode == "rate" else "mb_per_s"
    vals = [x[metric] for x in used]
    out: dict = {
        "median": round(statistics.median(vals), 1) if vals else None,
        "min": round(min(vals), 1) if vals else None,
        "max": round(max(vals), 1) if vals else None,
        "spread_pct": round(e2e.spread(vals), 1),
        "runs_used": len(used),
        "runs": len(runs),
        "errors": sum(sum(x["errors"].values()) for x in runs),
    }
    cpu = sum(x["proxy_cpu_s"] for x in used)
    hops = sum(x["hops_cpu_s"] for x in used)
    if case.mode == "rate":
        n = sum(x["count"] for x in used)
        out["proxy_cpu_us_per_conn"] = round(1e6 * cpu / n, 1) if n else None
        out["hops_cpu_us_per_conn"] = round(1e6 * hops / n, 1) if n else None
        out["p50_us"] = round(statistics.median(x["lat_us"]["p50"] for x in used), 1)
        out["p99_us"] = round(statistics.median(x["lat_us"]["p99"] for x in used), 1)
    else:
        gb = sum(x["bytes"] for x in used) / 1e9
        out["proxy_cpu_s_per_gb"] = round(cpu / gb, 3) if gb else None
        out["hops_cpu_s_per_gb"] = round(hops / gb, 3) if gb else None
        out["truncated"] = sum(1 for x in runs if x["truncated"])
    return out


# --------------------------------------------------------------------------- report


def cell(case: Case, s: dict | None, show_cpu: bool) -> str:
    if not s or s["median"] is None:
        return f"{'-':>26}"
    cpu = s.get("proxy_cpu_us_per_conn") if case.mode == "rate" else s.get("proxy_cpu_s_per_gb")
    fmt = "{:>7.0f}" if case.mode == "rate" else "{:>7.1f}"
    c = (
        ""
        if not show_cpu or cpu is None
        else (f"{cpu:>6.0f}" if case.mode == "rate" else f"{cpu:>6.2f}")
    )
    flag = "!" if s["errors"] or s.get("truncated") else " "
    return f"{fmt.format(s['median'])} ±{s['spread_pct']:>3.0f}%{flag}{c:>7}   "


def table(part: dict, names: list[str], kinds: dict[str, str], indent: str = "   ") -> list[str]:
    ratio_vs = next((n for n in names if kinds[n] == "peer"), None)
    has_sw = any(kinds[n] == SW for n in names)
    head = f"{indent}{'case':<15}" + "".join(f"{n[:24]:<26}" for n in names)
    if has_sw and ratio_vs:
        head += f"sw/{ratio_vs}"
    lines = [head.rstrip()]
    for v in part.values():
        case = Case(**v["case"])
        row = f"{indent}{case.label:<15}"
        for n in names:
            row += cell(case, v["subjects"].get(n), kinds[n] != "ref")
        sw = next((v["subjects"].get(n) for n in names if kinds[n] == SW), None)
        peer = v["subjects"].get(ratio_vs) if ratio_vs else None
        if sw and peer and sw["median"] and peer["median"]:
            row += f"{sw['median'] / peer['median']:>7.2f}x"
        lines.append(row.rstrip())
    rates = [v for v in part.values() if v["case"]["mode"] == "rate"]
    for v in rates:
        lat = ", ".join(
            f"{n} {s['p50_us'] / 1000:.2f}/{s['p99_us'] / 1000:.2f}"
            for n, s in v["subjects"].items()
        )
        lines.append(f"{indent}conn/s p50/p99 ms per connection: {lat}")
    return lines


def report(res: dict) -> str:
    meta = res["meta"]
    L = [
        f"spliceway chain benchmark  {meta['timestamp']}  git {meta['git']}"
        + ("  (quick)" if meta["quick"] else ""),
        f"machine: {meta['nproc']} CPUs ({meta['cpu_model']}), kernel {meta['kernel']}, "
        f"loadavg {fmt_load(meta['loadavg_start'])} -> {fmt_load(meta['loadavg_end'])}",
        f"peers: v2ray {meta['versions']['v2ray']}, microsocks {meta['versions']['microsocks']}, "
        f"shadowsocks-libev {meta['versions']['shadowsocks-libev']}; spliceway: "
        f"{meta['spliceway_launch'] or 'not run (--only peers)'}",
        f"cells: median MB/s or conn/s of {meta['reps']} interleaved runs (undisturbed), "
        "±spread = (max-min)/median, then the tested proxy's CPU in s/GB (bulk) or "
        "us/conn (conn/s); ! = errors or truncated runs",
        f"bulk: each path's runs sized to ~{meta['bulk_seconds']} s from a {meta['calib_mib']}"
        " MiB calibration run, split over the connections, 256 KiB buffers; "
        f"conn/s: {meta['rate_seconds']} s per run, 100 B request, 1 KiB response",
    ]
    kinds = meta["kinds"]
    if "relay" in res:
        r = res["relay"]
        L += [
            "",
            "1. Relay of two socks5 hops: loadgen -> PROXY -> microsocks A -> "
            "microsocks B -> tinyserver",
        ]
        L += table(r["cases"], r["subjects"], kinds)
        L += check_lines(r["checks"], "   ")
    if "ss" in res:
        s = res["ss"]
        L += [
            "",
            "2. Shadowsocks: loadgen -> PROXY (socks5 in, shadowsocks out) -> "
            "ss-server -> tinyserver",
        ]
        for cipher, part in s["ciphers"].items():
            L.append(f"   {cipher}")
            L += table(part["cases"], part["subjects"], kinds, indent="     ")
            L += check_lines(part["checks"], "     ")
    notes = res.get("notes") or []
    if notes:
        L += ["", "Notes:"] + [f"   - {n}" for n in notes]
    return "\n".join(L)


def fmt_load(x: list[float] | tuple[float, ...]) -> str:
    return "/".join(f"{v:.2f}" for v in x)


def check_lines(checks: dict, indent: str) -> list[str]:
    """One line per path: the established connections seen with 2 tunnels held open."""
    out = []
    for name, c in checks.items():
        seen = ", ".join(f"{k} {v}" for k, v in c["seen"].items())
        out.append(f"{indent}check {name}: {'ok' if c['ok'] else 'FAILED'} ({seen})")
    return out


def collect_notes(res: dict, bench: Bench) -> list[str]:
    notes = []
    runs = []
    for part in [res.get("relay", {}).get("cases", {})] + [
        p["cases"] for p in res.get("ss", {}).get("ciphers", {}).values()
    ]:
        for v in part.values():
            for rs in v["runs"].values():
                runs += rs
    busy = [x for x in runs if x["disturbed"]]
    if busy:
        others: collections.Counter[str] = collections.Counter()
        for r in busy:
            for t in r.get("top_cpu", []):
                if not t["ours"]:
                    others[t["name"]] += t["cpu_s"]
        top = ", ".join(f"{k} {v:.1f} s" for k, v in others.most_common(4))
        notes.append(
            f"{len(busy)}/{len(runs)} runs disturbed by other processes (>10% of the machine's "
            "CPU); medians use the undisturbed ones where there are any"
            + (f"; biggest: {top}" if top else "")
        )
    if bench.cut:
        notes.append(f"time budget spent: {bench.cut} repetitions skipped (cases then ran once)")
    errs = [x for x in runs if any(x["errors"].values())]
    if errs:
        notes.append(f"{len(errs)}/{len(runs)} runs had loadgen errors (see the JSON)")
    for name, st in res.get("engine_stop", {}).items():
        notes += e2e.stop_notes(st, f"{name}: ", "engine")
    return notes


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short run (under a minute)")
    ap.add_argument("--parts", default="relay,ss", help="comma list of relay,ss")
    ap.add_argument(
        "--only",
        choices=("all", "peers"),
        default="all",
        help="peers: measure v2ray / ss-local (and the reference) without spliceway",
    )
    ap.add_argument(
        "--cipher",
        action="append",
        choices=CIPHERS,
        help="ss part: cipher(s) to test (repeatable; default all three, quick: chacha20)",
    )
    ap.add_argument("--reps", type=int, help="runs per case and path (default 3, quick 2)")
    ap.add_argument(
        "--bulk-seconds",
        type=float,
        help="bulk runs are sized (from a calibration run) to last this long "
        "(default 1.5, quick 0.8)",
    )
    ap.add_argument("--calib-mib", type=int, default=32, help="MiB of a calibration run")
    ap.add_argument("--bulk-mib", type=int, default=4096, help="cap on the MiB of one bulk run")
    ap.add_argument(
        "--bulk-max-seconds", type=float, help="cut a bulk run after this (default 6, quick 4)"
    )
    ap.add_argument(
        "--v2ray-default-policy",
        action="store_true",
        help="keep v2ray's default 1 s uplinkOnly timer (a connection then ends ~1 s after "
        "the server's close: ~60 conn/s at concurrency 64)",
    )
    ap.add_argument(
        "--rate-seconds", type=float, help="seconds per conn/s run (default 3, quick 1.5)"
    )
    ap.add_argument(
        "--dirs", help="bulk directions, comma list of down,up (default both, quick down)"
    )
    ap.add_argument(
        "--ref",
        action=argparse.BooleanOptionalAction,
        help="relay part: also measure one microsocks hop alone (default on, off with --quick)",
    )
    ap.add_argument(
        "--time-budget",
        type=float,
        help="seconds after which remaining cases run once (default 240, quick 40)",
    )
    ap.add_argument("--loadgen-threads", type=int, default=2)
    ap.add_argument("--server-threads", type=int, default=2)
    e2e.add_quiet_options(
        ap,
        wait=None,
        wait_help="before each run wait up to this long for other processes to calm down "
        "(0 = never, the default: disturbed runs are detected and repeated instead)",
        budget=20.0,
        retries_help="disturbed runs repeated (default 6, quick 2)",
    )
    a = ap.parse_args(argv)
    q = a.quick
    a.reps = a.reps or (2 if q else 3)
    a.bulk_seconds = a.bulk_seconds or (0.8 if q else 1.5)
    a.bulk_max_seconds = a.bulk_max_seconds or (4.0 if q else 6.0)
    a.rate_seconds = a.rate_seconds or (1.5 if q else 3.0)
    a.dirs = [d for d in (a.dirs or ("down" if q else "down,up")).split(",") if d]
    a.ciphers = a.cipher or (["chacha20-ietf-poly1305"] if q else list(CIPHERS))
    a.ref = (not q) if a.ref is None else a.ref
    a.time_budget = a.time_budget or (40.0 if q else 240.0)
    a.quiet_wait = a.quiet_wait or 0.0
    a.retries = (2 if q else 6) if a.retries is None else a.retries
    a.parts = [p for p in a.parts.split(",") if p]
    bad = set(a.parts) - {"relay", "ss"} or set(a.dirs) - {"down", "up"}
    if bad:
        ap.error(f"unknown value(s): {sorted(bad)}")
    return a


def need(cmds: list[str]) -> None:
    missing = [c for c in cmds if shutil.which(c) is None]
    if missing:
        raise SystemExit(
            f"not installed: {', '.join(missing)} (apt-get install microsocks v2ray "
            "shadowsocks-libev)"
        )


class Lab:
    """Every process of the run: tinyserver, the hops, the peers and spliceway engines.

    ``start`` launches them all (spliceway first after the hops, so a refused config ends
    the run before anything else), builds the subjects of both parts and checks each
    path end to end; ``stop`` ends each process it started, by pid.
    """

    def __init__(self, a: argparse.Namespace, bench: Bench, tmp: Path, meta: dict) -> None:
        self.a, self.b, self.tmp, self.meta = a, bench, tmp, meta
        self.password = "bench-" + secrets.token_hex(8)
        self.peers: list[Peer] = []
        self.engines: dict[str, Engine] = {}
        self.relay: list[Subject] = []
        self.ss: dict[str, list[Subject]] = {}
        self.checks: dict[str, dict] = {}

    def peer(self, name: str, cmd: list[str], port: int, keep_log: bool = True) -> Peer:
        p = Peer(name, cmd, port, self.tmp / f"{name}.log" if keep_log else None)
        self.peers.append(p)
        self.b.pids.append(p.pid)
        self.meta["commands"][name] = cmd
        return p

    def start(self, tools: dict[str, Path]) -> None:
        a, b = self.a, self.b
        b.server = e2e.Server(tools["tinyserver"], None, 900, a.server_threads)
        b.pids.append(b.server.pid)
        hops: list[Peer] = []
        if "relay" in a.parts:
            for name in ("microsocks-A", "microsocks-B"):
                port = e2e.free_port()
                cmd = ["microsocks", "-i", "127.0.0.1", "-p", str(port)]
                hops.append(self.peer(name, cmd, port, keep_log=False))
        servers: dict[str, Peer] = {}
        for c in a.ciphers if "ss" in a.parts else ():
            port = e2e.free_port()
            cmd = ["ss-server", "-s", "127.0.0.1", "-p", str(port), "-k", self.password, "-m", c]
            servers[c] = self.peer(f"ss-server-{c}", cmd, port)
        for p in self.peers:
            p.wait_ready()
        if a.only == "all":
            self.start_engines(hops, servers)
        if hops:
            self.relay_subjects(hops[0], hops[1])
        for c, srv in servers.items():
            self.ss_subjects(c, srv)
        for s in self.relay + [x for v in self.ss.values() for x in v]:
            self.meta["kinds"][s.name] = s.kind
        log(
            "started: "
            + ", ".join(f"{p.name} pid {p.pid} :{p.port}" for p in self.peers)
            + "".join(f", {e.name} pid {e.pid} :{e.port}" for e in self.engines.values())
            + f"; tinyserver pid {b.server.pid}"
        )

    def start_engines(self, hops: list[Peer], servers: dict[str, Peer]) -> None:
        """One spliceway engine per config, all started together; exits if any refuses."""
        configs = {}
        if hops:
            configs["spliceway-relay"] = spliceway_relay_config(hops[0].port, hops[1].port)
        for c, srv in servers.items():
            configs[f"spliceway-ss-{c}"] = spliceway_ss_config(srv.port, c, self.password)
        for name, cfg in configs.items():
            e = self.engines[name] = Engine(name, cfg, self.tmp)
            self.b.pids.append(e.pid)
            self.meta["commands"][name] = e.cmd
            self.meta["configs"][name] = cfg
            self.meta["spliceway_launch"] = e.launch
        problems = [w for e in self.engines.values() if (w := e.wait_ready()) is not None]
        if problems:
            raise SystemExit(
                "spliceway refused the benchmark's config(s):\n  "
                + "\n  ".join(problems)
                + "\n(--only peers measures v2ray and ss-local alone; --parts selects "
                "relay and/or ss)"
            )

    def relay_subjects(self, hop_a: Peer, hop_b: Peer) -> None:
        a, target = self.a, self.b.server.idle  # type: ignore[union-attr]
        hop_pids = [hop_a.pid, hop_b.pid]
        if "spliceway-relay" in self.engines:
            e = self.engines["spliceway-relay"]
            self.relay.append(Subject(SW, SW, e.port, e.pid, hop_pids))
        port = e2e.free_port()
        cfg = v2ray_relay_config(port, hop_a.port, hop_b.port, a.v2ray_default_policy)
        path = self.tmp / "v2ray.json"
        path.write_text(json.dumps(cfg, indent=1))
        self.meta["configs"]["v2ray"] = cfg
        v2 = self.peer("v2ray", v2ray_cmd(path), port)
        v2.wait_ready()
        self.relay.append(Subject("v2ray", "peer", port, v2.pid, hop_pids))
        for s in self.relay:
            s.expect = [
                (f"{s.name}->A", s.pid, hop_a.port),
                ("A->B", hop_a.pid, hop_b.port),
                ("B->target", hop_b.pid, target),
            ]
            s.forbid = [
                (f"{s.name}->B", s.pid, hop_b.port),
                (f"{s.name}->target", s.pid, target),
                ("A->target", hop_a.pid, target),
            ]
        if a.ref:
            ref = Subject("1 hop (microsocks B)", "ref", hop_b.port, hop_b.pid, [hop_b.pid])
            ref.expect = [("B->target", hop_b.pid, target)]
            self.relay.append(ref)

    def ss_subjects(self, cipher: str, srv: Peer) -> None:
        target = self.b.server.idle  # type: ignore[union-attr]
        subs = []
        if f"spliceway-ss-{cipher}" in self.engines:
            e = self.engines[f"spliceway-ss-{cipher}"]
            subs.append(Subject(SW, SW, e.port, e.pid, [srv.pid]))
        port = e2e.free_port()
        cmd = ["ss-local", "-s", "127.0.0.1", "-p", str(srv.port), "-l", str(port)]
        cmd += ["-b", "127.0.0.1", "-k", self.password, "-m", cipher]
        local = self.peer(f"ss-local-{cipher}", cmd, port)
        local.wait_ready()
        subs.append(Subject("ss-local", "peer", port, local.pid, [srv.pid]))
        for s in subs:
            s.expect = [
                (f"{s.name}->ss-server", s.pid, srv.port),
                ("ss-server->target", srv.pid, target),
            ]
            s.forbid = [(f"{s.name}->target", s.pid, target)]
        self.ss[cipher] = subs

    def check_all(self) -> None:
        """Every path end to end before anything is measured; exits if one fails."""
        failed = []
        groups = {"relay": self.relay, **self.ss}
        for what, subjects in groups.items():
            self.checks[what] = {}
            for s in subjects:
                c = self.checks[what][s.name] = self.b.check(s)
                log(f"check {what} {s.name}: {'ok' if c['ok'] else 'FAILED'} {c['seen']}")
                if not c["ok"]:
                    failed.append(f"{what} via {s.name}: " + "; ".join(c["problems"]))
        if failed:
            raise SystemExit(
                "end-to-end check failed (nothing measured):\n  "
                + "\n  ".join(failed)
                + "".join(
                    f"\n{e.name} log tail:\n" + "\n".join(list(e.m.lines)[-10:])
                    for e in self.engines.values()
                )
            )

    def stop(self, res: dict) -> None:
        res["engine_stop"] = {n: e.stop() for n, e in self.engines.items()}
        res["peer_stop"] = {p.name: p.stop() for p in self.peers}
        if self.b.server is not None:
            self.b.server.stop()


def measure(lab: Lab, bench: Bench, a: argparse.Namespace, res: dict) -> None:
    bulk = [Case(f"bulk-{n}-{d}", "bulk", n, d) for d in a.dirs for n in (1, 8)]
    if lab.relay:
        log("1. relay of two socks5 hops ...")
        cases = [*bulk, Case("rate-64", "rate", 64)]
        bench.warm(lab.relay, cases)
        res["relay"] = {
            "subjects": [s.name for s in lab.relay],
            "checks": lab.checks["relay"],
            "cases": bench.compare(lab.relay, cases, "relay"),
        }
    if lab.ss:
        log("2. shadowsocks outbound vs ss-local ...")
        res["ss"] = {"ciphers": {}}
        for c, subs in lab.ss.items():
            bench.warm(subs, bulk)
            res["ss"]["ciphers"][c] = {
                "subjects": [s.name for s in subs],
                "checks": lab.checks[c],
                "cases": bench.compare(subs, bulk, c.split("-ietf")[0]),
            }


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    need(
        (["microsocks", "v2ray"] if "relay" in a.parts else [])
        + (["ss-server", "ss-local"] if "ss" in a.parts else [])
    )
    e2e.raise_nofile()
    tools = e2e.build_tools(a.cc)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    a.out.mkdir(parents=True, exist_ok=True)
    base = a.out / f"{stamp}-chain"
    meta = {
        "timestamp": stamp,
        "quick": a.quick,
        "parts": a.parts,
        "only": a.only,
        "reps": a.reps,
        "bulk_seconds": a.bulk_seconds,
        "calib_mib": a.calib_mib,
        "bulk_mib_cap": a.bulk_mib,
        "bulk_max_seconds": a.bulk_max_seconds,
        "v2ray_policy": "default" if a.v2ray_default_policy else "uplinkOnly=0",
        "rate_seconds": a.rate_seconds,
        "dirs": a.dirs,
        "ciphers": a.ciphers if "ss" in a.parts else [],
        "loadgen_threads": a.loadgen_threads,
        "server_threads": a.server_threads,
        **e2e.host_meta(),
        "git": e2e.git_info(),
        "loadavg_start": os.getloadavg(),
        "versions": {p: package_version(p) for p in ("v2ray", "microsocks", "shadowsocks-libev")},
        "spliceway_launch": None,
        "kinds": {},
        "commands": {},
        "configs": {},
    }
    res: dict = {"meta": meta}
    t_start = time.monotonic()
    bench = Bench(a, tools)
    with tempfile.TemporaryDirectory(prefix="sw-bench-chain-") as tmpd:
        lab = Lab(a, bench, Path(tmpd), meta)
        try:
            lab.start(tools)
            lab.check_all()
            measure(lab, bench, a, res)
        finally:
            lab.stop(res)
        for e in lab.engines.values():
            if e.log_path.exists():
                shutil.copy(e.log_path, f"{base}.{e.name}.log")
    meta["loadavg_end"] = os.getloadavg()
    meta["elapsed_s"] = round(time.monotonic() - t_start, 1)
    res["notes"] = collect_notes(res, bench)
    e2e.publish(res, report(res), base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
