"""The physical egress: which interfaces carry the host's default routes, and when that changes.

``tun_status`` (interface.md 2.9) reports ``egress_interface[_v4|_v6]`` and, per
family, ``availability`` (``unknown``, ``available``, ``unavailable``) with the
interface or the reason; ``network_generation`` counts the changes. The egress is
read from the ``main`` table, the table the engine's marked sockets fall through to
(:mod:`spliceway.tun.routing`): its default route with the lowest metric whose
device is up, never the TUN itself.

:class:`EgressMonitor` listens to the kernel's link, address and route
notifications on a netlink socket of its own and re-reads the egress after each
burst; the generation moves only when the result differs, so the TUN's own rules
and routes being added do not count as a network change.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("spliceway.tun.egress")

RT_TABLE_MAIN = 254
IFF_UP = 0x1
# rtnetlink multicast groups (linux/rtnetlink.h, the legacy bit masks).
RTMGRP_LINK = 0x1
RTMGRP_IPV4_IFADDR = 0x10
RTMGRP_IPV4_ROUTE = 0x40
RTMGRP_IPV6_IFADDR = 0x100
RTMGRP_IPV6_ROUTE = 0x400
_GROUPS = (
    RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_IFADDR | RTMGRP_IPV6_ROUTE
)
#: Notifications come in bursts (a link going down withdraws its addresses and
#: routes one message each): wait this long after the last one before re-reading.
DEBOUNCE_SECONDS = 0.05


@dataclass(frozen=True, slots=True)
class FamilyEgress:
    """The egress of one address family."""

    availability: str = "unknown"
    """``unknown`` (not read yet, or unreadable), ``available`` or ``unavailable``."""
    interface: str | None = None
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The ``ipv4_egress`` / ``ipv6_egress`` object of 2.9 (optional keys omitted)."""
        out: dict[str, Any] = {"availability": self.availability}
        if self.interface is not None:
            out["interface"] = self.interface
        if self.reason is not None:
            out["reason"] = self.reason
        return out


@dataclass(frozen=True, slots=True)
class Egress:
    """Both families' egress."""

    v4: FamilyEgress = FamilyEgress()
    v6: FamilyEgress = FamilyEgress()

    @property
    def interface(self) -> str | None:
        """``egress_interface``: the IPv4 egress device, else the IPv6 one."""
        for fam in (self.v4, self.v6):
            if fam.availability == "available" and fam.interface:
                return fam.interface
        return None

    def status_fields(self) -> dict[str, Any]:
        """The egress fields of ``tun_status``."""
        v4 = self.v4.interface if self.v4.availability == "available" else None
        v6 = self.v6.interface if self.v6.availability == "available" else None
        return {
            "egress_interface": self.interface,
            "egress_interface_v4": v4,
            "egress_interface_v6": v6,
            "ipv4_egress": self.v4.to_dict(),
            "ipv6_egress": self.v6.to_dict(),
        }


def _links(ipr: Any) -> dict[int, tuple[str, bool]]:
    """ifindex -> (name, usable): administratively up and not known to be down."""
    out: dict[int, tuple[str, bool]] = {}
    for msg in ipr.get_links():
        name = msg.get("ifname") or f"if{msg['index']}"
        oper = msg.get("operstate") or "UNKNOWN"
        down = oper in ("DOWN", "LOWERLAYERDOWN", "NOTPRESENT")
        usable = bool(msg["flags"] & IFF_UP) and not down
        out[msg["index"]] = (name, usable)
    return out


def _route_oifs(msg: Any) -> list[int]:
    oif = msg.get("oif")
    if oif is not None:
        return [oif]
    return [hop["oif"] for hop in msg.get("multipath") or () if hop.get("oif") is not None]


def _family_egress(
    ipr: Any, family: int, links: dict[int, tuple[str, bool]], exclude: set[str]
) -> FamilyEgress:
    candidates: list[tuple[int, str, bool]] = []
    for msg in ipr.route("dump", family=family, table=RT_TABLE_MAIN):
        if msg.get("table") != RT_TABLE_MAIN or msg["dst_len"] != 0:
            continue
        if msg["type"] != 1:  # RTN_UNICAST; an unreachable default is no egress
            continue
        for oif in _route_oifs(msg):
            name, usable = links.get(oif, (f"if{oif}", False))
            if name in exclude:
                continue
            candidates.append((msg.get("priority") or 0, name, usable))
    if not candidates:
        return FamilyEgress("unavailable", reason="no default route")
    candidates.sort(key=lambda c: (not c[2], c[0]))
    _, name, usable = candidates[0]
    if not usable:
        return FamilyEgress("unavailable", interface=name, reason=f"interface {name} is down")
    return FamilyEgress("available", interface=name)


