"""Fake-ip: synthetic addresses handed out per domain from ``fake_ip_range``.

``runtime.dns.answer.type: fake_ip`` makes the engine's DNS server answer every name
with an address of its own from one network (IPv4 or IPv6), so a connection to that
address tells the engine the domain the client meant: flows to a fake address are
routed by their domain (``target.host`` is the domain, domain rules match).

The pool is a two-way table, domain <-> address:

- **Which addresses.** Every address of the range, except, when the range has more
  than four (IPv4 prefix up to /30, IPv6 up to /126), the network address, the first
  host (``198.18.0.1`` for the default ``198.18.0.0/15``: where a TUN inbound puts its
  own address, as mihomo and sing-box do) and, for IPv4, the broadcast address.
  Addresses are handed out in order.
- **When the range is full,** the least recently used mapping gives its address to
  the new domain. A mapping is *used* when its domain is looked up (a DNS answer) and
  when a flow to its address is mapped back (:meth:`FakeIpPool.domain_of`); the
  diagnostics' :meth:`FakeIpPool.peek_ip` / :meth:`FakeIpPool.peek_domain` do not
  count as use.
- **Persistence** (``persist_path``): the table is written atomically
  (:func:`spliceway.support.atomic_file.replace_file`) at most :data:`SAVE_DELAY_SECONDS`
  after a change, at once by :meth:`FakeIpPool.clear`, and by :meth:`FakeIpPool.close`
  (engine stop). A crash may lose the mappings made in the last second; it never
  leaves a torn file. The file is read when the pool is built: mappings outside the
  (possibly changed) range are dropped, and a damaged file is reported, set aside as
  ``<path>.damaged`` and the pool starts empty: it never stops the engine.

Domains are keys in the resolver cache's form (lower case, no trailing dot); the
caller passes valid host names (:func:`spliceway.dns.normalize_hostname`). Every
method is thread-safe: the DNS server, flow actors and command threads share a pool.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import orjson

from spliceway.support.atomic_file import replace_file

__all__ = ["FILE_VERSION", "SAVE_DELAY_SECONDS", "FakeIpPool", "domain_key"]

logger = logging.getLogger(__name__)

#: The ``version`` of the persisted file this build writes and reads.
FILE_VERSION = 1
#: Longest a new mapping waits to be written to ``persist_path``.
SAVE_DELAY_SECONDS = 1.0
#: Above this many addresses before the highest persisted one, the gaps below it are
#: not listed as free on load (an IPv6 range): they are used once the cursor passes.
_MAX_FREE_SCAN = 1 << 20

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def domain_key(domain: str) -> str:
    """The key a domain is stored under: lower case, no trailing dot."""
    return domain.rstrip(".").lower()


class FakeIpPool:
    """The domain <-> fake address table of one ``fake_ip_range`` (module docstring).

    ``warn`` is told (once, at construction) when ``persist_path`` could not be read
    back whole. Nothing here expires by time.
    """

    def __init__(
        self,
        fake_ip_range: str,
        persist_path: str | None = None,
        *,
        warn: Callable[[str], None] | None = None,
        save_delay: float = SAVE_DELAY_SECONDS,
    ) -> None:
        self.network: _Network = ipaddress.ip_network(fake_ip_range, strict=False)
        self.range = str(self.network)
        #: 4 or 6: which of A / AAAA the pool answers.
        self.version: int = self.network.version
        self.persist_path = persist_path
        size = self.network.num_addresses
        spare = size > 4
        # Offsets are positions among the usable addresses, 0 .. capacity-1.
        self._first = int(self.network.network_address) + (2 if spare else 0)
        self.capacity = size - ((3 if self.version == 4 else 2) if spare else 0)
        self._by_domain: dict[str, int] = {}
        #: offset -> domain, least recently used first.
        self._by_offset: OrderedDict[int, str] = OrderedDict()
        #: Offsets freed by clear(), used before new ones.
        self._free: list[int] = []
        #: The next never-used offset.
        self._cursor = 0
        #: Bumped whenever a mapping goes away (clear, reuse): a cache of answers made
        #: from this pool (the DNS server's) is stale when it has changed.
        self.generation = 0
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()
        self._save_delay = save_delay
        self._dirty = False
        self._timer: threading.Timer | None = None
        self._closed = False
        if persist_path is not None:
            problem = self._load(persist_path)
            if problem is not None:
                logger.warning("%s", problem)
                if warn is not None:
                    warn(problem)

    # -- addresses --------------------------------------------------------------------

    def _address(self, offset: int) -> str:
        return str(ipaddress.ip_address(self._first + offset))

    def _offset(self, ip: str) -> int | None:
        """The offset of ``ip`` in this pool, None when it is not one of its addresses.

        Reads a flow's target as the route table does (``[v6]`` brackets allowed, an
        IPv4-mapped IPv6 address as IPv4) but never a scoped IPv6 address, so every
        address it maps is one C hands to Python (csrc/route.c sw_table_host_deferred).
        """
        if ip[:1] == "[" and ip[-1:] == "]":
            ip = ip[1:-1]
        if "%" in ip:
            return None
        try:
            address: _Address = ipaddress.ip_address(ip)
        except ValueError:
            return None
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if address.version != self.version:
            return None
        offset = int(address) - self._first
        return offset if 0 <= offset < self.capacity else None

    def contains(self, ip: str) -> bool:
        """Whether ``ip`` is an address this pool hands out (mapped or not)."""
        return self._offset(ip) is not None

    # -- lookups ----------------------------------------------------------------------

    def lookup(self, domain: str) -> str:
        """The fake address of ``domain``, allocated now if it has none (marks it used)."""
        key = domain_key(domain)
        with self._lock:
            offset = self._by_domain.get(key)
            if offset is not None:
                self._by_offset.move_to_end(offset)
                return self._address(offset)
            offset = self._allocate()
            self._by_domain[key] = offset
            self._by_offset[offset] = key
            self._changed()
            return self._address(offset)

    def _allocate(self) -> int:
        if self._free:
            return self._free.pop()
        if self._cursor < self.capacity:
            self._cursor += 1
            return self._cursor - 1
        # Full: the least recently used mapping gives up its address.
        offset, old = self._by_offset.popitem(last=False)
        del self._by_domain[old]
        self.generation += 1
        return offset

    def domain_of(self, ip: str) -> str | None:
        """The domain mapped to fake address ``ip`` (marks it used), or None."""
        offset = self._offset(ip)
        if offset is None:
            return None
        with self._lock:
            domain = self._by_offset.get(offset)
            if domain is not None:
                self._by_offset.move_to_end(offset)
            return domain

    def peek_ip(self, domain: str) -> str | None:
        """The fake address of ``domain`` without allocating or marking use, or None."""
        with self._lock:
            offset = self._by_domain.get(domain_key(domain))
            return None if offset is None else self._address(offset)

    def peek_domain(self, ip: str) -> str | None:
        """The domain of fake address ``ip`` without marking use, or None."""
        offset = self._offset(ip)
        if offset is None:
            return None
        with self._lock:
            return self._by_offset.get(offset)

    def __len__(self) -> int:
        """How many mappings the pool holds."""
        with self._lock:
            return len(self._by_domain)

    def entries(self) -> list[tuple[str, str]]:
        """Every mapping as ``(domain, address)``, least recently used first."""
        with self._lock:
            return [(d, self._address(o)) for o, d in self._by_offset.items()]

    # -- clear --------------------------------------------------------------------------

    def clear(self, domain: str | None = None, ip: str | None = None) -> int:
        """Remove the mapping of ``domain``, or of ``ip``, or (neither) every mapping;
        how many were removed. Writes ``persist_path`` before returning (OSError if it
        cannot: the mappings are gone from memory all the same)."""
        if domain is not None and ip is not None:
            raise ValueError("clear takes a domain or an ip, not both")
        with self._lock:
            if domain is not None:
                offset = self._by_domain.pop(domain_key(domain), None)
                removed = [] if offset is None else [offset]
            elif ip is not None:
                offset = self._offset(ip)
                found = None if offset is None else self._by_offset.get(offset)
                removed = [] if found is None else [self._by_domain.pop(found)]
            else:
                removed = list(self._by_offset)
                self._by_domain.clear()
            for offset in removed:
                self._by_offset.pop(offset, None)
            if ip is None and domain is None:
                # Everything is free again: hand addresses out from the start.
                self._free.clear()
                self._cursor = 0
            else:
                self._free.extend(removed)
            if removed:
                self.generation += 1
                self._dirty = True
        if removed:
            self.save()
        return len(removed)

    # -- persistence ------------------------------------------------------------------

    def _changed(self) -> None:
        """A mapping was added or reused (lock held): write it out within the delay."""
        self._dirty = True
        if self.persist_path is None or self._timer is not None or self._closed:
            return
        timer = threading.Timer(self._save_delay, self._timed_save)
        timer.daemon = True
        timer.name = "spliceway-fakeip-save"
        self._timer = timer
        timer.start()

    def _timed_save(self) -> None:
        with self._lock:
            self._timer = None
        try:
            self.save()
        except OSError as ex:
            logger.error("cannot write the fake-ip table to %s: %s", self.persist_path, ex)

    def _document(self) -> bytes:
        """The persisted form of the table (lock held)."""
        entries = [[d, self._address(o)] for o, d in self._by_offset.items()]
        return orjson.dumps({"version": FILE_VERSION, "range": self.range, "entries": entries})

    def save(self) -> None:
        """Write the table to ``persist_path`` now if it changed (nothing without a path).

        Raises OSError when the file cannot be written (the table stays dirty)."""
        if self.persist_path is None:
            return
        # One writer at a time: replace_file's temporary name is per process.
        with self._save_lock:
            with self._lock:
                if not self._dirty:
                    return
                data = self._document()
                self._dirty = False
            try:
                replace_file(self.persist_path, data)
            except OSError:
                with self._lock:
                    self._dirty = True
                raise

    def close(self, *, save: bool = True) -> None:
        """Stop the delayed writer and (``save``) write what is pending: engine stop,
        reload. ``save=False`` leaves the file as it is (an apply rolled back)."""
        with self._lock:
            self._closed = True
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        if not save:
            return
        try:
            self.save()
        except OSError as ex:
            logger.error("cannot write the fake-ip table to %s: %s", self.persist_path, ex)

    def _load(self, path: str) -> str | None:
        """Read ``path`` into the empty pool; a sentence when it could not be used whole."""
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        except OSError as ex:
            return f"cannot read the fake-ip table {path}: {ex.strerror or ex}; starting empty"
        try:
            entries = _parse(raw)
        except ValueError as ex:
            aside = f"{path}.damaged"
            with contextlib.suppress(OSError):
                os.replace(path, aside)
            return (
                f"the fake-ip table {path} is damaged ({ex}); it was moved to {aside} and "
                "the table starts empty"
            )
        dropped = 0
        for domain, ip in entries:
            offset = self._offset(ip)
            key = domain_key(domain)
            if offset is None or not key or key in self._by_domain or offset in self._by_offset:
                dropped += 1
                continue
            self._by_domain[key] = offset
            self._by_offset[offset] = key
        self._cursor = max(self._by_offset, default=-1) + 1
        if self._cursor <= _MAX_FREE_SCAN:
            self._free = [o for o in range(self._cursor - 1, -1, -1) if o not in self._by_offset]
        if dropped:
            self._dirty = True
            return (
                f"the fake-ip table {path}: {dropped} mapping(s) outside {self.range} or "
                "repeated were dropped"
            )
        return None


def _parse(raw: bytes) -> list[tuple[str, str]]:
    """The ``(domain, ip)`` entries of a persisted table; ValueError when damaged."""
    try:
        doc: Any = orjson.loads(raw)
    except orjson.JSONDecodeError as ex:
        raise ValueError(f"not JSON: {ex}") from None
    if not isinstance(doc, dict) or doc.get("version") != FILE_VERSION:
        raise ValueError(f"not a version {FILE_VERSION} fake-ip table")
    entries = doc.get("entries")
    if not isinstance(entries, list):
        raise ValueError("entries is not a list")
    out: list[tuple[str, str]] = []
    for item in entries:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not all(isinstance(part, str) for part in item)
        ):
            raise ValueError(f"an entry is not [domain, ip]: {item!r:.80}")
        out.append((item[0], item[1]))
    return out
