"""TunActor: owns one running TUN's kernel listeners in the C connection path.

The TUN's packet loop (:class:`~spliceway.native.tun.TunStack`) NATs every captured
TCP connection onto a kernel listener per family; this actor gives those listeners
to the C connection path as ``SW_IN_TUN`` listeners, so each accepted connection is
looked up in the stack's NAT table (its "handshake"), then routed, dialled and
spliced like one from any other inbound, and recorded with ``inbound {tag,
protocol: "tun"}``. It also starts and stops the actor that owns the stack's UDP
sessions and, with ``dns_hijack``, the server answering DNS over TCP on the stack's
port-53 listeners.

Only the listeners' registration runs here, on the dispatcher: the device, the
routes and the packet loop are brought up and down by
:class:`~spliceway.tun.service.TunService` around this actor's life, since netlink
work must not hold the dispatcher.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pykka

from spliceway.actors.dispatcher import Dispatcher, LoopActor
from spliceway.actors.flow import HANDSHAKE_TIMEOUT
from spliceway.native.conn import ConnPath, ListenerOptions

if TYPE_CHECKING:
    from spliceway.engine.core import InboundSpec
    from spliceway.native.tun import TunStack
    from spliceway.tun.dns_hijack import TunDnsTcp

logger = logging.getLogger(__name__)

#: Starts the actor of the stack's UDP sessions (None: UDP datagrams stay unread and
#: the stack drops them past its ring, counted).
UdpStarter = Callable[[], "pykka.ActorRef[Any] | None"]


class TunActor(LoopActor):
    """Accepts the TUN's captured TCP connections in C while alive."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        conn: ConnPath,
        stack: TunStack,
        specs: dict[int, InboundSpec],
        idle_timeout_ms: int,
        start_udp: UdpStarter | None = None,
        dns_tcp: TunDnsTcp | None = None,
    ) -> None:
        """``specs``: the listener slot's spec per family (4, 6) the stack captures."""
        super().__init__(dispatcher)
        self.conn = conn
        self.stack = stack
        self.specs = specs
        self.idle_timeout_ms = idle_timeout_ms
        self._start_udp = start_udp
        self.dns_tcp = dns_tcp
        self._listening: list[int] = []
        self.udp: pykka.ActorRef[Any] | None = None

    def on_start(self) -> None:
        """Hand each family's listener to C (the stack keeps owning the sockets)."""
        for version, spec in self.specs.items():
            sock = self.stack.listeners[version]
            self.conn.listen_tun(
                spec.index,
                sock.fileno(),
                ListenerOptions(
                    protocol="tun",
                    sniff=spec.sniff,
                    sniff_timeout_ms=spec.sniff_timeout_ms,
                    handshake_timeout_ms=int(HANDSHAKE_TIMEOUT * 1000),
                    idle_timeout_ms=self.idle_timeout_ms,
                ),
                self.stack.handle,
            )
            self._listening.append(spec.index)
        if self._start_udp is not None:
            self.udp = self._start_udp()
        if self.dns_tcp is not None:
            self.dns_tcp.start()

    def on_stop(self) -> None:
        """Stop the UDP sessions' actor and accepting (idempotent)."""
        self._teardown()

    def on_failure(self, *exc_info: object) -> None:
        """Never leave C accepting on a stack that is about to stop."""
        self._teardown()

    def _teardown(self) -> None:
        udp, self.udp = self.udp, None
        if udp is not None:
            with contextlib.suppress(pykka.ActorDeadError):
                # On this same dispatcher thread: a blocking stop would wait for itself.
                udp.stop(block=False)
        dns_tcp, self.dns_tcp = self.dns_tcp, None
        if dns_tcp is not None:
            dns_tcp.stop()
        # Each returns once no C loop can touch the listener's fd again.
        while self._listening:
            slot = self._listening.pop()
            try:
                self.conn.unlisten(slot)
            except Exception:
                logger.exception("unlistening TUN slot %d failed", slot)
