"""The engine's fake-ip pool and DNS server as ``runtime.dns`` configures them, and how a
start or a reload replaces them.

Like the listeners, a change is prepared first (:meth:`DnsService.prepare`: sockets
bound, the pool read from its file; this may fail, and nothing is visible yet), then
installed (:meth:`DnsService.install`, which cannot fail half-way) or discarded
(:meth:`DnsPlan.discard`) when the apply is rolled back.

- The pool is kept, with its mappings, while ``answer`` stays the same; a new
  ``fake_ip_range`` or ``persist_path`` builds a new one (from the file, which the old
  pool has written first, so a reload keeps the mappings that fit the new range).
- The server is kept while ``listen`` stays the same: it reads the resolver and the
  pool at every query, so a new ``servers``, ``cache`` or ``answer`` takes effect at
  once, and is given the new ``client_rate_limit``. A new ``listen`` starts a server
  on the new address and stops the old one.
  (Moving to another address with the same port fails the apply while the old server
  holds the port: change the port, or go through ``listen: null``.)
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from spliceway.config import DnsSettings
from spliceway.dns.fakeip import FakeIpPool
from spliceway.dns.server import DnsResponder, DnsServer, bind_dns

if TYPE_CHECKING:
    from spliceway.dns.resolver import Resolver
    from spliceway.support.loop import Dispatcher

__all__ = ["FAKEIP_WARNING", "DnsPlan", "DnsService"]

logger = logging.getLogger(__name__)

#: The ``engine.warning`` code for a fake-ip table that could not be read back whole.
FAKEIP_WARNING = "fakeip_table_damaged"


@dataclass(slots=True)
class DnsPlan:
    """A prepared ``runtime.dns``: what :meth:`DnsService.install` puts in place."""

    settings: DnsSettings
    pool: FakeIpPool | None
    #: The pool is new (not the running one).
    new_pool: bool = False
    #: ``listen`` differs from the running one's.
    listen_changed: bool = False
    #: The new server's sockets (``listen_changed`` and a new ``listen``).
    sockets: tuple[socket.socket, socket.socket] | None = None
    #: Why the pool's file could not be read back whole (``engine.warning`` at install).
    warnings: list[str] = field(default_factory=list)
    #: :meth:`DnsService.install` took it: nothing is left to discard.
    installed: bool = False

    def discard(self) -> None:
        """Undo the preparation (the apply did not go through): nothing is written."""
        if self.installed:
            return
        if self.sockets is not None:
            for sock in self.sockets:
                with contextlib.suppress(OSError):
                    sock.close()
            self.sockets = None
        if self.new_pool and self.pool is not None:
            self.pool.close(save=False)


class DnsService:
    """The running pool and server; ``resolver`` gives the engine's resolver now, ``warn``
    reports a damaged pool file (the engine emits ``engine.warning``), ``loop`` gives the
    dispatcher the server runs on (None, the engine's choice: a thread of its own, so no
    DNS load delays the flows on the dispatcher's loop), ``warn_fd_exhausted`` reports
    the server's TCP listener out of file descriptors (``engine.warning``
    ``fd_exhausted``)."""

    def __init__(
        self,
        resolver: Callable[[], Resolver],
        warn: Callable[[str], None],
        loop: Callable[[], Dispatcher | None] = lambda: None,
        *,
        warn_fd_exhausted: Callable[[str], None] | None = None,
    ) -> None:
        self._resolver = resolver
        self._warn = warn
        self._loop = loop
        self._warn_fd_exhausted = warn_fd_exhausted
        self.settings: DnsSettings | None = None
        #: The fake-ip pool (``answer.type: fake_ip``), else None.
        self.pool: FakeIpPool | None = None
        #: The DNS server (``listen`` set), else None.
        self.server: DnsServer | None = None

    def prepare(self, settings: DnsSettings) -> DnsPlan:
        """Bind and load what ``settings`` needs beside the running ones; ApiError
        (``conflict``, on ``runtime.dns.listen``) when its address cannot be bound."""
        old = self.settings
        plan = DnsPlan(settings, self.pool)
        answer = settings.answer
        if answer.type != "fake_ip":
            plan.pool = None
        elif old is None or old.answer != answer or self.pool is None:
            if self.pool is not None and self.pool.persist_path == answer.persist_path:
                with contextlib.suppress(OSError):
                    self.pool.save()  # the new pool reads what the old one holds
            plan.pool = FakeIpPool(
                answer.fake_ip_range, answer.persist_path, warn=plan.warnings.append
            )
            plan.new_pool = True
        plan.listen_changed = old is None or old.listen != settings.listen
        if plan.listen_changed and settings.listen is not None:
            try:
                plan.sockets = bind_dns(settings.listen.address, settings.listen.port)
            except BaseException:
                plan.discard()
                raise
        return plan

    def install(self, plan: DnsPlan) -> None:
        """Put ``plan`` in place: the pool, then the server (starting a new one on the
        plan's sockets, stopping the old one)."""
        plan.installed = True
        old_pool = self.pool
        self.settings = plan.settings
        self.pool = plan.pool
        if old_pool is not None and old_pool is not plan.pool:
            # A new pool on the same file has read it already: the old one must not
            # write over it.
            same_file = plan.pool is not None and plan.pool.persist_path == old_pool.persist_path
            old_pool.close(save=not same_file)
        for message in plan.warnings:
            self._warn(message)
        if not plan.listen_changed:
            if self.server is not None:
                self.server.rate_limit.configure(plan.settings.client_rate_limit)
            return
        old_server, self.server = self.server, None
        if old_server is not None:
            old_server.stop()
        if plan.sockets is not None:
            udp, tcp = plan.sockets
            plan.sockets = None
            responder = DnsResponder(self._resolver, lambda: self.pool)
            server = DnsServer(
                udp,
                tcp,
                responder,
                self._loop(),
                rate_limit=plan.settings.client_rate_limit,
                warn=self._warn_fd_exhausted,
            )
            try:
                server.start()
            except Exception:
                logger.exception("the DNS server could not start")
                return
            self.server = server

    def stop(self) -> None:
        """Stop the server and write the pool (engine stop)."""
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.pool is not None:
            self.pool.close()
