"""Network namespaces for the TUN tests: a "host" joined to an "internet" by a veth pair.

::

    host namespace                         internet namespace
    veth <id>h  10.200.0.2/24  <------->   veth <id>i  10.200.0.1/24
                fd00:200::2/64                         fd00:200::1/64
    default via 10.200.0.1, fd00:200::1    lo: 203.0.113.10, .53, .200,
                                               198.51.100.10, 2001:db8:100::10

The servers' addresses sit on the internet namespace's loopback, so from the host
they are reached only through its default route: exactly what a TUN's auto_route
captures (the veth subnet is the host's "LAN", which the TUN rules leave alone).

Servers (:meth:`Topology.serve`: HTTP, TCP echo, TCP sink, UDP echo; and
:meth:`Topology.dns`: dnsmasq) run inside the internet namespace; anything else runs
anywhere with :meth:`Netns.run` / :meth:`Netns.popen` (``ip netns exec``).

Cleanup is guaranteed twice over: :func:`topology` kills what it started and deletes
both namespaces on the way out, and every new topology first deletes the namespaces
(and kills the processes inside them) of any earlier run whose pytest process is gone
(names carry the creating pid: ``swt<pid>n<k>-host``). Nothing is ever created in the
namespace the tests run in.

:func:`netns_unavailable` says why namespaces cannot be made here (not root, no
``ip``, a kernel or sandbox refusing them); tests skip with that reason and only then.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from spliceway.support.atomic_file import pid_alive

PREFIX = "swt"
REPO = Path(__file__).resolve().parents[2]

HOST_IP = "10.200.0.2"
GATEWAY_IP = "10.200.0.1"
HOST_IP6 = "fd00:200::2"
GATEWAY_IP6 = "fd00:200::1"
#: Addresses of the internet namespace's servers (on its loopback).
SERVER_IP = "203.0.113.10"
SERVER_IP_B = "203.0.113.200"
DNS_IP = "203.0.113.53"
OTHER_IP = "198.51.100.10"
SERVER_IP6 = "2001:db8:100::10"
_SERVER_ADDRESSES = (f"{SERVER_IP}/32", f"{SERVER_IP_B}/32", f"{DNS_IP}/32", f"{OTHER_IP}/32")

_counter = itertools.count(1)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be created here, or None when they can."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        done = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.SubprocessError) as ex:
        return f"ip netns add failed: {ex}"
    if done.returncode != 0:
        return f"ip netns add is refused here: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _delete_netns(name: str) -> None:
    """Kill every process inside ``name``, then delete it (its veth ends go with it)."""
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", name, check=False)


def sweep_leftovers() -> list[str]:
    """Delete the namespaces of earlier runs whose creating process is gone; their names."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)(?:n\d+-\w+|probe)", name)
        if m and (int(m.group(1)) != os.getpid()) and not pid_alive(int(m.group(1))):
            _delete_netns(name)
            removed.append(name)
    return removed


