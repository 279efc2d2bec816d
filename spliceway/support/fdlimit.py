"""File-descriptor limits and what a listener does when it runs out (docs/running.md).

At start the engine raises its soft ``RLIMIT_NOFILE`` to the hard limit
(:func:`raise_nofile_limit`): the soft limit a shell hands down (often 1,024) is a
compatibility default for programs that ``select()``, which the engine does not use,
and about 500 tunnels exhaust it.

When ``accept()`` fails because the process or the system is out of descriptors
(``EMFILE``/``ENFILE``) the pending connection stays in the kernel's backlog, so the
listening socket stays readable and a loop that simply retries spins at a full core,
usually logging every failure. Every listener instead keeps an :class:`AcceptBackoff`:
it pauses accepting for the delay :meth:`AcceptBackoff.failed` returns (growing from
:data:`BACKOFF_INITIAL_S` to :data:`BACKOFF_MAX_S`), reports the outage once (one
WARNING line and ``engine.warning`` :data:`WARNING_CODE` through ``warn``), and keeps
serving the connections it already has. The first successful accept ends the outage.

``ENOBUFS``/``ENOMEM`` from ``accept()`` (socket memory exhausted) spin the same way
and are treated the same; the message says which error it was.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from spliceway.events.log import EventLog

logger = logging.getLogger(__name__)

#: The ``engine.warning`` code of a listener out of file descriptors.
WARNING_CODE: Final = "fd_exhausted"
#: The first pause after a failed accept; doubled after each further failure up to the cap.
BACKOFF_INITIAL_S: Final = 0.05
BACKOFF_MAX_S: Final = 1.0
#: At most one debug line per this many seconds while an outage lasts.
DEBUG_INTERVAL_S: Final = 10.0

_EXHAUSTION: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def is_fd_exhaustion(err: int | None) -> bool:
    """Whether ``accept()`` failing with errno ``err`` means the process or the system
    is out of descriptors (or socket memory), so retrying at once would only spin."""
    return err in _EXHAUSTION


def nofile_limits() -> tuple[int, int]:
    """The soft and hard ``RLIMIT_NOFILE`` now (``-1`` for unlimited, as ``RLIM_INFINITY``
    reads back on Linux)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _plain(soft), _plain(hard)


def _plain(limit: int) -> int:
    return -1 if limit == resource.RLIM_INFINITY else limit


def raise_nofile_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; return ``(soft, hard)`` after.

    An unlimited hard limit (possible for root) is not copied: Linux refuses a soft
    limit above ``/proc/sys/fs/nr_open``, so the soft limit goes to that instead. A
    refusal leaves the limits as they were (logged at debug; the engine runs on).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        target = _nr_open()
    if target != resource.RLIM_INFINITY and (soft == resource.RLIM_INFINITY or soft >= target):
        return nofile_limits()
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        logger.debug("cannot raise RLIMIT_NOFILE from %s to %s: %s", soft, target, exc)
    else:
        logger.debug("raised the RLIMIT_NOFILE soft limit from %s to %s", soft, target)
    return nofile_limits()


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open", encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 1 << 20  # the kernel's default nr_open


def warning_emitter(log: EventLog) -> Callable[[str], None]:
    """A ``warn`` for :class:`AcceptBackoff` that emits ``engine.warning`` ``fd_exhausted``
    on ``log`` (thread-safe; it does not log: the backoff already wrote the line)."""

    def warn(message: str) -> None:
        log.emit("engine.warning", {"code": WARNING_CODE, "message": message})

    return warn


#: Every live backoff (for the names of listeners in an outage).
_registry: weakref.WeakSet[AcceptBackoff] = weakref.WeakSet()
#: Totals over every backoff since start, kept here so a stopped listener's count stays.
_totals = {"failures": 0, "outages": 0}
_registry_lock = threading.Lock()


