#!/usr/bin/env python3
"""End-to-end benchmark of a SOCKS5 proxy (spliceway by default) against a local server.

    python benchmarks/run_e2e.py [--proxy spliceway|microsocks|CMD] [--quick]

Builds benchmarks/loadgen.c and benchmarks/tinyserver.c with ``cc -O2`` into
benchmarks/build/, starts tinyserver and the proxy on 127.0.0.1, and measures,
each time directly and through the proxy in the same run (interleaved):

1. bulk goodput, 1 and 8 connections, upload and download (MB/s, ratio);
2. the proxy's CPU seconds per GB relayed during those bulk runs;
3. connections/s at concurrency 1, 16, 64 with p50/p99 latency per connection;
4. the proxy's RSS per idle relayed flow with 5,000 open tunnels (fresh proxy).

Prints a table and writes benchmarks/results/<timestamp>.json.  Every server
listens on 127.0.0.1 only; every load run is bounded in count and time.
See benchmarks/README.md for the method.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import datetime as dt
import json
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NoReturn

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
BUILD = BENCH / "build"
RESULTS = BENCH / "results"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024
LOG_CAP = 20 << 20  # bytes of a proxy's stderr kept in results/
NOFILE = 200_000  # RLIMIT_NOFILE for the proxy and the tools (raised hard limit: we run as root)

TARGETS = {
    "bulk_ratio_8": 0.85,
    "cpu_s_per_gb": 0.2,
    "conn_ratio_64": 0.45,
    "p50_us_c1": 200.0,
    "rss_kib_per_flow": 9.0,
}
PEERS = {
    "bulk_ratio_8": "naive threaded Python relay 0.73x, v2ray 0.60x",
    "conn_ratio_64": "tinyproxy/microsocks 0.39x, v2ray 0.33-0.38x, pproxy 0.14x",
    "rss_kib_per_flow": "pproxy 8.7, microsocks 10.5, v2ray 36",
}


def socks_inbound() -> dict:
    """The engine's socks5 inbound on 127.0.0.1 with an OS-chosen port (read from its log)."""
    return {"tag": "socks-in", "protocol": "socks5", "listen": {"address": "127.0.0.1", "port": 0}}


NO_API = {"control": {"enabled": False}, "ipc": {"enabled": False}}
SPLICEWAY_CONFIG = {
    "inbounds": [socks_inbound()],
    "outbounds": [{"tag": "direct", "protocol": "direct"}],
    "api": NO_API,
}
LISTEN_RE = re.compile(r"inbound \S+ \(socks5\) listening on ([0-9.]+):(\d+)")
# Shim for a tree that is not pip-installed: spliceway.actors/api/connector live at the
# top level (pyproject's package-dir), so let the spliceway package find them there.
ENGINE_SHIM = (
    "import sys, spliceway; spliceway.__path__.append({root!r}); "
    "from spliceway.cli.main import main; sys.exit(main(['run', '-c', {cfg!r}]))"
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- building


def build_tool(cc: str, name: str, flags: Iterable[str] = ()) -> Path:
    """``cc -O2 [flags]`` benchmarks/<name>.c into build/<name> when the source is newer."""
    BUILD.mkdir(exist_ok=True)
    src, exe = BENCH / f"{name}.c", BUILD / name
    if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
        cmd = [cc, "-O2", *flags, "-Wall", "-Wextra", "-o", str(exe), str(src)]
        log("build: " + " ".join(cmd))
        subprocess.run(cmd, check=True)
    return exe


def build_tools(cc: str, names: Iterable[str] = ("loadgen", "tinyserver")) -> dict[str, Path]:
    """``cc -O2 -pthread`` each benchmarks/<name>.c into build/<name> when the source is newer."""
    return {name: build_tool(cc, name, ("-pthread",)) for name in names}


# --------------------------------------------------------------------------- processes


def raise_nofile(limit: int = NOFILE) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for want in (max(limit, hard), hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(want, hard)))
            return want
        except (ValueError, OSError):
            continue
    return soft


def read_stat(path: str) -> tuple[str, int, float]:
    """(command name, parent pid, utime + stime in seconds) from a /proc/.../stat file."""
    with open(path) as f:
        raw = f.read()
    head, _, tail = raw.rpartition(")")
    fields = tail.split()
    cpu_s = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return head[head.index("(") + 1 :], int(fields[1]), cpu_s


def proc_cpu_s(pid: int) -> float:
    """utime + stime of every thread of ``pid``, in seconds."""
    return read_stat(f"/proc/{pid}/stat")[2]


def pids_cpu_s(pids: Iterable[int]) -> float:
    """CPU seconds of the given processes (one that has gone counts 0)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += proc_cpu_s(pid)
    return total


def proc_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def proc_threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def proc_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def machine_cpu() -> tuple[float, float]:
    """(task CPU = user+nice+system, all busy incl. irq/softirq) of the whole machine, s."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = (v + [0] * 7)[:7]
    return (user + nice + system) / CLK_TCK, (user + nice + system + irq + softirq) / CLK_TCK


def proc_table() -> dict[int, tuple[str, int, float]]:
    """pid -> (command name, parent pid, CPU seconds) of every process."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            out[int(entry.name)] = read_stat(f"/proc/{entry.name}/stat")
        except OSError:
            continue
    return out


def top_cpu(before: dict, after: dict, ours: set[int], n: int = 6) -> list[dict]:
    """The processes that used the most CPU between two ``proc_table`` snapshots."""
    rows = []
    for pid, (name, _, cpu) in after.items():
        used = cpu - before.get(pid, (name, 0, 0.0))[2]
        if used >= 0.05:
            rows.append({"pid": pid, "name": name, "cpu_s": round(used, 2), "ours": pid in ours})
    rows.sort(key=lambda r: -r["cpu_s"])
    return rows[:n]


def kernel_threads_cpu() -> float:
    """CPU seconds of all kernel threads (ksoftirqd doing loopback work, kworkers, ...)."""
    return sum(  # kthreadd (pid 2) and its children
        cpu for pid, (_, ppid, cpu) in proc_table().items() if ppid == 2 or pid == 2
    )


def affinity(pid: int) -> str:
    try:
        cpus = sorted(os.sched_getaffinity(pid))
    except OSError:
        return "?"
    return ",".join(map(str, cpus))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def preexec() -> None:
    """Child setup before exec: the raised fd limit, its own process group, dies with us."""
    raise_nofile()
    os.setpgrp()  # own process group: a Ctrl-C on the runner does not hit it first
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)  # and it ends if the runner dies


def taskset_prefix(cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus] if cpus else []


def stop_child(proc: subprocess.Popen, grace: float = 5.0) -> bool:
    """SIGTERM, then SIGKILL after ``grace`` seconds; this child's pid only. True if killed."""
    if proc.poll() is not None:
        return False
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
        return True
    return False


