"""The engine's side of the flow hook (docs/flow-hook.md): ask a local hook process
whether a new flow may go on.

The hook process serves a Unix stream socket. For each flow the hook selects, the
engine writes one line ``{"id": <n>, "flow": <FlowRecord, state opening>}`` and waits
up to ``timeout_ms`` for one line ``{"id": <n>, "verdict": "allow" | "deny",
"principal_key"?: string, "labels"?: {string: string}}``. Requests are pipelined on
one connection and answered in any order by ``id``.

The hook is advisory, never in the way: when it is unreachable, slow or answers
something unparsable the flow is allowed as if there were no hook (*fail-open*), and
``warn(message)`` is called once per outage so the engine can emit ``engine.warning``
with code ``ipc_hook_unreachable`` (``WARNING_CODE``).

Threads: a ``FlowHookClient`` lives on one asyncio loop (the dispatcher's). Every
method but ``close`` must be called on that loop's thread; nothing blocks it. The
connection is an ``asyncio.Protocol``: its ``data_received`` splits lines and settles
the waiting futures directly, so an answer costs no task switch of its own and an ask
costs one future and one timer handle, no task.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import orjson

from spliceway.shapes.flow import FlowRecord

if TYPE_CHECKING:
    from spliceway.config.models_api import FlowHook
    from spliceway.flows.records import FlowState

logger = logging.getLogger(__name__)

#: The ``engine.warning`` code the engine emits with ``warn``'s message.
WARNING_CODE: Final = "ipc_hook_unreachable"
#: The longest answer line read; a longer one is skipped (to its newline) and counted.
MAX_ANSWER_LINE: Final = 1 << 20
#: Bytes of requests the connection may hold unsent (a hook that stopped reading);
#: an ask that would exceed it fails open at once instead of growing memory.
MAX_WRITE_BUFFER: Final = 1 << 20
#: Reconnect backoff: the first wait, doubled after each failed attempt up to the cap.
BACKOFF_INITIAL_S: Final = 0.05
BACKOFF_MAX_S: Final = 5.0
#: AF_UNIX ``sun_path`` holds 108 bytes with the terminating NUL (Linux).
_MAX_SOCKET_PATH = 107
_NETWORKS = frozenset({"tcp", "udp"})

#: ``Verdict.reason`` of fail-open verdicts.
TIMEOUT: Final = "timeout"
UNREACHABLE: Final = "unreachable"
DISCONNECTED: Final = "disconnected"
BAD_ANSWER: Final = "bad_answer"
BACKPRESSURE: Final = "backpressure"
UNENCODABLE: Final = "unencodable"
CLOSED: Final = "closed"
FAIL_OPEN_REASONS: Final = (
    TIMEOUT,
    UNREACHABLE,
    DISCONNECTED,
    BAD_ANSWER,
    BACKPRESSURE,
    UNENCODABLE,
    CLOSED,
)


def _names(value: Iterable[str], what: str) -> tuple[str, ...]:
    # A str is an Iterable[str] too: "tcp" must not become ("c", "p", "t").
    if isinstance(value, str | bytes):
        raise ValueError(f"{what} must be a list of strings, not a string")
    names = tuple(value)
    if not names:
        raise ValueError(f"{what} must not be empty (omit it, or give null, for all)")
    if not all(isinstance(name, str) and name for name in names):
        raise ValueError(f"{what} must hold non-empty strings")
    # Sorted and unique: settings that select the same flows compare equal, which is
    # what a config reload asks ("did the hook change?").
    return tuple(sorted(set(names)))


@dataclass(frozen=True, slots=True)
class HookSettings:
    """``api.flow_hook``: where the hook listens, how long to wait, which flows to ask.

    ``networks`` and ``inbound_tags`` are normalised to sorted tuples without
    duplicates; ``inbound_tags=None`` selects every inbound. Empty lists are refused
    (a hook that selects nothing is a configuration mistake, and "empty means all"
    would be a surprise in a selector). ``ValueError`` names the offending field.
    """

    path: str
    timeout_ms: int = 200
    networks: tuple[str, ...] = ("tcp", "udp")
    inbound_tags: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path or "\0" in self.path:
            raise ValueError("path must be a non-empty socket path")
        if len(os.fsencode(self.path)) > _MAX_SOCKET_PATH:
            # Caught here, not as an outage at every flow.
            raise ValueError(f"path is longer than {_MAX_SOCKET_PATH} bytes (AF_UNIX limit)")
        timeout = self.timeout_ms
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0:
            raise ValueError("timeout_ms must be a positive integer")
        networks = _names(self.networks, "networks")
        unknown = set(networks) - _NETWORKS
        if unknown:
            raise ValueError(f"networks: unknown {sorted(unknown)} (tcp, udp)")
        object.__setattr__(self, "networks", networks)
        if self.inbound_tags is not None:
            object.__setattr__(self, "inbound_tags", _names(self.inbound_tags, "inbound_tags"))

    @classmethod
    def from_config(cls, hook: FlowHook) -> HookSettings:
        """The settings of a validated ``api.flow_hook`` (built here, not in the config,
        so the configuration imports nothing from the flows above it)."""
        return cls(
            path=hook.path,
            timeout_ms=hook.timeout_ms,
            networks=hook.networks,
            inbound_tags=hook.inbound_tags,
        )

    def selects(self, network: str, inbound_tag: str) -> bool:
        """Whether a new flow on ``network`` through inbound ``inbound_tag`` asks the hook."""
        return network in self.networks and (
            self.inbound_tags is None or inbound_tag in self.inbound_tags
        )


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a flow does with the hook's answer.

    ``allow`` False: the flow is blocked (``hook_denied``). ``principal_key`` and
    ``labels`` come only with an allow the hook gave; they go into the flow's record.
    ``failed_open``: no usable answer (``reason`` says why: ``timeout``,
    ``unreachable``, ``disconnected``, ``bad_answer``, ``backpressure``,
    ``unencodable``, ``closed``); the flow goes on as if there were no hook.
    """

    allow: bool
    principal_key: str | None = None
    labels: dict[str, str] | None = None
    failed_open: bool = False
    reason: str | None = None


