"""Two network namespaces for ``bench_tun.py``: a "host" joined to an "internet" by a veth pair.

::

    host namespace  swb<pid>-host              internet namespace  swb<pid>-inet
    veth swb<pid>h  10.200.0.1/24  <--------->  veth swb<pid>i  10.200.0.2/24
                    fd00:200::1/64                              fd00:200::2/64
    default via 10.200.0.2, fd00:200::2         lo: 203.0.113.10/32, 2001:db8:100::10/128

The servers listen on the internet namespace's loopback addresses, so from the host they
are reached only through its default route: exactly what a TUN's ``auto_route`` captures
(the veth subnet is the host's "LAN", which TUN routing leaves alone). Nothing is
created in, or changed in, the namespace the benchmark itself runs in: the veth pair is
made inside the host namespace and one end moved straight into the other.

Both namespaces get the same TCP sysctls (:data:`SYSCTLS`): a wide ephemeral port range
and ``tcp_tw_reuse=1``, so tens of thousands of short connections per run (and their
TIME_WAIT sockets, on whichever side closes first) do not exhaust the ports of a later
run. Every column of the benchmark runs with the same settings.

:meth:`Topology.create` first deletes the namespaces of earlier runs whose creating
process is gone (names carry its pid), killing what still runs inside them;
:meth:`Topology.close` kills (by pid) every process left inside this run's namespaces and
deletes them (their veth ends go with them).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

from spliceway.support.atomic_file import pid_alive

PREFIX = "swb"
HOST_IP = "10.200.0.1"
INET_IP = "10.200.0.2"
HOST_IP6 = "fd00:200::1"
INET_IP6 = "fd00:200::2"
#: The servers' addresses (on the internet namespace's loopback).
SERVER_IP = "203.0.113.10"
SERVER_IP6 = "2001:db8:100::10"
#: Per-namespace sysctls set in both namespaces (see the module docstring).
SYSCTLS = {
    "net.ipv4.ip_local_port_range": "1024 65535",
    "net.ipv4.tcp_tw_reuse": "1",
}
_NAME_RE = re.compile(rf"{PREFIX}(\d+)-(host|inet|probe)")


def ip(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``ip ARGS`` (in the benchmark's own namespace unless ARGS say ``-n NS``)."""
    return subprocess.run(
        ["ip", *args], capture_output=True, text=True, check=check, timeout=timeout
    )


def unavailable() -> str | None:
    """Why network namespaces cannot be created here, or None when they can."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing (no TUN devices here)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        done = ip("netns", "add", probe, check=False)
    except (OSError, subprocess.SubprocessError) as ex:
        return f"ip netns add failed: {ex}"
    if done.returncode != 0:
        return f"ip netns add is refused here: {done.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


def ns_pids(name: str) -> list[int]:
    """The pids of the processes running inside namespace ``name``."""
    out = ip("netns", "pids", name, check=False).stdout.split()
    return [int(p) for p in out if p.isdigit()]


def delete_netns(name: str) -> list[int]:
    """SIGKILL (by pid) whatever still runs inside ``name``, then delete it; the pids killed."""
    pids = ns_pids(name)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    ip("netns", "del", name, check=False)
    return pids


def sweep_stale() -> list[str]:
    """Delete the namespaces of earlier runs of this benchmark whose process is gone."""
    removed = []
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME_RE.fullmatch(name)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            delete_netns(name)
            removed.append(name)
    return removed


@dataclass
class Netns:
    """One named network namespace."""

    name: str

    def cmd(self, *argv: str) -> list[str]:
        """``argv`` prefixed to run inside this namespace (``ip netns exec`` execs it: the
        child's pid is the program's own)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def run(
        self, *argv: str, check: bool = True, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.cmd(*argv), capture_output=True, text=True, check=check, timeout=timeout
        )

    def ip_json(self, *args: str) -> list[dict]:
        """``ip -j ARGS`` inside, parsed ([] when it fails, e.g. a missing device)."""
        done = ip("-n", self.name, "-j", *args, check=False)
        if done.returncode != 0 or not done.stdout.strip():
            return []
        return json.loads(done.stdout)

    def has_link(self, dev: str) -> bool:
        return bool(self.ip_json("link", "show", "dev", dev))

    def link_stats(self, dev: str) -> dict[str, int] | None:
        """rx/tx bytes and packets and tx drops of ``dev`` (None when it does not exist)."""
        links = self.ip_json("-s", "link", "show", "dev", dev)
        if not links:
            return None
        st = links[0].get("stats64") or links[0].get("stats") or {}
        rx, tx = st.get("rx", {}), st.get("tx", {})
        return {
            "rx_bytes": int(rx.get("bytes", 0)),
            "rx_packets": int(rx.get("packets", 0)),
            "tx_bytes": int(tx.get("bytes", 0)),
            "tx_packets": int(tx.get("packets", 0)),
            "tx_dropped": int(tx.get("dropped", 0)),
            "rx_dropped": int(rx.get("dropped", 0)),
        }

    def route_get(self, dst: str) -> str:
        """``ip route get DST`` inside: the answer, or the error text."""
        done = ip("-n", self.name, "route", "get", dst, check=False)
        return (done.stdout or done.stderr).strip()

    def snapshot(self) -> dict[str, str]:
        """Rules, routes of every table and link names: compared before/after a TUN runs."""
        views = {
            "rules4": ("-4", "rule"),
            "rules6": ("-6", "rule"),
            "routes4": ("-4", "route", "show", "table", "all"),
            "routes6": ("-6", "route", "show", "table", "all"),
        }
        out = {k: ip("-n", self.name, *v, check=False).stdout for k, v in views.items()}
        # Link-local IPv6 routes come and go with the kernel's own address configuration
        # (the veth's fe80:: address appears a moment after the link is up): not TUN state.
        out["routes6"] = "".join(
            ln for ln in out["routes6"].splitlines(keepends=True) if "fe80:" not in ln
        )
        out["links"] = "\n".join(
            sorted(str(link.get("ifname")) for link in self.ip_json("link", "show"))
        )
        return out