class Children:
    """Helper processes a runner starts (:func:`preexec`, in the repository's root),
    stopped by pid in its ``finally``."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(cmd, preexec_fn=preexec, cwd=ROOT, **kw)
        self.procs.append(p)
        return p

    def reap(self) -> None:
        for p in self.procs:
            stop_child(p)
        self.procs = [p for p in self.procs if p.poll() is None]


class Managed:
    """A child process whose stderr is drained by a thread (kept for the report)."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        *,
        cwd: Path | None = None,
        stdout: int | None = subprocess.DEVNULL,
    ) -> None:
        self.name = name
        self.cmd = cmd
        self.proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=preexec,
        )
        self.pid = self.proc.pid
        self.lines: collections.deque[str] = collections.deque(maxlen=2000)
        self.log_path: Path | None = None
        self._log = None
        self._logged = 0
        self.all_count = 0
        # exception signatures: the last line of each traceback (type: message) -> count
        self.exceptions: collections.Counter[str] = collections.Counter()
        self.flagged: list[str] = []
        self.flag_count = 0
        self._event = threading.Event()
        self._match: re.Match | None = None
        self._pattern: re.Pattern | None = None
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def keep_log(self, path: Path) -> None:
        """Also write every stderr line to ``path`` (call right after starting)."""
        self.log_path = path
        self._log = open(path, "a")  # noqa: SIM115 - closed by the drain thread

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        in_tb = False
        for line in self.proc.stderr:
            if self._log is not None and self._logged < LOG_CAP:
                self._log.write(line)
                self._logged += len(line)
            line = line.rstrip("\n")
            self.lines.append(line)
            self.all_count += 1
            if line.startswith("Traceback (most recent call last)"):
                in_tb = True
            elif in_tb and line and not line.startswith((" ", "\t")):
                self.exceptions[line[:200]] += 1
                in_tb = False
            if re.search(r"\b(ERROR|CRITICAL|Traceback|Exception)\b", line):
                self.flag_count += 1
                if len(self.flagged) < 20:
                    self.flagged.append(line)
            if self._pattern is not None and self._match is None:
                m = self._pattern.search(line)
                if m:
                    self._match = m
                    self._event.set()
        if self._log is not None:
            self._log.close()
        self._event.set()

    def wait_for(self, pattern: re.Pattern, timeout: float) -> re.Match | None:
        self._pattern = pattern
        for line in list(self.lines):
            m = pattern.search(line)
            if m:
                return m
        self._event.wait(timeout)
        return self._match

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 10.0) -> dict:
        """SIGTERM, then SIGKILL after ``grace`` seconds; only this child's pid."""
        killed = stop_child(self.proc, grace)
        self._thread.join(2)
        return {"exit": self.proc.returncode, "killed": killed}

    def abort(self, problem: str) -> NoReturn:
        """Stop the child and exit the benchmark with ``problem`` and its last stderr lines."""
        out = "\n".join(list(self.lines)[-30:])
        self.stop(3)
        raise SystemExit(f"{problem}:\n{out}")

    def stderr_report(self) -> dict:
        """What its stderr held: line counts, flagged lines, tracebacks by exception."""
        return {
            "stderr_lines": self.all_count,
            "flagged_lines": self.flag_count,
            "flagged_examples": self.flagged[:10],
            "exceptions": dict(self.exceptions.most_common(10)),
        }

    def reported_port(self, pattern: re.Pattern, problem: str, timeout: float = 30) -> int:
        """The port (second group) of the first stderr line ``pattern`` matches; the
        benchmark exits with ``problem`` when none comes in ``timeout`` s or the child died."""
        m = self.wait_for(pattern, timeout)
        if m is None or not self.alive():
            self.abort(problem)
        return int(m.group(2))

    def finish(self) -> dict:
        """Stop it (10 s grace): the exit, and what its stderr held."""
        info = self.stop(10)
        info.update(self.stderr_report())
        return info


class Server:
    """tinyserver with its rate, bulk and idle listeners."""

    def __init__(self, exe: Path, pin: str | None, max_seconds: float, threads: int) -> None:
        cmd = [
            *taskset_prefix(pin),
            str(exe),
            "--threads",
            str(threads),
            "--rate",
            "0",
            "--bulk",
            "0",
            "--idle",
            "0",
            "--req",
            "100",
            "--resp",
            "1024",
            "--max-seconds",
            str(int(max_seconds)),
        ]
        self.m = Managed("tinyserver", cmd, stdout=subprocess.PIPE)
        assert self.m.proc.stdout is not None
        line = self.m.proc.stdout.readline()
        if not line:
            raise SystemExit("tinyserver did not start: " + "\n".join(self.m.lines))
        info = json.loads(line)
        self.rate, self.bulk, self.idle, self.pid = (
            info["rate"],
            info["bulk"],
            info["idle"],
            self.m.pid,
        )

    def stop(self) -> dict:
        return self.m.stop(3)


# --------------------------------------------------------------------------- proxies