#: Shared instances: most answers carry nothing but the verdict, and every failure of
#: one kind is the same value, so no allocation per answer.
ALLOW: Final = Verdict(allow=True)
DENY: Final = Verdict(allow=False)
_FAIL_OPEN = {
    reason: Verdict(allow=True, failed_open=True, reason=reason) for reason in FAIL_OPEN_REASONS
}


class BadAnswer(ValueError):
    """An answer line that is not a valid answer.

    ``request_id`` is the line's ``id`` when it could be read (a JSON object with an
    integer ``id``), so the request it names can fail open at once instead of waiting
    for its timeout; else None.
    """

    def __init__(self, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


def parse_answer(line: bytes | bytearray | memoryview) -> tuple[int, Verdict]:
    """One answer line (without or with its newline) as ``(id, Verdict)``.

    Valid: a JSON object with an integer ``id`` (not a boolean), ``verdict`` ``"allow"``
    or ``"deny"``, optional ``principal_key`` (a non-empty string; null counts as
    absent) and optional ``labels`` (an object whose keys are non-empty strings and
    whose values are strings; null counts as absent). Other members are ignored, so
    hooks may add fields later. ``principal_key`` and ``labels`` are checked with a
    deny too (a malformed answer is malformed whatever it says) but only an allow
    carries them into the Verdict. Anything else raises ``BadAnswer``, as does a line
    over ``MAX_ANSWER_LINE`` bytes.
    """
    if len(line) > MAX_ANSWER_LINE:
        raise BadAnswer(f"answer line over {MAX_ANSWER_LINE} bytes")
    try:
        doc = orjson.loads(line)
    except orjson.JSONDecodeError as ex:
        raise BadAnswer(f"not JSON ({ex})") from None
    if not isinstance(doc, dict):
        raise BadAnswer("not a JSON object")
    request_id = doc.get("id")
    # type() is: a JSON true is a Python bool, which isinstance(..., int) accepts.
    if type(request_id) is not int:
        raise BadAnswer('"id" is missing or not an integer')
    verdict = doc.get("verdict")
    if verdict != "allow" and verdict != "deny":
        raise BadAnswer('"verdict" is not "allow" or "deny"', request_id)
    principal_key = doc.get("principal_key")
    if principal_key is not None and (type(principal_key) is not str or not principal_key):
        raise BadAnswer('"principal_key" is not a non-empty string', request_id)
    labels = doc.get("labels")
    if labels is not None:
        if type(labels) is not dict:
            raise BadAnswer('"labels" is not an object', request_id)
        for key, value in labels.items():
            if not key or type(value) is not str:
                raise BadAnswer('"labels" must map non-empty names to strings', request_id)
    if verdict == "deny":
        return request_id, DENY
    if principal_key is None and not labels:
        return request_id, ALLOW
    return request_id, Verdict(allow=True, principal_key=principal_key, labels=labels or None)


class _HookConnection(asyncio.Protocol):
    """One connection to the hook: splits the byte stream into answer lines."""

    def __init__(self, client: FlowHookClient) -> None:
        self._client = client
        self._partial = bytearray()
        # Inside an over-long line: drop bytes up to its newline.
        self._skipping = False

    def data_received(self, data: bytes) -> None:
        client = self._client
        start = 0
        if self._skipping or self._partial:
            end = data.find(b"\n")
            if end < 0:
                if not self._skipping:
                    self._partial += data
                    if len(self._partial) > MAX_ANSWER_LINE:
                        self._partial.clear()
                        self._skipping = True
                        client._over_long_line()
                return
            if self._skipping:
                self._skipping = False
            else:
                self._partial += data[:end]
                line = bytes(self._partial)
                self._partial.clear()
                client._on_line(line)
            start = end + 1
        # The common case: whole lines in one read, split without copying the buffer.
        view = memoryview(data)
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                break
            client._on_line(view[start:end])
            start = end + 1
        rest = len(data) - start
        if rest > MAX_ANSWER_LINE:
            self._skipping = True
            client._over_long_line()
        elif rest:
            self._partial += view[start:]

    def eof_received(self) -> bool:
        # The hook closed its side: we close ours too (connection_lost follows).
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._client._on_connection_lost(self, exc)


def _describe(ex: BaseException) -> str:
    if isinstance(ex, TimeoutError):
        return "connect timed out"
    if isinstance(ex, OSError) and ex.strerror:
        return ex.strerror
    return str(ex) or type(ex).__name__


class FlowHookClient:
    """One persistent, pipelined connection to the hook process at ``settings.path``.

    ``loop`` is the loop the client lives on; every method except ``close`` is called
    on its thread (the constructor may run anywhere: it touches no loop). ``warn`` is
    called on that thread with a human-readable message once at the start of each
    outage; it should emit ``engine.warning`` with code ``WARNING_CODE``.

    Connects on the first ask; after the connection drops, reconnects on the next ask
    (at once if the lost connection had answered, else after a backoff doubling from
    ``backoff_initial_s`` to ``backoff_max_s`` with each failed attempt). Asks made
    while waiting out a backoff fail open at once. ``max_write_buffer`` bounds the
    requests held for a hook that does not read.
    """

    def __init__(
        self,
        settings: HookSettings,
        loop: asyncio.AbstractEventLoop,
        warn: Callable[[str], None],
        *,
        max_write_buffer: int = MAX_WRITE_BUFFER,
        backoff_initial_s: float = BACKOFF_INITIAL_S,
        backoff_max_s: float = BACKOFF_MAX_S,
    ) -> None:
        self.settings = settings
        self._loop = loop
        self._warn = warn
        self._timeout_s = settings.timeout_ms / 1000
        self._max_write_buffer = max_write_buffer
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._ids = itertools.count(1)
        #: Outstanding requests: id -> (future the ask awaits, its timeout timer).
        self._waiters: dict[int, tuple[asyncio.Future[Verdict], asyncio.TimerHandle]] = {}
        self._transport: asyncio.Transport | None = None
        self._protocol: _HookConnection | None = None
        self._sock: socket.socket | None = None
        self._connecting: asyncio.Task[None] | None = None
        #: Requests made while connecting, written once connected: (id, line).
        self._backlog: list[tuple[int, bytes]] = []
        self._backlog_bytes = 0
        self._retry_at = 0.0
        self._backoff_s = backoff_initial_s
        self._last_error = ""
        self._answered_here = False
        self._in_outage = False
        self._closed = False
        self._shut_down = threading.Event()
        self._asked = 0
        self._allowed = 0
        self._denied = 0
        self._failed_open = 0
        self._late_answers = 0
        self._bad_answers = 0

    # -- asking ----------------------------------------------------------------------

    async def ask(self, record: FlowRecord) -> Verdict:
        """The hook's verdict on a new flow (``record``: its FlowRecord, state opening).

        Never raises for the hook's faults: every failure is an allow verdict with
        ``failed_open`` set. Cancelling the awaiting task withdraws the request (a
        later answer to it counts as late).
        """
        self._asked += 1
        if self._closed:
            return self._fail(CLOSED)
        transport = self._transport
        if transport is None and self._connecting is None:
            if self._loop.time() < self._retry_at:
                # Waiting out a backoff: no flow should wait timeout_ms for a hook we
                # know is gone.
                return self._fail(UNREACHABLE, self._unreachable_message())
            self._connecting = self._loop.create_task(self._connect())
        request_id = next(self._ids)
        try:
            line = orjson.dumps(
                {"id": request_id, "flow": record}, option=orjson.OPT_APPEND_NEWLINE
            )
        except orjson.JSONEncodeError:
            # The engine's fault, not the hook's: fail open without an outage warning.
            logger.exception("flow hook: cannot encode the flow record")
            return self._fail(UNENCODABLE)
        if transport is not None:
            if transport.is_closing():
                # connection_lost is on its way; a write now would vanish.
                return self._fail(DISCONNECTED, self._unreachable_message())
            unsent = transport.get_write_buffer_size()
            if unsent + len(line) > self._max_write_buffer:
                return self._fail(
                    BACKPRESSURE,
                    f"{self._where()} is not reading its requests ({unsent} bytes unsent)",
                )
            transport.write(line)
        else:
            if self._backlog_bytes + len(line) > self._max_write_buffer:
                return self._fail(
                    BACKPRESSURE,
                    f"{self._where()} is still being connected to, with "
                    f"{self._backlog_bytes} bytes of requests waiting",
                )
            self._backlog.append((request_id, line))
            self._backlog_bytes += len(line)
        future: asyncio.Future[Verdict] = self._loop.create_future()
        timer = self._loop.call_later(self._timeout_s, self._expire, request_id)
        self._waiters[request_id] = (future, timer)
        try:
            return await future
        except asyncio.CancelledError:
            entry = self._waiters.pop(request_id, None)
            if entry is not None:
                entry[1].cancel()
            raise

    def counters(self) -> dict[str, int]:
        """Asks, real allow and deny answers, fail-opens, answers to unknown or expired
        ids, and lines that were not valid answers, since the client was made."""
        return {
            "asked": self._asked,
            "allowed": self._allowed,
            "denied": self._denied,
            "failed_open": self._failed_open,
            "late_answers": self._late_answers,
            "bad_answers": self._bad_answers,
        }

    @property
    def pending(self) -> int:
        """Asks waiting for their answer now (each settles within ``timeout_ms``)."""
        return len(self._waiters)

    @property
    def connected(self) -> bool:
        """Whether a connection to the hook is open now."""
        return self._transport is not None and not self._transport.is_closing()

    # -- closing ---------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection and fail open every outstanding ask; later asks fail open
        with reason ``closed``. Callable from any thread; from outside the loop thread it
        returns once the loop has done it (at most 2 s, should the loop be stuck)."""
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._shutdown()
            return
        if self._loop.is_closed():
            self._shutdown_without_loop()
            return
        if self._loop.is_running():
            try:
                self._loop.call_soon_threadsafe(self._shutdown)
            except RuntimeError:  # closed between the checks
                self._shutdown_without_loop()
                return
            self._shut_down.wait(2.0)
            return
        # A loop that is not running cannot race with us; a later run finishes the close.
        self._shutdown()

    async def aclose(self) -> None:
        """``close`` from the loop thread, returning once the socket is closed."""
        connecting = self._connecting
        self._shutdown()
        if connecting is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await connecting
        done = self._loop.create_future()
        # Queued behind the transport's own connection_lost call, which closes the socket.
        self._loop.call_soon(done.set_result, None)
        await done

    def _shutdown(self) -> None:
        if self._closed:
            self._loop.call_soon(self._shut_down.set)
            return
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
            self._connecting = None
        transport = self._transport
        self._transport = self._protocol = self._sock = None
        if transport is not None:
            transport.abort()
        self._backlog.clear()
        self._backlog_bytes = 0
        # Closing is the engine's doing (stop, or the hook removed from the config): no
        # outage, no warning.
        self._fail_all(CLOSED, None)
        # FIFO: runs after the transport's connection_lost, i.e. once the socket is closed.
        self._loop.call_soon(self._shut_down.set)

    def _shutdown_without_loop(self) -> None:
        # The loop is gone: no callback can run, nobody awaits the futures any more.
        self._closed = True
        if self._sock is not None:
            self._sock.close()
        self._transport = self._protocol = self._sock = self._connecting = None
        self._waiters.clear()
        self._backlog.clear()
        self._shut_down.set()

    # -- connection ------------------------------------------------------------------

    async def _connect(self) -> None:
        path = self.settings.path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            # Bounded: a Unix connect to a full backlog can hang; the asks waiting on it
            # time out on their own timers meanwhile.
            async with asyncio.timeout(self._timeout_s):
                await self._loop.sock_connect(sock, path)
                transport, protocol = await self._loop.create_unix_connection(
                    lambda: _HookConnection(self), sock=sock
                )
        except (OSError, ValueError) as ex:
            sock.close()
            self._connecting = None
            self._connect_failed(_describe(ex))
            return
        except asyncio.CancelledError:
            sock.close()
            raise
        self._connecting = None
        self._transport = transport
        self._protocol = protocol
        self._sock = sock
        self._answered_here = False
        backlog = self._backlog
        self._backlog = []
        self._backlog_bytes = 0
        # Requests that timed out while connecting are not sent: their answers would
        # only be counted late.
        pending = [line for request_id, line in backlog if request_id in self._waiters]
        if pending:
            transport.write(b"".join(pending))

    def _connect_failed(self, error: str) -> None:
        self._last_error = f"cannot connect: {error}"
        self._retry_at = self._loop.time() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self._backoff_max_s)
        self._backlog.clear()
        self._backlog_bytes = 0
        self._fail_all(UNREACHABLE, self._unreachable_message())

    def _on_connection_lost(self, protocol: _HookConnection, exc: Exception | None) -> None:
        if protocol is not self._protocol:
            return  # a connection already given up (close, or replaced)
        self._transport = self._protocol = self._sock = None
        self._last_error = (
            f"connection lost: {_describe(exc)}" if exc else "the hook closed the connection"
        )
        if self._answered_here:
            # A working hook went away (restart?): try again at the next ask.
            self._retry_at = 0.0
        else:
            # It accepted but never answered: back off as for a failed connect, so a
            # hook that accepts and closes at once is not hammered.
            self._retry_at = self._loop.time() + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, self._backoff_max_s)
        self._fail_all(DISCONNECTED, self._unreachable_message())

    # -- answers -----------------------------------------------------------------------

    def _on_line(self, line: bytes | memoryview) -> None:
        if len(line) < 2 and not bytes(line).strip():
            return  # an empty line is tolerated (a keep-alive, the end of a CRLF)
        try:
            request_id, verdict = parse_answer(line)
        except BadAnswer as ex:
            self._bad_answers += 1
            logger.debug("flow hook: bad answer: %s", ex)
            entry = self._waiters.pop(ex.request_id, None) if ex.request_id is not None else None
            if entry is not None:
                entry[1].cancel()
                self._settle(entry[0], BAD_ANSWER, f"{self._where()} answered badly: {ex}")
            # Without a readable id the line fails nothing now: the request it was meant
            # for times out (and warns then). The connection stays: good answers on it
            # still count.
            return
        entry = self._waiters.pop(request_id, None)
        if entry is None:
            self._late_answers += 1
            return
        future, timer = entry
        timer.cancel()
        # Only an answer in time ends an outage: a hook whose every answer is late must
        # not warn once per flow.
        self._in_outage = False
        self._answered_here = True
        self._backoff_s = self._backoff_initial_s
        if future.done():
            return  # its ask was cancelled this very iteration
        if verdict.allow:
            self._allowed += 1
        else:
            self._denied += 1
        future.set_result(verdict)

    def _over_long_line(self) -> None:
        self._bad_answers += 1
        logger.debug("flow hook: skipped an answer line over %d bytes", MAX_ANSWER_LINE)

    def _expire(self, request_id: int) -> None:
        entry = self._waiters.pop(request_id, None)
        if entry is not None:
            self._settle(
                entry[0],
                TIMEOUT,
                f"{self._where()} did not answer within {self.settings.timeout_ms} ms",
            )

    # -- failing open ----------------------------------------------------------------

    def _fail(self, reason: str, outage: str | None = None) -> Verdict:
        self._failed_open += 1
        if outage is not None:
            self._outage(outage)
        return _FAIL_OPEN[reason]

    def _settle(self, future: asyncio.Future[Verdict], reason: str, outage: str | None) -> None:
        if not future.done():
            future.set_result(self._fail(reason, outage))

    def _fail_all(self, reason: str, outage: str | None) -> None:
        waiters = self._waiters
        if not waiters:
            return
        self._waiters = {}
        for future, timer in waiters.values():
            timer.cancel()
            self._settle(future, reason, outage)

    def _outage(self, message: str) -> None:
        if self._in_outage:
            return
        self._in_outage = True
        try:
            self._warn(f"{message}; flows are allowed without the hook until it answers again")
        except Exception:
            # The warning is a report; its failure must not fail the flow.
            logger.exception("flow hook: the warn callback failed")

    def _where(self) -> str:
        return f"flow hook {self.settings.path}"

    def _unreachable_message(self) -> str:
        return f"{self._where()} is unreachable ({self._last_error})"


async def ask_about(hook: FlowHookClient, state: FlowState) -> bool:
    """Ask ``hook`` about a new flow (its record at revision 1, opening, as flow.started
    will carry it) and write an allow's principal and labels into ``state``; False when
    the hook denied it."""
    record = state.render()
    record["revision"] = 1
    verdict = await hook.ask(record)
    if verdict.principal_key is not None:
        state.principal_key = verdict.principal_key
    if verdict.labels:
        state.labels = verdict.labels
    return verdict.allow