class AcceptBackoff:
    """One listener's reaction to ``accept()`` failing for want of descriptors.

    Call :meth:`failed` with the errno of every failed accept and pause accepting for
    the seconds it returns (0.0: not an exhaustion, handle the error as before); call
    :meth:`accepted` after every successful accept (cheap when there is no outage).
    Thread-safe: a lock guards the state, so a listener may call from any thread.
    """

    def __init__(self, listener: str, warn: Callable[[str], None]) -> None:
        """``listener`` names it in messages (e.g. ``inbound 'socks-in' (127.0.0.1:1080)``);
        ``warn(message)`` is called once at the start of each outage."""
        self.listener = listener
        self._warn = warn
        self._lock = threading.Lock()
        self._delay = 0.0
        self._in_outage = False
        self._outage_failures = 0
        self._last_debug = 0.0
        #: Failed accepts for want of descriptors since start.
        self.failures = 0
        #: Outages since start (a run of failures ended by a successful accept).
        self.outages = 0
        with _registry_lock:
            _registry.add(self)

    @property
    def in_outage(self) -> bool:
        """Whether the last accept failed for want of descriptors."""
        return self._in_outage

    def failed(self, err: int | None) -> float:
        """A failed accept with errno ``err``: the seconds to pause accepting, growing
        from :data:`BACKOFF_INITIAL_S` to :data:`BACKOFF_MAX_S`; ``0.0`` when ``err`` is
        not an exhaustion. The first failure of an outage logs one WARNING line and
        calls ``warn``; later ones only count (and a debug line every
        :data:`DEBUG_INTERVAL_S`)."""
        if not is_fd_exhaustion(err):
            return 0.0
        first = False
        debug = False
        now = time.monotonic()
        with self._lock:
            self.failures += 1
            self._outage_failures += 1
            if not self._in_outage:
                self._in_outage = True
                self.outages += 1
                self._delay = BACKOFF_INITIAL_S
                self._last_debug = now
                first = True
            else:
                self._delay = min(self._delay * 2, BACKOFF_MAX_S)
                if now - self._last_debug >= DEBUG_INTERVAL_S:
                    self._last_debug = now
                    debug = True
            delay = self._delay
            count = self._outage_failures
        with _registry_lock:
            _totals["failures"] += 1
            _totals["outages"] += int(first)
        if first:
            message = self._message(err)
            # Logged and warned outside the lock: a handler may be slow or emit itself.
            logger.warning("%s", message)
            try:
                self._warn(message)
            except Exception:  # the listener must go on backing off whatever warn does
                logger.exception("reporting %s failed", WARNING_CODE)
        elif debug:
            logger.debug("%s: still out of descriptors (%d failed accepts)", self.listener, count)
        return delay

    def accepted(self, failed: int | None = None) -> None:
        """A successful accept: ends an outage (one info line) and resets the delay.

        ``failed``: the accepts that failed in the outage, when someone else counted
        them (the C loops report only an outage's first failure and its end)."""
        if not self._in_outage:  # the common case, without the lock
            return
        with self._lock:
            if not self._in_outage:
                return
            self._in_outage = False
            extra = max(0, failed - self._outage_failures) if failed is not None else 0
            self.failures += extra
            count = self._outage_failures + extra
            self._outage_failures = 0
            self._delay = 0.0
        if extra:
            with _registry_lock:
                _totals["failures"] += extra
        logger.info("%s accepts connections again (%d accepts failed)", self.listener, count)

    def _message(self, err: int | None) -> str:
        soft, hard = nofile_limits()
        name = errno.errorcode.get(err or 0, str(err))
        what = (
            "out of socket memory"
            if err in (errno.ENOBUFS, errno.ENOMEM)
            else "out of file descriptors"
        )
        # Counting needs a descriptor of its own: out of them, the count is left out.
        count = _open_fds()
        opened = f", {count} open" if count != "?" else ""
        return (
            f"{self.listener} cannot accept connections: {what} ({name}; RLIMIT_NOFILE "
            f"soft {_limit_text(soft)}, hard {_limit_text(hard)}{opened}); it pauses "
            f"accepting (up to {BACKOFF_MAX_S:g} s between attempts) and serves the "
            "connections already open"
        )


def _limit_text(limit: int) -> str:
    return "unlimited" if limit < 0 else str(limit)


def _open_fds() -> str:
    try:
        return str(len(os.listdir("/proc/self/fd")))
    except OSError:  # listing needs a descriptor too: none may be left
        return "?"


def backoff_stats() -> dict[str, Any]:
    """Totals over every listener's backoff since start: ``accept_failures`` (failed
    accepts for want of descriptors), ``outages`` and ``listeners_in_outage`` (names)."""
    with _registry_lock:
        live = list(_registry)
        failures, outages = _totals["failures"], _totals["outages"]
    return {
        "accept_failures": failures,
        "outages": outages,
        "listeners_in_outage": sorted(b.listener for b in live if b.in_outage),
    }


def snapshot() -> dict[str, Any]:
    """The ``file_descriptors`` of the ``runtime`` query: the limits, the descriptors
    open now (absent when they cannot be counted) and :func:`backoff_stats`."""
    soft, hard = nofile_limits()
    stats = backoff_stats()
    out: dict[str, Any] = {
        "soft_limit": soft,
        "hard_limit": hard,
        "accept_failures": stats["accept_failures"],
        "accept_outages": stats["outages"],
        "listeners_out_of_descriptors": stats["listeners_in_outage"],
    }
    count = _open_fds()
    if count != "?":
        out["open"] = int(count)
    return out
