"""The engine's recent log lines in memory, for ``GET /api/v1/logs`` (docs/http-api.md).

A :class:`LogRing` is a ``logging.Handler`` that a running engine attaches to the
``spliceway`` logger (every logger of the package, ``spliceway.flow`` included) and
detaches when it stops. It keeps the newest :data:`LOG_RING_CAPACITY` records, each
with a sequence, so a client pages forward with ``since`` as it does on the event
ring.

Decisions:

- An endpoint, not an event type: events go to sinks at-least-once, and a sink that
  fails logs a warning, which as an event would go to the sink again. A ring that is
  only read never feeds itself, and emitting a record never logs.
- The ring keeps what reaches the ``spliceway`` logger at or above
  ``runtime.log_level`` (read at each record, so a reload's level applies at once).
  What reaches the logger is the host's logging configuration: ``spliceway run``
  sets it from ``runtime.log_level``; an embedding application that configures no
  logging gets Python's default, warnings and errors only.
- The handler is on a process-wide logger: two engines in one process each see the
  other's lines too (as they share stderr and log files).
- Each record's text is bounded (:data:`MESSAGE_MAX_CHARS`), so the ring's memory is.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

#: How many records the ring keeps (the oldest go first).
LOG_RING_CAPACITY = 1000
#: Upper bound of the query's ``limit``.
LOGS_LIMIT_MAX = LOG_RING_CAPACITY
#: A record's message (with its traceback, if any) is cut to this many characters.
MESSAGE_MAX_CHARS = 8192
#: The levels of ``runtime.log_level`` and of the query's ``level``, lowest first;
#: ``trace`` is ``debug`` in Python's logging (as ``spliceway run`` maps it).
LEVELS: dict[str, int] = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "error": logging.ERROR,
}
#: The logger the ring listens to (and so every ``spliceway.*`` logger).
ROOT_LOGGER = "spliceway"


def level_name(levelno: int) -> str:
    """A record's level in the configuration's words: debug, info, warn or error."""
    if levelno >= logging.ERROR:
        return "error"
    if levelno >= logging.WARNING:
        return "warn"
    if levelno >= logging.INFO:
        return "info"
    return "debug"


def _text(record: logging.LogRecord) -> str:
    try:
        message = record.getMessage()
    except Exception:  # a bad format string must not lose the line
        message = f"{record.msg!r} (unformattable arguments {record.args!r})"
    if record.exc_info and record.exc_info[0] is not None:
        message += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
    if len(message) > MESSAGE_MAX_CHARS:
        message = message[: MESSAGE_MAX_CHARS - 1] + "…"
    return message


class LogRing(logging.Handler):
    """The newest log records of the ``spliceway`` loggers, with sequences.

    ``threshold`` names the lowest level kept (a ``runtime.log_level`` value); it is
    called for every record, so it should be a cheap read.
    """

    def __init__(self, threshold: Callable[[], str], capacity: int = LOG_RING_CAPACITY) -> None:
        super().__init__(logging.DEBUG)
        self.capacity = capacity
        self._threshold = threshold
        self._ring: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._seq = 0
        self._ring_lock = threading.Lock()
        self._attached: logging.Logger | None = None
        #: ``log.set_level``'s level and the configured level it replaced: it holds while
        #: the configuration still says that level, so a reload that changes
        #: ``runtime.log_level`` wins (as a restart would).
        self._override: tuple[str, str] | None = None
        #: The ``spliceway`` logger's own level before the first ``set_log_level``, restored on
        #: ``detach``: the logger is process-wide and outlives this engine.
        self._logger_level: int | None = None

    @property
    def log_level(self) -> str:
        """The level in force: ``set_log_level``'s while the configured level is the one it
        replaced, else the configured one."""
        configured = self._threshold()
        override = self._override
        if override is not None and override[1] == configured:
            return override[0]
        return configured

    def configuration_changed(self) -> None:
        """Called whenever a new configuration is in force: one whose ``runtime.log_level``
        differs from the level ``set_log_level`` replaced ends the override (the
        configuration wins, as after a restart), and the logger gets its own level back."""
        override = self._override
        if override is not None and override[1] != self._threshold():
            self._override = None
            self._restore_logger()

    def _restore_logger(self) -> None:
        if self._logger_level is not None:
            logging.getLogger(ROOT_LOGGER).setLevel(self._logger_level)
            self._logger_level = None

    def set_log_level(self, level: str) -> None:
        """Keep records at or above ``level`` (a ``runtime.log_level`` value) from now on,
        and let the ``spliceway`` loggers create them: a host at Python's default
        (warnings only) would otherwise never hand a debug record to the ring."""
        if level not in LEVELS:
            raise ValueError(f"unknown log level {level!r}")
        self._override = (level, self._threshold())
        root = logging.getLogger(ROOT_LOGGER)
        if self._logger_level is None:
            self._logger_level = root.level
        root.setLevel(LEVELS[level])

    def emit(self, record: logging.LogRecord) -> None:
        """Keep ``record`` if it is at or above the threshold (never logs itself)."""
        if record.levelno < LEVELS.get(self.log_level, logging.INFO):
            return
        # Formatted outside the lock: a slow __str__ of an argument holds up no one else.
        fields = {
            "time_unix_ms": int(record.created * 1000),
            "level": level_name(record.levelno),
            "logger": record.name,
            "message": _text(record),
            "thread": record.threadName,
        }
        with self._ring_lock:
            self._seq += 1
            self._ring.append({"sequence": self._seq, **fields})

    def attach(self, logger_name: str = ROOT_LOGGER) -> None:
        """Start receiving the records of ``logger_name`` and its children."""
        if self._attached is None:
            self._attached = logging.getLogger(logger_name)
            self._attached.addHandler(self)

    def detach(self) -> None:
        """Stop receiving records; what the ring holds stays readable."""
        attached, self._attached = self._attached, None
        if attached is not None:
            attached.removeHandler(self)
        self._restore_logger()

    def snapshot(
        self, since: int | None = None, level: str | None = None, limit: int | None = None
    ) -> dict[str, Any]:
        """``GET /api/v1/logs``: the records after ``since`` at or above ``level``, the
        oldest ``limit`` of them first; the bounds describe the ring, not the list."""
        floor = LEVELS[level] if level is not None else logging.NOTSET
        with self._ring_lock:
            entries = list(self._ring)
            latest = self._seq
        oldest = entries[0]["sequence"] if entries else latest + 1
        chosen: list[dict[str, Any]] = []
        for entry in entries:
            if limit is not None and len(chosen) >= limit:
                break
            if since is not None and entry["sequence"] <= since:
                continue
            if LEVELS[entry["level"]] < floor:
                continue
            chosen.append(dict(entry))
        return {
            "records": chosen,
            "oldest_sequence": oldest,
            "latest_sequence": latest,
            "capacity": self.capacity,
        }