def detect_egress(exclude: Iterable[str] = ()) -> Egress:
    """Read the egress now (both families); ``exclude`` names devices never chosen (the TUN)."""
    from pyroute2 import IPRoute

    skip = set(exclude)
    try:
        with IPRoute() as ipr:
            links = _links(ipr)
            return Egress(
                _family_egress(ipr, socket.AF_INET, links, skip),
                _family_egress(ipr, socket.AF_INET6, links, skip),
            )
    except Exception as ex:  # netlink unreadable: say so rather than guess
        reason = f"egress not readable: {ex}"
        unknown = FamilyEgress("unknown", reason=reason)
        return Egress(unknown, unknown)


class EgressMonitor:
    """Keeps :attr:`egress` current from netlink notifications; counts changes.

    ``on_change(egress, generation)`` runs on the monitor's thread after each change;
    ``on_event()`` after every burst of notifications (the controller re-checks the
    TUN device's health there). Both must be quick and must not raise.
    """

    def __init__(
        self,
        exclude: Iterable[str] = (),
        *,
        on_change: Callable[[Egress, int], None] | None = None,
        on_event: Callable[[], None] | None = None,
    ) -> None:
        self._exclude = set(exclude)
        self._on_change = on_change
        self._on_event = on_event
        self._lock = threading.Lock()
        self._egress = Egress()
        self._generation = 0
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._wake_r, self._wake_w = -1, -1

    @property
    def egress(self) -> Egress:
        """The last egress read."""
        with self._lock:
            return self._egress

    @property
    def generation(self) -> int:
        """``network_generation``: how many times the egress changed since :meth:`start`."""
        with self._lock:
            return self._generation

    def start(self) -> None:
        """Subscribe, read the egress once, and start the listening thread."""
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, 0)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            # Subscribe before the first read: a change in between is then seen twice,
            # never missed.
            sock.bind((0, _GROUPS))
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        with self._lock:
            self._egress = detect_egress(self._exclude)
        self._thread = threading.Thread(target=self._run, name="tun-egress", daemon=True)
        self._thread.start()

    def refresh(self) -> bool:
        """Re-read the egress now; True when it changed (the generation then moved)."""
        new = detect_egress(self._exclude)
        with self._lock:
            if new == self._egress:
                return False
            self._egress = new
            self._generation += 1
            gen = self._generation
        log.info("egress changed (generation %d): %s", gen, new)
        if self._on_change is not None:
            self._on_change(new, gen)
        return True

    def _drain(self) -> bool:
        got = False
        assert self._sock is not None
        while True:
            try:
                self._sock.recv(1 << 16)
                got = True
            except BlockingIOError:
                return got
            except OSError:  # ENOBUFS: notifications were lost; re-reading covers them
                got = True

    def _run(self) -> None:
        assert self._sock is not None
        # poll, not select: the engine raises RLIMIT_NOFILE, and select() cannot take a
        # descriptor above 1,023 (a TUN started after many flows gets one).
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._wake_r in ready:
                return
            if not self._drain():
                continue
            # Let the burst finish, so one change is one re-read.
            deadline = time.monotonic() + DEBOUNCE_SECONDS
            while (left := deadline - time.monotonic()) > 0:
                ready = {fd for fd, _ in poller.poll(left * 1000)}
                if self._wake_r in ready:
                    return
                if ready and self._drain():
                    deadline = time.monotonic() + DEBOUNCE_SECONDS
            try:
                self.refresh()
                if self._on_event is not None:
                    self._on_event()
            except Exception:  # the monitor must outlive a bad callback
                log.exception("egress monitor callback failed")

    def stop(self) -> None:
        """Stop the thread and close the socket (idempotent)."""
        if self._thread is not None:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
            self._thread.join(timeout=5)
            self._thread = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_r = self._wake_w = -1
        if self._sock is not None:
            self._sock.close()
            self._sock = None