@dataclass
class Netns:
    """One named network namespace."""

    name: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def command(self, *cmd: str) -> list[str]:
        """``cmd`` prefixed to run inside this namespace."""
        return ["ip", "netns", "exec", self.name, *cmd]

    def python(self, *args: str) -> list[str]:
        """This interpreter inside the namespace (the repository on its import path)."""
        return self.command(sys.executable, *args)

    def run(
        self, *cmd: str, check: bool = True, timeout: float = 30, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` inside; its output as text."""
        return subprocess.run(
            self.command(*cmd),
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
            input=input,
            cwd=REPO,
        )

    def popen(self, *cmd: str, **kwargs: object) -> subprocess.Popen:
        """Start ``cmd`` inside (killed when the topology closes)."""
        kwargs.setdefault("cwd", REPO)
        proc = subprocess.Popen(self.command(*cmd), **kwargs)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def ip_json(self, *args: str) -> list[dict]:
        """``ip -j ARGS`` inside, parsed."""
        out = self.run("ip", "-j", *args).stdout
        return json.loads(out) if out.strip() else []

    def route_get(self, *args: str) -> str:
        """``ip route get ARGS`` inside: the answer, or the error text when it fails."""
        done = self.run("ip", "route", "get", *args, check=False)
        return (done.stdout or done.stderr).strip()

    def snapshot(self) -> dict[str, str]:
        """Rules, routes of every table, addresses and links: for before/after comparisons.

        Taken once settled: a fresh veth's link-local IPv6 address is tentative (and its
        routes in flux) for a moment, which is no change anyone made."""
        last: dict[str, str] = {}
        deadline = time.monotonic() + 10
        while True:
            now = self._snapshot_once()
            if now == last and "tentative" not in now["addresses"]:
                return now
            if time.monotonic() > deadline:
                raise AssertionError(f"the namespace did not settle: {now}")
            last = now
            time.sleep(0.05)

    def _snapshot_once(self) -> dict[str, str]:
        views = {
            "rules4": ("ip", "-4", "rule"),
            "rules6": ("ip", "-6", "rule"),
            "routes4": ("ip", "-4", "route", "show", "table", "all"),
            "routes6": ("ip", "-6", "route", "show", "table", "all"),
            "addresses": ("ip", "-o", "addr"),
            "links": ("ip", "-o", "link"),
        }
        out = {k: self.run(*v).stdout for k, v in views.items()}
        # Counters and link-layer timers are not state the engine could have changed.
        out["addresses"] = re.sub(r"\s+valid_lft.*", "", out["addresses"])
        return out

    def kill_all(self) -> None:
        """Kill every process started with :meth:`popen` and reap it."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        self.procs.clear()


@dataclass
class Topology:
    """The two namespaces and their link (see the module docstring for the addresses)."""

    host: Netns
    internet: Netns
    host_if: str
    internet_if: str

    def serve(self, kind: str, port: int = 0, timeout: float = 20) -> int:
        """Start a server of ``kind`` (``http``, ``echo``, ``sink``, ``udp-echo``) in the
        internet namespace, on every address; return its port once it listens."""
        proc = self.internet.popen(
            sys.executable,
            "-m",
            "tests.helpers.netns_servers",
            kind,
            str(port),
            stdout=subprocess.PIPE,
            text=True,
        )
        return int(_read_until(proc, r"ready (\d+)", timeout).group(1))

    def dns(self, records: Mapping[str, str], address: str = DNS_IP) -> str:
        """dnsmasq in the internet namespace on ``address``:53 answering ``records``
        (name -> IPv4 address) and refusing recursion; returns ``address``."""
        args = [
            "dnsmasq",
            "--keep-in-foreground",
            "--no-resolv",
            "--no-hosts",
            "--conf-file=/dev/null",
            "--pid-file",
            "--user=root",
            "--bind-interfaces",
            f"--listen-address={address}",
            "--port=53",
            *(f"--address=/{name}/{ip}" for name, ip in records.items()),
            # Answered from these records only: a name's AAAA gets NODATA, not REFUSED
            # (which a resolver asking A and AAAA could take for a failed server).
            *(f"--local=/{name}/" for name in records),
        ]
        self.internet.popen(*args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if f"{address}:53 " in self.internet.run("ss", "-lnu").stdout + " ":
                return address
            time.sleep(0.05)
        raise AssertionError("dnsmasq did not start listening")

    def close(self) -> None:
        """Kill every process started in the namespaces, then delete them."""
        for ns in (self.host, self.internet):
            ns.kill_all()
            _delete_netns(ns.name)


def _read_until(proc: subprocess.Popen, pattern: str, timeout: float) -> re.Match[str]:
    """Read ``proc``'s stdout lines until one matches; fail at EOF or ``timeout``."""
    import selectors

    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if not sel.select(left):
                break
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if m := re.search(pattern, line):
                return m
    raise AssertionError(f"no line matched {pattern!r}: {seen}")


def _build(k: int) -> Topology:
    pid = os.getpid()
    host = Netns(f"{PREFIX}{pid}n{k}-host")
    internet = Netns(f"{PREFIX}{pid}n{k}-inet")
    host_if, internet_if = f"s{pid}n{k}h", f"s{pid}n{k}i"
    topo = Topology(host, internet, host_if, internet_if)
    try:
        for ns in (host, internet):
            _ip("netns", "add", ns.name)
            ns.run("ip", "link", "set", "lo", "up")
        # Created inside the host namespace, the other end moved: the tests' own
        # namespace never holds either end, even for a moment.
        host.run(
            "ip", "link", "add", host_if, "type", "veth", "peer", "name", internet_if,
            "netns", internet.name,
        )  # fmt: skip
        host.run("ip", "addr", "add", f"{HOST_IP}/24", "dev", host_if)
        host.run("ip", "addr", "add", f"{HOST_IP6}/64", "dev", host_if, "nodad")
        host.run("ip", "link", "set", host_if, "up")
        internet.run("ip", "addr", "add", f"{GATEWAY_IP}/24", "dev", internet_if)
        internet.run("ip", "addr", "add", f"{GATEWAY_IP6}/64", "dev", internet_if, "nodad")
        internet.run("ip", "link", "set", internet_if, "up")
        for addr in _SERVER_ADDRESSES:
            internet.run("ip", "addr", "add", addr, "dev", "lo")
        internet.run("ip", "addr", "add", f"{SERVER_IP6}/128", "dev", "lo")
        host.run("ip", "route", "add", "default", "via", GATEWAY_IP)
        host.run("ip", "-6", "route", "add", "default", "via", GATEWAY_IP6)
    except BaseException:
        topo.close()
        raise
    return topo


@contextmanager
def topology() -> Iterator[Topology]:
    """A fresh host/internet pair, removed (with everything started in it) on the way out.

    Skips the calling test, with the reason, only when namespaces cannot be created.
    """
    reason = netns_unavailable()
    if reason is not None:
        import pytest

        pytest.skip(f"network namespaces unavailable: {reason}")
    sweep_leftovers()
    topo = _build(next(_counter))
    try:
        yield topo
    finally:
        topo.close()


def wait_until(predicate: object, timeout: float = 10, interval: float = 0.05) -> bool:
    """Poll ``predicate()`` until it is true or ``timeout`` passes; its last truth value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():  # type: ignore[operator]
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def read_lines(proc: subprocess.Popen, pattern: str, timeout: float = 20) -> re.Match[str]:
    """Public :func:`_read_until`: the first stdout line of ``proc`` matching ``pattern``."""
    return _read_until(proc, pattern, timeout)


__all__: Sequence[str] = (
    "DNS_IP",
    "GATEWAY_IP",
    "GATEWAY_IP6",
    "HOST_IP",
    "HOST_IP6",
    "OTHER_IP",
    "SERVER_IP",
    "SERVER_IP6",
    "SERVER_IP_B",
    "Netns",
    "Topology",
    "netns_unavailable",
    "read_lines",
    "sweep_leftovers",
    "topology",
    "wait_until",
)
