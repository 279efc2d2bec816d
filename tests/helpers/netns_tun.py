"""A network namespace with a TUN device in it, for the TUN stack's own tests.

Deliberately small and separate from tests/helpers/netns.py (the routing tests'
host/internet topology): the packet loop needs only one namespace holding a TUN with
its addresses and a route for a test prefix into it. Names are ``swk<pid>n<k>`` so a
stale one (its pytest process gone) is recognised and deleted by the next run, and they
never match the other helper's names.

The test process itself stays in its own namespace; :meth:`TunNetns.entered` switches
the calling *thread* into the namespace (``setns``) and back, so sockets and the TUN fd
created inside belong to it while everything else keeps running outside. Commands run
inside with :meth:`TunNetns.run` (``ip netns exec``).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import itertools
import os
import re
import shutil
import struct
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

PREFIX = "swk"
CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000

_counter = itertools.count()
_libc = ctypes.CDLL(None, use_errno=True)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _sweep_stale() -> None:
    """Deletes namespaces of earlier runs whose pytest process is gone."""
    out = _ip("netns", "list", check=False).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)n\d+", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _ip("netns", "del", name, check=False)


def unavailable() -> str | None:
    """Why a namespace with a TUN cannot be made here, or None."""
    if os.geteuid() != 0:
        return "not root: creating network namespaces and TUN devices needs CAP_SYS_ADMIN"
    if shutil.which("ip") is None:
        return "no ip(8) (iproute2) to create network namespaces"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun"
    name = f"{PREFIX}{os.getpid()}probe"
    res = _ip("netns", "add", name, check=False)
    if res.returncode != 0:
        return f"ip netns add refused: {res.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextmanager
def entered(name: str) -> Iterator[None]:
    """The calling thread inside namespace ``name`` for the ``with`` body (threads it
    starts there stay there)."""
    with open("/proc/thread-self/ns/net", "rb") as home:
        with open(f"/run/netns/{name}", "rb") as ns:
            _setns(ns.fileno())
        try:
            yield
        finally:
            _setns(home.fileno())


class TunNetns:
    """A namespace (``lo`` up) in which :meth:`open_tun` makes TUN devices."""

    def __init__(self) -> None:
        _sweep_stale()
        self.name = f"{PREFIX}{os.getpid()}n{next(_counter)}"
        _ip("netns", "add", self.name)
        self.tun_fds: list[int] = []
        try:
            self.run("ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def run(self, *cmd: str, check: bool = True, timeout: float = 30,
            input_: bytes | None = None) -> subprocess.CompletedProcess[bytes]:  # fmt: skip
        return subprocess.run(
            ["ip", "netns", "exec", self.name, *cmd], capture_output=True, check=check,
            timeout=timeout, input=input_,
        )  # fmt: skip

    def sysctl(self, key: str, value: str) -> None:
        self.run("sysctl", "-q", "-w", f"{key}={value}")

    def entered(self) -> contextlib.AbstractContextManager[None]:
        """The calling thread inside the namespace for the ``with`` body."""
        return entered(self.name)

    def open_tun(
        self, dev: str, addresses: Sequence[str], routes: Sequence[str] = (), mtu: int = 1500,
        *, vnet_hdr: bool = False, txqueuelen: int | None = None,
    ) -> int:  # fmt: skip
        """A TUN (IFF_TUN | IFF_NO_PI) named dev in the namespace, with addresses
        (IPv6 without DAD), link up at mtu, and routes ("prefix") through it. The fd is
        closed by :meth:`close` (the device goes with it). ``vnet_hdr``: IFF_VNET_HDR and
        the offloads spliceway.tun.device.set_offloads turns on (the product's own call)."""
        from spliceway.tun.device import set_offloads

        flags = IFF_TUN | IFF_NO_PI | (IFF_VNET_HDR if vnet_hdr else 0)
        with self.entered():
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", dev.encode(), flags))
                if vnet_hdr:
                    set_offloads(fd)
            except BaseException:
                os.close(fd)
                raise
        self.tun_fds.append(fd)
        self.run("ip", "link", "set", dev, "mtu", str(mtu), "up")
        if txqueuelen is not None:
            self.run("ip", "link", "set", dev, "txqueuelen", str(txqueuelen))
        for addr in addresses:
            extra = ["nodad"] if ":" in addr else []
            self.run("ip", "addr", "add", addr, "dev", dev, *extra)
        for prefix in routes:
            self.run("ip", "-6" if ":" in prefix else "-4", "route", "add", prefix, "dev", dev)
        # Packets the stack writes back arrive with sources (the real destination,
        # B) only the TUN routes to: strict reverse-path filtering would be right to
        # keep them, but make it explicit rather than depend on the default.
        self.sysctl(f"net.ipv4.conf.{dev}.rp_filter", "0")
        self.sysctl("net.ipv4.conf.all.rp_filter", "0")
        return fd

    def close(self) -> None:
        for fd in self.tun_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.tun_fds.clear()
        _ip("netns", "del", self.name, check=False)

    def __enter__(self) -> TunNetns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