def spliceway_launch_cmd(cfg: Path) -> tuple[list[str], str]:
    """``python -m spliceway run -c cfg`` when installed, else the in-tree shim."""
    probe = subprocess.run(
        [sys.executable, "-c", "import spliceway.native.relay, spliceway.actors"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if probe.returncode == 0:
        return [sys.executable, "-m", "spliceway", "run", "-c", str(cfg)], "python -m spliceway"
    relay = subprocess.run(
        [sys.executable, "-c", "import spliceway.native.relay"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if relay.returncode != 0:
        raise SystemExit(
            "spliceway is not runnable yet (import spliceway.native.relay failed):\n"
            + relay.stderr.strip().splitlines()[-1]
        )
    code = ENGINE_SHIM.format(root=str(ROOT), cfg=str(cfg))
    return [sys.executable, "-c", code], "in-tree shim (not pip-installed)"


def start_spliceway(
    config: dict, cfg: Path, log_path: Path | None, prefix: list[str] | None = None
) -> tuple[Managed, str]:
    """The engine on ``config`` (written to ``cfg``), its stderr kept in ``log_path``;
    (the child, how it was launched)."""
    cfg.write_text(json.dumps(config, indent=1))
    base, launch = spliceway_launch_cmd(cfg)
    m = Managed("spliceway", [*(prefix or []), *base], cwd=ROOT)
    if log_path:
        m.keep_log(log_path)
    return m, launch


def add_run_options(
    ap: argparse.ArgumentParser,
    reps: int,
    per: str = "variant and concurrency",
    spread: tuple[str, str, str] = ("--conc", "1,16", "connections in flight"),
) -> None:
    """The options of a repeated, alternated benchmark: ``--quick``, ``--reps``,
    ``--seconds``, the comma-separated ``spread`` option (name, default, what it
    counts) and ``--cc``."""
    ap.add_argument("--quick", action="store_true", help="1 run of 2 s per case")
    ap.add_argument("--reps", type=int, default=reps, help=f"runs per {per}")
    ap.add_argument("--seconds", type=float, default=3.0, help="length of one run")
    flag, default, what = spread
    ap.add_argument(flag, default=default, help=f"{what}, comma separated")
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"))


def add_quiet_options(
    ap: argparse.ArgumentParser,
    *,
    wait: float | None = 8.0,
    wait_help: str | None = None,
    budget: float | None = None,
    budget_help: str | None = None,
    retries_help: str | None = None,
) -> None:
    """The options of a benchmark that waits for a quiet machine and repeats disturbed
    runs: ``--quiet-wait``, ``--quiet-threshold``, ``--quiet-budget``, ``--retries``
    (when ``retries_help`` says what it counts), then ``--cc`` and ``--out``."""
    ap.add_argument("--quiet-wait", type=float, default=wait, help=wait_help)
    ap.add_argument("--quiet-threshold", type=float, default=0.10)
    ap.add_argument("--quiet-budget", type=float, default=budget, help=budget_help)
    if retries_help is not None:
        ap.add_argument("--retries", type=int, help=retries_help)
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"))
    ap.add_argument("--out", type=Path, default=RESULTS)


def flow_medians(runs: list[dict], *extra: str) -> dict[str, float]:
    """Medians over the loadgen rate runs of one variant and concurrency (and over
    each ``extra`` key, when the runs carry it)."""
    med = statistics.median
    out = {
        "conn_per_s": med(r["conn_per_s"] for r in runs),
        "p50_us": med(r["lat_us"]["p50"] for r in runs),
        "p99_us": med(r["lat_us"]["p99"] for r in runs),
        "engine_cpu_us": med(r["engine_cpu_us"] for r in runs),
        "runs": len(runs),
    }
    for key in extra:
        if runs and key in runs[0]:
            out[key] = med(r[key] for r in runs)
    return out


class EngineProcess:
    """One engine as its own process (``<variant>.json``, ``<variant>.log``), and the
    port it reports (its socks5 inbound's unless ``pattern`` names another)."""

    def __init__(
        self,
        variant: str,
        config: dict,
        tmp: Path,
        out: Path,
        pattern: re.Pattern = LISTEN_RE,
        what: str = "its socks5 port",
    ) -> None:
        self.variant = variant
        self.m, self.launch = start_spliceway(
            config, tmp / f"{variant}.json", out / f"{variant}.log"
        )
        self.port = self.m.reported_port(pattern, f"{variant}: spliceway did not report {what}")

    def cpu(self) -> float:
        return proc_cpu_s(self.m.pid)

    def stop(self) -> dict:
        return self.m.finish()


class Proxy:
    """The proxy under test, started as its own process."""

    def __init__(self, kind: str, pin: str | None, tmp: Path, log_path: Path | None = None) -> None:
        self.kind = kind
        if kind == "spliceway":
            self.m, self.launch = start_spliceway(
                SPLICEWAY_CONFIG, tmp / "spliceway.json", log_path, taskset_prefix(pin)
            )
            self.port = self.m.reported_port(LISTEN_RE, "spliceway did not report its socks5 port")
        else:
            port = free_port()
            if kind == "microsocks":
                base = ["microsocks", "-i", "127.0.0.1", "-p", str(port)]
                self.launch = "microsocks"
            else:
                base = shlex.split(kind.format(port=port))
                self.launch = "custom command ({port} = chosen port)"
            cmd = [*taskset_prefix(pin), *base]
            self.m = Managed(kind.split()[0], cmd)
            if log_path:
                self.m.keep_log(log_path)
            if not wait_port(port, 15) or not self.m.alive():
                self.m.abort(f"proxy {cmd} is not accepting on 127.0.0.1:{port}")
            self.port = port
        self.pid = self.m.pid
        # taskset/prlimit exec into the proxy, so the pid is the proxy's own.
        self.cmd = self.m.cmd

    def cpu(self) -> float:
        return proc_cpu_s(self.pid)

    def rss(self) -> int:
        return proc_rss_kib(self.pid)

    def fds(self) -> int:
        return proc_fds(self.pid)

    def threads(self) -> int:
        return proc_threads(self.pid)

    def stop(self) -> dict:
        info = self.m.stop(10)
        info.update(
            self.m.stderr_report(),
            last_lines=list(self.m.lines)[-15:],
            log=str(self.m.log_path) if self.m.log_path else None,
        )
        return info


# --------------------------------------------------------------------------- runs


class QuietWait:
    """Waits (bounded) until other processes leave the machine mostly idle.

    Samples 0.5 s windows of the machine's task CPU minus ``our_cpu()`` (our own
    idle processes) and kernel threads; gives up after --quiet-wait seconds per
    run and --quiet-budget seconds per benchmark run.
    """

    def __init__(self, args: argparse.Namespace, our_cpu: Callable[[], float]) -> None:
        self.limit = args.quiet_wait
        self.threshold = args.quiet_threshold
        self.budget = args.quiet_budget
        self.our_cpu = our_cpu

    def __call__(self) -> tuple[float, float]:
        """(seconds waited, other processes' share of all CPUs in the last window)."""
        start = time.monotonic()
        limit = min(self.limit, max(0.0, self.budget))
        ncpu = os.cpu_count() or 1
        while True:
            m0, o0, k0 = machine_cpu()[0], self.our_cpu(), kernel_threads_cpu()
            time.sleep(0.5)
            m1, o1, k1 = machine_cpu()[0], self.our_cpu(), kernel_threads_cpu()
            frac = max(0.0, (m1 - m0) - (o1 - o0) - (k1 - k0)) / (0.5 * ncpu)
            waited = time.monotonic() - start
            if frac <= self.threshold or waited >= limit:
                self.budget -= max(0.0, waited - 0.5)
                return waited, frac


def rate_argv(
    target_port: int,
    socks_port: int | None,
    conc: int,
    duration: float,
    threads: int,
    proxy_flag: str = "--socks",
) -> list[str]:
    """``loadgen rate`` against tinyserver's rate listener (100 B request, 1 KiB response),
    through the SOCKS5 proxy on ``socks_port`` when given (``proxy_flag="--http"``: an HTTP
    CONNECT proxy)."""
    socks = [proxy_flag, f"127.0.0.1:{socks_port}"] if socks_port else []
    return [
        "rate",
        "--target",
        f"127.0.0.1:{target_port}",
        *socks,
        "--conc",
        str(conc),
        "--duration",
        str(duration),
        "--req",
        "100",
        "--resp",
        "1024",
        "--timeout-ms",
        "5000",
        "--threads",
        str(threads),
    ]


def bulk_argv(
    target_port: int,
    socks_port: int | None,
    conns: int,
    total_bytes: int,
    direction: str,
    max_seconds: float,
    buf: int,
    threads: int,
    proxy_flag: str = "--socks",
) -> list[str]:
    """``loadgen bulk`` against tinyserver's bulk listener, ``total_bytes`` split over the
    connections (at least 1 MiB each), through the SOCKS5 proxy on ``socks_port`` when given
    (``proxy_flag="--http"``: an HTTP CONNECT proxy)."""
    socks = [proxy_flag, f"127.0.0.1:{socks_port}"] if socks_port else []
    return [
        "bulk",
        "--target",
        f"127.0.0.1:{target_port}",
        *socks,
        "--conns",
        str(conns),
        "--bytes",
        str(max(1 << 20, total_bytes // conns)),
        "--dir",
        direction,
        "--max-seconds",
        str(max_seconds),
        "--buf",
        str(buf),
        "--threads",
        str(threads),
    ]


def loadgen_result(cmd: list[str], returncode: int, out: str, err: str) -> dict:
    """The JSON line a finished loadgen printed last; exits the benchmark if it failed."""
    if returncode != 0 or not out.strip():
        raise SystemExit(f"loadgen failed ({returncode}): {cmd}\n{err}")
    return json.loads(out.strip().splitlines()[-1])


def run_loadgen(cmd: list[str], timeout: float) -> dict:
    """Run loadgen to the end (raised fd limit) and return its JSON result."""
    try:
        r = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=raise_nofile
        )
    except subprocess.TimeoutExpired as ex:
        raise SystemExit(f"loadgen exceeded {timeout:.0f}s: {cmd}") from ex
    return loadgen_result(cmd, r.returncode, r.stdout, r.stderr)


def start_hold(
    loadgen: list[str],
    target_port: int,
    socks_port: int,
    conns: int,
    hold_seconds: float,
    timeout_ms: int,
    inflight: int | None = None,
    proxy_flag: str = "--socks",
) -> subprocess.Popen:
    """``loadgen hold``: ``conns`` tunnels through the SOCKS5 proxy (``proxy_flag="--http"``:
    HTTP CONNECT proxy) to tinyserver's idle (echo) listener, 16 bytes echoed each; it prints
    a JSON line once they are up, and closes them on a line on its stdin."""
    cmd = [
        *loadgen,
        "hold",
        "--target",
        f"127.0.0.1:{target_port}",
        proxy_flag,
        f"127.0.0.1:{socks_port}",
        "--conns",
        str(conns),
        *(["--inflight", str(inflight)] if inflight else []),
        "--payload",
        "16",
        "--hold-seconds",
        str(hold_seconds),
        "--timeout-ms",
        str(timeout_ms),
    ]
    return subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=raise_nofile,
    )


class RetryBudget:
    """How many runs that other processes disturbed may still be repeated (--retries)."""

    def __init__(self, left: int) -> None:
        self.left = left

    def runs(self, run: Callable[[], dict]) -> Iterator[dict]:
        """``run()``'s result, then a second run's if other processes disturbed the first and
        the budget lasts (the caller keeps both; the disturbed one is marked)."""
        res = run()
        yield res
        if res["disturbed"] and self.left > 0:
            self.left -= 1
            yield run()


class Runner:
    def __init__(self, args: argparse.Namespace, tools: dict[str, Path]) -> None:
        self.args = args
        self.tools = tools
        self.server: Server | None = None
        self.proxy: Proxy | None = None
        self.wait_quiet = QuietWait(args, self.our_cpu)
        self.retries = RetryBudget(args.retries)

    def loadgen_cmd(self) -> list[str]:
        return [*taskset_prefix(self.args.pin_load), str(self.tools["loadgen"])]

    def our_cpu(self) -> float:
        return pids_cpu_s([self.server.pid] + ([self.proxy.pid] if self.proxy else []))

    def measured(self, via_proxy: bool, argv: list[str], timeout: float) -> dict:
        """One loadgen run with the CPU used by proxy, server and the rest of the machine."""
        assert self.server is not None
        waited, before_frac = self.wait_quiet() if self.args.quiet_wait > 0 else (0.0, -1.0)
        p0 = self.proxy.cpu() if via_proxy and self.proxy else 0.0
        s0 = proc_cpu_s(self.server.pid)
        m0, b0 = machine_cpu()
        k0 = kernel_threads_cpu()
        t0 = time.monotonic()
        res = run_loadgen([*self.loadgen_cmd(), *argv], timeout)
        wall = time.monotonic() - t0
        m1, b1 = machine_cpu()
        k1 = kernel_threads_cpu()
        s1 = proc_cpu_s(self.server.pid)
        p1 = self.proxy.cpu() if via_proxy and self.proxy else 0.0
        ours = res.get("cpu_s", 0.0) + (s1 - s0) + (p1 - p0)
        res["proxy_cpu_s"] = round(p1 - p0, 3)
        res["server_cpu_s"] = round(s1 - s0, 3)
        res["loadgen_cpu_s"] = res.pop("cpu_s", 0.0)
        res["wall_s"] = round(wall, 3)
        res["machine_busy_s"] = round(b1 - b0, 3)
        # kernel threads: mostly ksoftirqd finishing loopback packet work for our traffic
        res["kernel_threads_cpu_s"] = round(k1 - k0, 3)
        # CPU of user tasks that are not ours (other users of the machine)
        res["other_cpu_s"] = round(max(0.0, (m1 - m0) - ours - (k1 - k0)), 3)
        res["quiet_wait_s"] = round(waited, 2)
        res["other_share_before"] = round(before_frac, 3)
        res["disturbed"] = disturbed(res)
        return res

    def _socks_port(self, via_proxy: bool) -> int | None:
        return self.proxy.port if via_proxy and self.proxy else None

    def _proxy_flag(self) -> str:
        """loadgen's option naming the proxy: ``--socks`` (SOCKS5), or ``--http`` for a proxy
        whose ``mode`` is ``"http"`` (HTTP CONNECT; see peers.py)."""
        return "--http" if getattr(self.proxy, "mode", "socks5") == "http" else "--socks"

    def bulk(self, via_proxy: bool, conns: int, direction: str, total_bytes: int) -> dict:
        a = self.args
        argv = bulk_argv(
            self.server.bulk,
            self._socks_port(via_proxy),
            conns,
            total_bytes,
            direction,
            a.bulk_max_seconds,
            a.buf,
            min(conns, a.loadgen_threads),
            self._proxy_flag(),
        )
        return self.measured(via_proxy, argv, a.bulk_max_seconds + 30)

    def rate(self, via_proxy: bool, conc: int, duration: float, warmup: float = 0.0) -> dict:
        argv = rate_argv(
            self.server.rate,
            self._socks_port(via_proxy),
            conc,
            duration,
            min(conc, self.args.loadgen_threads),
            self._proxy_flag(),
        )
        return self.measured(via_proxy, [*argv, "--warmup", str(warmup)], duration + warmup + 30)

    def hold(self, flows: int, hold_seconds: float) -> subprocess.Popen:
        return start_hold(
            self.loadgen_cmd(),
            self.server.idle,
            self.proxy.port,
            flows,
            hold_seconds,
            10000,
            128,
            self._proxy_flag(),
        )


def read_line(proc: subprocess.Popen, timeout: float) -> str | None:
    """One line of a child's (text) stdout within ``timeout``, without its newline
    (None on timeout, EOF or a blank line)."""
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    if not box or not box[0].strip():
        return None
    return box[0].rstrip("\n")


def read_json_line(proc: subprocess.Popen, timeout: float) -> dict | None:
    """The JSON object on one line of a child's stdout within ``timeout`` (else None)."""
    line = read_line(proc, timeout)
    return json.loads(line) if line else None


def end_child(proc: subprocess.Popen, timeout: float) -> str | None:
    """Ask a child that waits for a line on its (text) stdin to finish, and wait for it:
    the rest of its stdout, or None when it did not end within ``timeout`` (then it is
    stopped by pid)."""
    assert proc.stdin is not None
    with contextlib.suppress(OSError):  # it may have ended already
        proc.stdin.write("\n")
        proc.stdin.flush()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_child(proc)
        return None
    return out


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def spread(values: list[float]) -> float:
    """(max - min) / median, in percent: how much repeated runs disagree."""
    if len(values) < 2 or not median(values):
        return 0.0
    return 100.0 * (max(values) - min(values)) / median(values)


# --------------------------------------------------------------------------- measurements


def others_busy(other_cpu_s: float, wall_s: float) -> bool:
    """Other processes used more than 10% of the machine during a run of ``wall_s``."""
    return other_cpu_s > 0.10 * wall_s * (os.cpu_count() or 1)


def disturbed(res: dict) -> bool:
    """Other processes used more than 10% of the machine during the run."""
    return others_busy(res["other_cpu_s"], res["wall_s"])


def repeat(r: Runner, reps: int, run, describe) -> dict[str, list[dict]]:
    """``reps`` runs of each path, interleaved (direct, proxy, proxy, direct, ...), a
    disturbed one repeated once while the retry budget lasts (``RetryBudget``)."""
    runs: dict[str, list[dict]] = {"direct": [], "proxy": []}
    for rep in range(reps):
        order = ("direct", "proxy") if rep % 2 == 0 else ("proxy", "direct")
        for path in order:
            for res in r.retries.runs(lambda path=path: run(path == "proxy")):
                runs[path].append(res)
                log(describe(path, res) + ("  (disturbed)" if res["disturbed"] else ""))
    return runs


def undisturbed(runs: list[dict]) -> list[dict]:
    """The runs other processes did not disturb (all of them if every one was)."""
    return [x for x in runs if not x["disturbed"]] or runs


def best(runs: list[dict], key) -> dict:
    """The fastest run among the undisturbed ones (all runs if every one was disturbed).

    Interference from other processes only ever slows a run down, so on a shared
    machine the best run is the closest to what the code can do; medians are in
    the JSON too.
    """
    return max(undisturbed(runs), key=key)


def run_bulk(r: Runner, reps: int, total: int) -> dict:
    cases = [(1, "up"), (1, "down"), (8, "up"), (8, "down")]
    out: dict = {"total_bytes_per_run": total, "buf": r.args.buf, "cases": []}
    proxy_cpu = 0.0
    proxy_bytes = 0
    for conns, direction in cases:

        def describe(path: str, res: dict, conns: int = conns, direction: str = direction) -> str:
            return (
                f"  bulk {conns}x {direction:4} {path:6} {res['mb_per_s']:8.1f} MB/s"
                f"  proxy_cpu={res['proxy_cpu_s']:.2f}s other_cpu={res['other_cpu_s']:.2f}s"
                + ("  TRUNCATED" if res["truncated"] else "")
                + (f"  errors={res['errors']}" if any(res["errors"].values()) else "")
            )

        runs = repeat(
            r,
            reps,
            lambda via, conns=conns, direction=direction: r.bulk(via, conns, direction, total),
            describe,
        )
        case: dict = {"conns": conns, "dir": direction}
        for path in ("direct", "proxy"):
            rs = runs[path]
            top = best(rs, lambda x: x["mb_per_s"])
            vals = [x["mb_per_s"] for x in undisturbed(rs)]
            case[f"{path}_mb_s"] = round(top["mb_per_s"], 1)
            case[f"{path}_median_mb_s"] = round(median(vals), 1)
            case[f"{path}_spread_pct"] = round(spread(vals), 1)
            case[f"{path}_runs"] = len(rs)
        case["ratio"] = (
            round(case["proxy_mb_s"] / case["direct_mb_s"], 3) if case["direct_mb_s"] else None
        )
        pc = sum(x["proxy_cpu_s"] for x in runs["proxy"])
        pb = sum(x["bytes"] for x in runs["proxy"])
        proxy_cpu += pc
        proxy_bytes += pb
        case["proxy_cpu_s_per_gb"] = round(pc / (pb / 1e9), 3) if pb else None
        # CPU of everything (tools, proxy, kernel threads) per GB: what the path costs
        # the machine, independent of how many threads the tools use
        for path in ("direct", "proxy"):
            rs = runs[path]
            keys = ("loadgen_cpu_s", "server_cpu_s", "proxy_cpu_s", "kernel_threads_cpu_s")
            cpu = sum(x[k] for x in rs for k in keys)
            gb = sum(x["bytes"] for x in rs) / 1e9
            case[f"{path}_all_cpu_s_per_gb"] = round(cpu / gb, 3) if gb else None
        case["runs"] = runs
        out["cases"].append(case)
    out["proxy_cpu_s"] = round(proxy_cpu, 3)
    out["proxy_gb"] = round(proxy_bytes / 1e9, 3)
    out["proxy_cpu_s_per_gb"] = round(proxy_cpu / (proxy_bytes / 1e9), 3) if proxy_bytes else None
    return out


def run_rate(r: Runner, reps: int, duration: float) -> dict:
    out: dict = {"duration_s": duration, "request_bytes": 100, "response_bytes": 1024, "levels": []}
    # Warm the proxy's code paths once (not recorded).
    w = r.rate(True, 16, min(1.0, duration))
    log(f"  warmup via proxy: {w['conn_per_s']:.0f} conn/s")
    for conc in (1, 16, 64):

        def describe(path: str, res: dict, conc: int = conc) -> str:
            per_conn = (1e6 * res["proxy_cpu_s"] / res["count"]) if res["count"] else 0
            return (
                f"  rate c={conc:<3} {path:6} {res['conn_per_s']:9.0f}/s"
                f"  p50={res['lat_us']['p50']:8.0f}us p99={res['lat_us']['p99']:8.0f}us"
                + (f"  proxy_cpu/conn={per_conn:.0f}us" if path == "proxy" else "")
                + f"  other_cpu={res['other_cpu_s']:.2f}s"
                + (f"  errors={res['errors']}" if any(res["errors"].values()) else "")
            )

        runs = repeat(r, reps, lambda via, conc=conc: r.rate(via, conc, duration), describe)
        level: dict = {"conc": conc}
        for path in ("direct", "proxy"):
            rs = runs[path]
            top = best(rs, lambda x: x["conn_per_s"])
            vals = [x["conn_per_s"] for x in undisturbed(rs)]
            level[path] = {
                "conn_per_s": round(top["conn_per_s"], 1),
                "p50_us": round(top["lat_us"]["p50"], 1),
                "p99_us": round(top["lat_us"]["p99"], 1),
                "median_conn_per_s": round(median(vals), 1),
                "spread_pct": round(spread(vals), 1),
                "runs": len(rs),
                "errors": sum(sum(x["errors"].values()) for x in rs),
                "loadgen_threads": top.get("threads", 1),
            }
        pcount = sum(x["count"] for x in runs["proxy"])
        level["proxy"]["cpu_us_per_conn"] = (
            round(1e6 * sum(x["proxy_cpu_s"] for x in runs["proxy"]) / pcount, 1)
            if pcount
            else None
        )
        dcs = level["direct"]["conn_per_s"]
        level["ratio"] = round(level["proxy"]["conn_per_s"] / dcs, 3) if dcs else None
        level["runs"] = runs
        out["levels"].append(level)
    return out


def settle_rss(pid: int | Callable[[], int], seconds: float = 3.0) -> int:
    """VmRSS once two samples 0.25 s apart agree within 0.5% (or after ``seconds``);
    ``pid`` may be a function returning the figure (KiB) instead."""
    sample = pid if callable(pid) else (lambda: proc_rss_kib(pid))
    end = time.monotonic() + seconds
    last = sample()
    while time.monotonic() < end:
        time.sleep(0.25)
        cur = sample()
        if abs(cur - last) <= max(64, last // 200):
            return cur
        last = cur
    return last


def run_rss(r: Runner, flows: int, warm_flows: int) -> dict:
    proxy = r.proxy
    out: dict = {"flows": flows, "warmup_flows": warm_flows}
    # Warm-up: open and release a few tunnels so that lazily imported code and
    # first-use caches are in the "before" figure, not charged to the flows.
    if warm_flows:
        hp = r.hold(warm_flows, 30)
        first = read_json_line(hp, 60)
        hp.stdin.write("\n")
        hp.stdin.flush()
        hp.communicate(timeout=30)
        out["warmup_established"] = first["established"] if first else 0
        time.sleep(1.0)
    before = settle_rss(proxy.rss)
    fds_before = proxy.fds()
    thr_before = proxy.threads()
    hp = r.hold(flows, 120)
    t0 = time.monotonic()
    first = read_json_line(hp, 90)
    if first is None:
        hp.kill()
        hp.communicate()
        raise SystemExit("hold client did not report")
    ramp = time.monotonic() - t0
    after = settle_rss(proxy.rss)
    fds_after = proxy.fds()
    thr_after = proxy.threads()
    server_rss = proc_rss_kib(r.server.pid)
    hp.stdin.write("\n")
    hp.stdin.flush()
    rest, _ = hp.communicate(timeout=60)
    second = json.loads(rest.strip().splitlines()[-1]) if rest.strip() else {}
    est = first["established"]
    out.update(
        {
            "established": est,
            "errors": first["errors"],
            "ramp_s": round(ramp, 2),
            "handshake_p50_us": first["lat_us"]["p50"],
            "handshake_p99_us": first["lat_us"]["p99"],
            "rss_before_kib": before,
            "rss_after_kib": after,
            "kib_per_flow": round((after - before) / est, 2) if est else None,
            "proxy_fds_before": fds_before,
            "proxy_fds_after": fds_after,
            "proxy_fds_per_flow": round((fds_after - fds_before) / est, 2) if est else None,
            "proxy_threads_before": thr_before,
            "proxy_threads_after": thr_after,
            "still_open_at_release": second.get("still_open"),
            "dropped": second.get("dropped"),
            "server_rss_kib": server_rss,
        }
    )
    time.sleep(1.0)
    out["rss_after_release_kib"] = proxy.rss()
    log(
        f"  rss: before={before} KiB after={after} KiB established={est}/{flows} "
        f"-> {out['kib_per_flow']} KiB/flow; proxy fds {fds_before}->{fds_after}, "
        f"threads {thr_before}->{thr_after}"
    )
    return out


# --------------------------------------------------------------------------- report


def fmt_ratio(x: float | None) -> str:
    return f"{x:.2f}x" if x is not None else "-"


def ok(flag: bool) -> str:
    return "ok  " if flag else "MISS"


def report(res: dict) -> str:
    lines: list[str] = []
    meta = res["meta"]
    lines.append(
        f"spliceway e2e benchmark  {meta['timestamp']}  proxy={meta['proxy']} "
        f"({meta['proxy_launch']})"
    )
    lines.append(
        f"machine: {meta['nproc']} CPUs ({meta['cpu_model']}), kernel {meta['kernel']}, "
        f"loadavg at start {meta['loadavg_start']}"
    )
    lines.append(
        f"CPUs: runner {meta['affinity']['runner']}, proxy {meta['affinity']['proxy']}, "
        f"server {meta['affinity']['server']}, loadgen {meta['pin_load'] or 'all'} "
        f"(pinning: {meta['pinning']})"
    )
    lines.append(f"git: {meta['git']}")
    b = res.get("bulk")
    if b:
        lines.append("")
        lines.append(
            f"1. Bulk goodput, MB/s (best of {meta['reps']}+ undisturbed runs; "
            f"{b['total_bytes_per_run'] >> 20} MiB per run, {b['buf'] >> 10} KiB buffers)"
        )
        lines.append(
            f"   {'case':<16}{'direct':>10}{'proxy':>10}{'ratio':>9}"
            f"{'spread d/p %':>15}{'proxy s/GB':>12}{'all-CPU s/GB d/p':>19}"
        )
        for c in b["cases"]:
            name = f"{c['conns']} conn {c['dir']}"
            lines.append(
                f"   {name:<16}{c['direct_mb_s']:>10.1f}{c['proxy_mb_s']:>10.1f}"
                f"{fmt_ratio(c['ratio']):>9}"
                f"{c['direct_spread_pct']:>7.0f}/{c['proxy_spread_pct']:<7.0f}"
                f"{c['proxy_cpu_s_per_gb']:>12.3f}"
                f"{c['direct_all_cpu_s_per_gb']:>10.3f}/{c['proxy_all_cpu_s_per_gb']:<8.3f}"
            )
        r8 = [c["ratio"] for c in b["cases"] if c["conns"] == 8 and c["ratio"] is not None]
        worst = min(r8) if r8 else None
        if worst is not None:
            goal = TARGETS["bulk_ratio_8"]
            lines.append(
                f"   8-connection ratio (worst direction) {worst:.2f}x  "
                f"target >= {goal}x  {ok(worst >= goal)}"
                f"  [{PEERS['bulk_ratio_8']}]"
            )
        cpg = b["proxy_cpu_s_per_gb"]
        lines.append("")
        lines.append(
            f"2. Proxy CPU per GB relayed: {cpg:.3f} s/GB "
            f"({b['proxy_cpu_s']:.2f} s over {b['proxy_gb']:.2f} GB)  "
            f"target <= {TARGETS['cpu_s_per_gb']}  {ok(cpg <= TARGETS['cpu_s_per_gb'])}"
        )
    rt = res.get("rate")
    if rt:
        lines.append("")
        lines.append(
            f"3. Connections/s ({rt['duration_s']}s per run, best of {meta['reps']}+; "
            "100 B request, 1 KiB response, server closes)"
        )
        lines.append(
            f"   {'conc':<6}{'direct/s':>10}{'p50us':>8}{'p99us':>9}  |"
            f"{'proxy/s':>9}{'p50us':>8}{'p99us':>9}{'ratio':>8}"
            f"{'spread d/p %':>14}{'proxy cpu us/conn':>19}"
        )
        for lv in rt["levels"]:
            d, p = lv["direct"], lv["proxy"]
            err = f"  errors d/p {d['errors']}/{p['errors']}" if d["errors"] or p["errors"] else ""
            lines.append(
                f"   {lv['conc']:<6}{d['conn_per_s']:>10.0f}{d['p50_us']:>8.0f}"
                f"{d['p99_us']:>9.0f}  |{p['conn_per_s']:>9.0f}{p['p50_us']:>8.0f}"
                f"{p['p99_us']:>9.0f}{fmt_ratio(lv['ratio']):>8}"
                f"{d['spread_pct']:>7.0f}/{p['spread_pct']:<6.0f}"
                f"{p['cpu_us_per_conn'] or 0:>19.0f}{err}"
            )
        lv64 = next((x for x in rt["levels"] if x["conc"] == 64), None)
        lv1 = next((x for x in rt["levels"] if x["conc"] == 1), None)
        if lv64 and lv64["ratio"] is not None:
            goal = TARGETS["conn_ratio_64"]
            lines.append(
                f"   ratio at 64: {lv64['ratio']:.2f}x  target >= "
                f"{goal}x  {ok(lv64['ratio'] >= goal)}"
                f"  [{PEERS['conn_ratio_64']}]"
            )
        if lv1:
            p50 = lv1["proxy"]["p50_us"]
            lines.append(
                f"   proxied p50 at concurrency 1: {p50:.0f} us  target <= "
                f"{TARGETS['p50_us_c1']:.0f} us  {ok(p50 <= TARGETS['p50_us_c1'])}"
            )
    rs = res.get("rss")
    if rs:
        lines.append("")
        lines.append(
            f"4. RSS per idle relayed flow ({rs['established']}/{rs['flows']} tunnels "
            f"open, fresh proxy, {rs['warmup_flows']} warm-up flows first)"
        )
        kpf = rs["kib_per_flow"]
        complete = rs["established"] >= 0.99 * rs["flows"]
        verdict = (
            ok(kpf is not None and kpf <= TARGETS["rss_kib_per_flow"])
            if complete
            else "INVALID (tunnels failed; the failed flows' garbage is in the figure)"
        )
        lines.append(
            f"   proxy VmRSS {rs['rss_before_kib']} -> {rs['rss_after_kib']} KiB: "
            f"{kpf if kpf is not None else '-'} KiB/flow  target <= "
            f"{TARGETS['rss_kib_per_flow']}  {verdict}"
            f"  [{PEERS['rss_kib_per_flow']}]"
        )
        lines.append(
            f"   direct baseline: no proxy process (tinyserver holds the same "
            f"{rs['established']} idle connections in {rs['server_rss_kib']} KiB)"
        )
        lines.append(
            f"   proxy fds {rs['proxy_fds_before']} -> {rs['proxy_fds_after']} "
            f"({rs['proxy_fds_per_flow']}/flow), threads {rs['proxy_threads_before']} -> "
            f"{rs['proxy_threads_after']}; ramp {rs['ramp_s']} s, handshake+echo p50 "
            f"{rs['handshake_p50_us']:.0f} us; dropped while idle: {rs['dropped']}; "
            f"RSS 1 s after release {rs['rss_after_release_kib']} KiB"
        )
        if any(rs["errors"].values()):
            lines.append(f"   errors opening tunnels: {rs['errors']}")
    lines.extend(notes_section(res))
    return "\n".join(lines)


def dpkg_version(pkg: str) -> str | None:
    """The Debian package's installed version, None when it is not installed."""
    try:
        r = subprocess.run(
            ["dpkg-query", "-W", "-f", "${Status}|${Version}", pkg],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    status, _, version = r.stdout.partition("|")
    return version.strip() if status.strip().endswith(" installed") else None


def notes_section(res: dict) -> list[str]:
    """The "Notes:" lines ending a report (none when ``res`` has no notes)."""
    notes = res.get("notes") or []
    if not notes:
        return []
    return ["", "Notes:", *(f"   - {n}" for n in notes)]


def stop_notes(st: dict, prefix: str, who: str) -> list[str]:
    """Notes on how a proxy/engine (``who``) stopped and what its stderr held."""
    notes = []
    if st.get("killed"):
        notes.append(f"{prefix}{who} did not exit within 10 s of SIGTERM; killed")
    elif st.get("exit") not in (0, None, -15):
        notes.append(f"{prefix}{who} exited with status {st.get('exit')} after SIGTERM")
    if st.get("flagged_lines"):
        exc = "; ".join(f"{n}x {e}" for e, n in (st.get("exceptions") or {}).items())
        notes.append(
            f"{prefix}{st['flagged_lines']} error lines on the {who}'s stderr"
            + (f"; tracebacks: {exc}" if exc else "")
            + (f" (log: {st['log']})" if st.get("log") else "")
        )
    return notes


def collect_notes(res: dict) -> list[str]:
    notes = []
    for key in ("proxy_stop", "proxy_stop_rss"):
        if res.get(key):
            notes += stop_notes(res[key], f"{key}: ", "proxy")
    runs = []
    for c in (res.get("bulk") or {}).get("cases", []):
        runs += c["runs"]["direct"] + c["runs"]["proxy"]
    for lv in (res.get("rate") or {}).get("levels", []):
        runs += lv["runs"]["direct"] + lv["runs"]["proxy"]
    busy = [x for x in runs if x.get("disturbed")]
    if busy:
        notes.append(
            f"{len(busy)}/{len(runs)} runs were disturbed by other processes (>10% of the "
            "machine's CPU, other_cpu_s in the JSON); the tables use undisturbed runs where "
            "there are any"
        )
    hot = [x for x in runs if x.get("loadgen_cpu_s", 0) > 0.9 * x["wall_s"] * x.get("threads", 1)]
    if hot:
        notes.append(
            f"{len(hot)}/{len(runs)} runs had loadgen above 90% of its threads' CPU "
            "(the generator may have limited them)"
        )
    return notes


def git_head() -> str:
    """The tree's short HEAD commit (empty outside a checkout)."""
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()


def git_info() -> str:
    try:
        head = git_head()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return head + (" (+ uncommitted changes)" if dirty else "")
    except OSError:
        return "?"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def host_meta() -> dict:
    """The machine and Python a benchmark ran on, for its JSON."""
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model(),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def publish(res: dict, text: str, base: Path) -> None:
    """The table and the total time on stdout, every figure in ``<base>.json``."""
    print(text)
    print(f"\n(total {res['meta']['elapsed_s']} s)")
    path = Path(f"{base}.json")
    path.write_text(json.dumps(res, indent=1))
    print(f"results: {path}")


def start_proxy(r: Runner, res: dict, tmp: Path, log_path: Path) -> None:
    args = r.args
    r.proxy = Proxy(args.proxy, args.pin_proxy, tmp, log_path)
    meta = res["meta"]
    meta["proxy_cmd"] = r.proxy.cmd
    meta["proxy_launch"] = r.proxy.launch
    meta["affinity"]["proxy"] = affinity(r.proxy.pid)
    meta.setdefault("proxy_threads_at_start", proc_threads(r.proxy.pid))
    meta.setdefault("proxy_rss_at_start_kib", proc_rss_kib(r.proxy.pid))
    log(
        f"proxy {args.proxy} pid {r.proxy.pid} on 127.0.0.1:{r.proxy.port}; "
        f"server pid {r.server.pid} rate={r.server.rate} bulk={r.server.bulk} "
        f"idle={r.server.idle}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--proxy", default="spliceway", help="spliceway | microsocks | a command line with {port}"
    )
    ap.add_argument("--quick", action="store_true", help="short runs (about a minute)")
    ap.add_argument("--only", default="bulk,rate,rss", help="comma list of bulk,rate,rss")
    ap.add_argument(
        "--reps", type=int, help="repetitions of each bulk and rate run (default 2, quick 1)"
    )
    ap.add_argument("--rate-seconds", type=float, help="seconds per conn/s run (default 5)")
    ap.add_argument("--bulk-mib", type=int, help="MiB moved per bulk run (default 2048)")
    ap.add_argument(
        "--bulk-max-seconds",
        type=float,
        default=20.0,
        help="cap on one bulk run; a slower run reports what it moved",
    )
    ap.add_argument("--buf", type=int, default=256 * 1024, help="loadgen/tinyserver I/O buffer")
    ap.add_argument("--flows", type=int, default=5000, help="idle flows for the RSS measurement")
    ap.add_argument("--warm-flows", type=int, default=200)
    ap.add_argument("--pin-proxy", help="taskset CPU list for the proxy (default: no pinning)")
    ap.add_argument("--pin-load", help="taskset CPU list for loadgen and tinyserver")
    ap.add_argument(
        "--quiet-wait",
        type=float,
        default=8.0,
        help="before each run, wait up to this many seconds for other processes "
        "to use less than --quiet-threshold of the CPUs (0 = never wait)",
    )
    ap.add_argument("--quiet-threshold", type=float, default=0.10)
    ap.add_argument(
        "--retries",
        type=int,
        help="how many disturbed runs (other processes >10%% of the CPUs) may be repeated "
        "(default 6, quick 2)",
    )
    ap.add_argument("--server-threads", type=int, default=2, help="epoll threads of tinyserver")
    ap.add_argument(
        "--loadgen-threads",
        type=int,
        default=2,
        help="epoll threads of loadgen for rate and bulk runs (never more than connections)",
    )
    ap.add_argument(
        "--quiet-budget",
        type=float,
        help="total seconds all quiet waits may take (default 60, quick 15)",
    )
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"))
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON result")
    args = ap.parse_args(argv)
    quick = args.quick
    args.reps = args.reps or (1 if quick else 2)
    if args.retries is None:
        args.retries = 2 if quick else 6
    args.rate_seconds = args.rate_seconds or (1.5 if quick else 5.0)
    args.bulk_mib = args.bulk_mib or (512 if quick else 2048)
    if args.quiet_budget is None:
        args.quiet_budget = 15.0 if quick else 60.0
    if quick and args.bulk_max_seconds == 20.0:
        args.bulk_max_seconds = 8.0
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    for cmd in ("taskset",) if (args.pin_proxy or args.pin_load) else ():
        if not shutil.which(cmd):
            raise SystemExit(f"{cmd} not found")

    raise_nofile()
    tools = build_tools(args.cc)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    res: dict = {
        "meta": {
            "timestamp": stamp,
            "proxy": args.proxy,
            "quick": quick,
            "reps": args.reps,
            "rate_seconds": args.rate_seconds,
            "bulk_mib": args.bulk_mib,
            "flows": args.flows,
            **host_meta(),
            "loadavg_start": os.getloadavg(),
            "pin_proxy": args.pin_proxy,
            "pin_load": args.pin_load,
            "pinning": "none"
            if not (args.pin_proxy or args.pin_load)
            else f"proxy={args.pin_proxy or 'all'} load={args.pin_load or 'all'}",
            "git": git_info(),
            "nofile": NOFILE,
            "loadgen_threads": args.loadgen_threads,
            "server_threads": args.server_threads,
        }
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.proxy if re.fullmatch(r"[\w.-]+", args.proxy) else "custom"
    base = args.out / f"{stamp}-{name}"
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sw-bench-") as tmpd:
        tmp = Path(tmpd)
        r = Runner(args, tools)
        r.server = Server(tools["tinyserver"], args.pin_load, 900, args.server_threads)
        res["meta"]["affinity"] = {
            "runner": affinity(0),
            "server": affinity(r.server.pid),
            "proxy": "?",
        }
        try:
            if only & {"bulk", "rate"}:
                start_proxy(r, res, tmp, Path(f"{base}.proxy.log"))
                try:
                    if "bulk" in only:
                        log("bulk goodput ...")
                        res["bulk"] = run_bulk(r, args.reps, args.bulk_mib << 20)
                    if "rate" in only:
                        log("connections/s ...")
                        res["rate"] = run_rate(r, args.reps, args.rate_seconds)
                    res["meta"]["proxy_rss_after_load_kib"] = proc_rss_kib(r.proxy.pid)
                finally:
                    res["proxy_stop"] = r.proxy.stop()
            if "rss" in only:
                log("RSS per idle flow (fresh proxy) ...")
                start_proxy(r, res, tmp, Path(f"{base}.proxy-rss.log"))
                try:
                    res["rss"] = run_rss(r, args.flows, args.warm_flows)
                finally:
                    res["proxy_stop_rss"] = r.proxy.stop()
        finally:
            r.server.stop()
    res["meta"]["elapsed_s"] = round(time.monotonic() - t_start, 1)
    res["notes"] = collect_notes(res)
    publish(res, report(res), base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
