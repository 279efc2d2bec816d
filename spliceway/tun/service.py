"""The engine's TUN: ``tun.start`` / ``tun.stop`` / ``tun_status`` and ``runtime.tun``.

:class:`TunService` composes the host side (:class:`~spliceway.tun.controller.
TunController`: device, routes, rules, mark), the packet loop
(:class:`~spliceway.native.tun.TunStack`) and the actor that hands the loop's kernel
listeners to the C connection path (:class:`~spliceway.actors.tun.TunActor`, which the
engine passes in as ``TunParts.start_actor``). Start brings them up in that order and
undoes the finished steps when one fails; stop takes them down in reverse. Both are
serialised by one lock and run on the caller's thread (a command's), never on the
dispatcher: netlink work takes tens of milliseconds.

A TUN's flows come from two listener slots of their own (:data:`TUN_SLOTS`, one per
family), never used by configured inbounds, so a rule's ``inbound_tag`` names both.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pykka

from spliceway.errors import ApiError, invalid_argument
from spliceway.native.tun import TunStack
from spliceway.support.loop import Dispatcher
from spliceway.tun.controller import TunController, TunHandle
from spliceway.tun.dns_hijack import TunDnsTcp

log = logging.getLogger("spliceway.tun")

#: C listener slots of the TUN's kernel listeners (IPv4, IPv6): the last two of
#: csrc/conn.c's 256; configured inbounds use the others (spliceway.engine.reconcile).
TUN_SLOTS = {4: 254, 6: 255}
#: Seconds to wait for the actor to register or drop the listeners.
_ACTOR_TIMEOUT = 10.0

#: Starts the actor of the stack's UDP sessions (None: none).
UdpStarter = Callable[[], "pykka.ActorRef[Any] | None"]
#: ``start_actor(stack, specs, idle_timeout_ms, start_udp, dns_tcp)``: the TUN's actor,
#: given the stack, its listener slot's spec per family, ``runtime.tcp_idle_timeout``
#: in ms, the UDP sessions' starter and the DNS-over-TCP hijack (each None: none).
TunActorStarter = Callable[
    [TunStack, dict[int, Any], int, UdpStarter | None, TunDnsTcp | None], "pykka.ActorRef[Any]"
]


@dataclass(frozen=True, slots=True)
class TunParts:
    """What the service needs of the engine, and nothing more."""

    dispatcher: Dispatcher
    """The dispatcher the actors and the DNS hijack run on."""
    start_actor: TunActorStarter
    """Starts the actor that gives the stack's kernel listeners to the C connection path
    (``spliceway.actors.tun.TunActor``, on the dispatcher). Given, not imported: the
    actors sit above this package."""
    register: Callable[[int, str], Any]
    """``register(slot, tag)``: make ``slot`` a TUN inbound named ``tag``; returns its
    spec (the flows' records name it)."""
    republish: Callable[[], None]
    """Recompile C's route table (a TUN's tag maps to its slots, or no longer)."""
    inbound_tags: Callable[[], set[str]]
    """The configured inbounds' tags now (a TUN's tag must differ)."""
    idle_timeout_ms: Callable[[], int]
    """``runtime.tcp_idle_timeout_seconds`` now, in ms."""
    network_mtu: Callable[[], int]
    """``runtime.network.mtu`` now."""
    end_flows: Callable[[str], None]
    """End the open flows of inbound ``tag`` (the TUN is going: their clients with it)."""
    udp_idle_timeout_s: Callable[[], float]
    """``runtime.udp_upstream_idle_timeout_seconds`` now."""
    dns_responder: Callable[[], Any]
    """The engine's DNS responder (``DnsResponder``), for ``dns_hijack``."""
    start_udp: Callable[[Any, TunStack, Any], pykka.ActorRef[Any] | None] | None = None
    """Starts the actor of the stack's UDP sessions (given the TUN's spec, the stack and
    the DNS responder or None), on the dispatcher; None: none (datagrams are dropped,
    counted)."""
    warn_fd_exhausted: Callable[[str], None] | None = None
    """Emits ``engine.warning`` ``fd_exhausted`` (the DNS hijack's listeners out of
    descriptors)."""


@dataclass(slots=True)
class _Running:
    handle: TunHandle
    stack: TunStack
    actor: pykka.ActorRef[Any]
    slots: tuple[int, ...]

    @property
    def tag(self) -> str:
        return self.handle.options.tag


class TunService:
    """One engine's TUN (at most one at a time)."""

    def __init__(self, parts: TunParts, controller: TunController | None = None) -> None:
        self._parts = parts
        self.controller = controller if controller is not None else TunController()
        self._lock = threading.Lock()
        self._running: _Running | None = None

    @property
    def running(self) -> bool:
        """Whether a TUN is up."""
        return self._running is not None

    @property
    def managed_by_config(self) -> bool:
        """Whether the running TUN came from ``runtime.tun``."""
        opts = self.controller.options
        return opts is not None and opts.managed_by_config

    def route_inbounds(self) -> dict[str, tuple[int, ...]]:
        """The running TUN's tag and its listener slots (for rules' ``inbound_tag``)."""
        run = self._running
        return {} if run is None else {run.tag: run.slots}

    def stats(self) -> dict[str, int]:
        """The packet loop's counters (csrc/tun.h sw_tun_stats); empty when stopped."""
        run = self._running
        if run is None:
            return {}
        with contextlib.suppress(Exception):
            return run.stack.stats()
        return {}

    def status(self) -> dict[str, Any]:
        """``tun_status`` (interface.md 2.9)."""
        return self.controller.status()

    # -- start -------------------------------------------------------------------------

    def start(
        self, params: Mapping[str, Any], *, managed_by_config: bool, field_prefix: str = ""
    ) -> None:
        """Bring a TUN up with ``tun.start`` ``params`` (4.4); ApiError as
        :meth:`TunController.start`, plus ``invalid_argument`` for a tag that names a
        configured inbound. ``field_prefix`` goes before an error's ``field_path``
        (where the params sit in the caller's document: ``params.``, ``runtime.tun.``)."""
        try:
            self._start(params, managed_by_config)
        except ApiError as ex:
            if ex.field_path is not None:
                ex.field_path = field_prefix + ex.field_path
            raise

    def _start(self, params: Mapping[str, Any], managed_by_config: bool) -> None:
        with self._lock:
            if self._running is not None:
                raise ApiError("conflict", "a TUN is already running")
            parts = self._parts
            tag = params.get("tag")
            if isinstance(tag, str) and tag in parts.inbound_tags():
                raise invalid_argument(f"tag {tag!r} already names an inbound", "tag")
            # Offloads (virtio-net header, TSO, checksum): the loop then moves up to
            # 64 KiB per read and write instead of one MTU-sized packet.
            handle = self.controller.start(
                params,
                network_mtu=parts.network_mtu(),
                managed_by_config=managed_by_config,
                vnet_hdr=True,
            )
            try:
                self._running = self._start_loop(handle)
            except BaseException as ex:
                with contextlib.suppress(Exception):
                    self.controller.stop()
                if isinstance(ex, ApiError):
                    raise
                raise ApiError("internal", f"starting the TUN's packet loop failed: {ex}") from ex
            parts.republish()

    def _start_loop(self, handle: TunHandle) -> _Running:
        parts = self._parts
        opts = handle.options
        stack = TunStack(
            handle.fds[0],
            opts.interfaces,
            handle.mtu,
            dns_tcp=opts.dns_hijack,
            udp_idle_timeout=parts.udp_idle_timeout_s(),
            vnet_hdr=True,
        )
        stack.start()
        try:
            specs = {v: parts.register(TUN_SLOTS[v], opts.tag) for v in stack.listeners}
            dns = parts.dns_responder() if opts.dns_hijack else None
            dns_tcp = (
                TunDnsTcp(
                    dns,
                    list(stack.dns_listeners.values()),
                    parts.dispatcher,
                    parts.warn_fd_exhausted,
                )
                if dns is not None
                else None
            )
            start_udp = None
            if parts.start_udp is not None:
                udp_starter = parts.start_udp
                spec = next(iter(specs.values()))

                def start_udp() -> pykka.ActorRef[Any] | None:
                    return udp_starter(spec, stack, dns)

            actor = parts.start_actor(
                stack,
                specs,
                parts.idle_timeout_ms(),
                start_udp,
                dns_tcp,
            )
            try:
                # on_start (listen_tun) has run once an ask is answered: a failure there
                # stops the actor and fails the ask.
                actor.proxy().udp.get(timeout=_ACTOR_TIMEOUT)
            except BaseException:
                with contextlib.suppress(Exception):
                    actor.stop(timeout=_ACTOR_TIMEOUT)
                raise
        except BaseException:
            stack.stop()
            raise
        return _Running(handle, stack, actor, tuple(s.index for s in specs.values()))

    # -- stop --------------------------------------------------------------------------

    def stop(self) -> bool:
        """Take the TUN down; False when none was running. Its open flows end first
        (their clients reach them only through the device that is going)."""
        with self._lock:
            run, self._running = self._running, None
            if run is None:
                return False
            self._parts.republish()
            with contextlib.suppress(pykka.ActorDeadError):
                run.actor.stop(timeout=_ACTOR_TIMEOUT)
            self._parts.end_flows(run.tag)
            # The loop reads the device's fd: it stops before the controller closes it.
            run.stack.stop()
            self.controller.stop()
            log.info("TUN %s stopped", run.handle.name)
            return True