@dataclass
class Topology:
    """The two namespaces and their link (addresses in the module docstring)."""

    host: Netns
    inet: Netns
    host_if: str
    inet_if: str

    @classmethod
    def create(cls) -> Topology:
        """Sweep stale namespaces, then build a fresh pair (deleted again on failure)."""
        sweep_stale()
        pid = os.getpid()
        topo = cls(
            Netns(f"{PREFIX}{pid}-host"), Netns(f"{PREFIX}{pid}-inet"),
            f"{PREFIX}{pid}h", f"{PREFIX}{pid}i",
        )  # fmt: skip
        h, i = topo.host.name, topo.inet.name
        try:
            for ns in (h, i):
                ip("netns", "add", ns)
                ip("-n", ns, "link", "set", "lo", "up")
                for key, value in SYSCTLS.items():
                    Netns(ns).run("sysctl", "-q", "-w", f"{key}={value}")
            ip(
                "-n", h, "link", "add", topo.host_if, "type", "veth",
                "peer", "name", topo.inet_if, "netns", i,
            )  # fmt: skip
            ip("-n", h, "addr", "add", f"{HOST_IP}/24", "dev", topo.host_if)
            ip("-n", h, "addr", "add", f"{HOST_IP6}/64", "dev", topo.host_if, "nodad")
            ip("-n", h, "link", "set", topo.host_if, "up")
            ip("-n", i, "addr", "add", f"{INET_IP}/24", "dev", topo.inet_if)
            ip("-n", i, "addr", "add", f"{INET_IP6}/64", "dev", topo.inet_if, "nodad")
            ip("-n", i, "link", "set", topo.inet_if, "up")
            ip("-n", i, "addr", "add", f"{SERVER_IP}/32", "dev", "lo")
            ip("-n", i, "addr", "add", f"{SERVER_IP6}/128", "dev", "lo")
            ip("-n", h, "route", "add", "default", "via", INET_IP)
            ip("-n", h, "-6", "route", "add", "default", "via", INET_IP6)
        except BaseException:
            topo.close()
            raise
        return topo

    def close(self) -> list[int]:
        """Kill (by pid) every process still inside either namespace, delete both; the pids
        that had to be killed (processes the benchmark failed to stop itself)."""
        killed: list[int] = []
        for ns in (self.host, self.inet):
            killed += delete_netns(ns.name)
        return killed

    def describe(self) -> dict:
        return {
            "host_ns": self.host.name,
            "internet_ns": self.inet.name,
            "veth": [self.host_if, self.inet_if],
            "host_addresses": [f"{HOST_IP}/24", f"{HOST_IP6}/64"],
            "internet_addresses": [f"{INET_IP}/24", f"{INET_IP6}/64"],
            "server_addresses": [SERVER_IP, SERVER_IP6],
            "host_default_routes": [f"via {INET_IP}", f"via {INET_IP6}"],
            "sysctls_both": dict(SYSCTLS),
        }
