"""The local IPC control socket: newline-delimited JSON on a Unix socket (docs/ipc.md).

A frame is one JSON object on one line, at most 16 MiB.  A query is
``{"id": 1, "<query>": {params}}``, a command ``{"id": 2, "command": {"method": ...,
"params": {...}}}``, a subscription ``{"id": 3, "type": "subscribe", "events": [...]}``.
Each reply is the HTTP API's envelope with ``result`` wrapped in one key naming the
variant (``{"health": {...}}``, ``{"command": {...}}``, ``{"subscribed": {...}}``) and
the request's ``id``, so requests may be pipelined.  After the subscribe ACK come
``flow.snapshot`` (when flow types are included) and then one envelope per line; no
history.  Whoever can open the socket (mode 0600) is ``admin``.

Threads: one accepts; each connection has a reader (frames, answered in order) and a
writer draining the connection's bounded queue, plus, once subscribed, a pump from
its subscription to that queue.  A client that stops reading fills only its own
queue and then its subscription's bound (``overflowed``), at which point the
connection is closed: the engine never waits on a client.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import queue
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson

from spliceway.api.app import body_request_id, envelope_error, envelope_ok
from spliceway.api.plane import ControlPlane
from spliceway.control import queries
from spliceway.errors import ApiError, invalid_argument
from spliceway.events.catalogue import EVENT_CATALOGUE
from spliceway.events.log import Envelope, Subscription, normalize_types, parse_types
from spliceway.support.fdlimit import WARNING_CODE as FD_WARNING
from spliceway.support.fdlimit import AcceptBackoff

logger = logging.getLogger(__name__)

MAX_FRAME = 16 << 20
#: Writes queued for one connection's writer: replies, and batches of at most
#: BATCH events, so a connection holds at most OUT_QUEUE * BATCH events beyond its
#: subscription's own bound.
OUT_QUEUE = 64
BATCH = 64
#: Events a subscription may hold unread before the connection is dropped.
MAX_PENDING = 16384
MAX_CONNECTIONS = 64
_READ = 1 << 16
_JOIN_S = 5.0
_SEND_S = 30
#: The lock file beside the socket (``<path>.lock``), see :class:`PathLock`.
LOCK_SUFFIX = ".lock"


def _connector_state(plane: ControlPlane) -> dict[str, Any]:
    return plane.connector_state()


#: Queries only IPC answers (an extension, docs/ipc.md), for the CLI on the same host:
#: ``connector_state`` is ``spliceway connector state`` of the engine holding the outbox.
IPC_QUERIES: dict[str, Callable[[ControlPlane], dict[str, Any]]] = {
    "connector_state": _connector_state,
}


def _conflict(message: str) -> ApiError:
    return ApiError("conflict", message, field_path="api.ipc.path")


class PathLock:
    """The exclusive ``flock`` an engine holds on ``<socket path>.lock`` for as long as it
    serves the socket: two engines starting at once on one path never both probe,
    remove and bind it. The lock file holds the holder's pid."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def take(cls, socket_path: str) -> PathLock:
        """Lock ``socket_path``; ``conflict`` naming it when another engine holds it."""
        path = socket_path + LOCK_SUFFIX
        # A stopping engine unlinks the file before it lets go of the lock: a lock taken
        # on a file no longer at the path is nobody's, so open the path again.
        for _ in range(16):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError as ex:
                raise _conflict(f"IPC lock file {path}: {ex.strerror or ex}") from ex
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as ex:
                holder = _read_pid(fd)
                os.close(fd)
                if ex.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise _conflict(
                        f"IPC socket {socket_path} is in use by another running engine "
                        f"(pid {holder} holds {path})"
                    ) from None
                raise _conflict(f"IPC lock file {path}: {ex.strerror or ex}") from ex
            try:
                ours = _same_file(os.fstat(fd), os.stat(path, follow_symlinks=False))
            except FileNotFoundError:
                ours = False
            except OSError as ex:
                os.close(fd)
                raise _conflict(f"IPC lock file {path}: {ex.strerror or ex}") from ex
            if ours:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return cls(path, fd)
            os.close(fd)
        raise _conflict(f"IPC lock file {path} keeps being replaced; is another engine starting?")

    def release(self) -> None:
        """Remove the lock file (still holding the lock), then let go of it."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            with contextlib.suppress(OSError):
                if _same_file(os.fstat(fd), os.stat(self.path, follow_symlinks=False)):
                    os.unlink(self.path)
        finally:
            os.close(fd)


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _read_pid(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
    except OSError:
        return "?"


def prepare_path(path: str, private_dir: bool) -> PathLock:
    """Make the socket's directory, lock the path and remove a stale socket at it.

    ``private_dir`` (the default path's directory, in a shared place like /tmp): it
    must be a real directory of this user with no group or other access, else
    another user could have made it to put their socket in our clients' way.
    Returns the path's lock (see :class:`PathLock`), held until released; the caller
    releases it once it no longer serves the socket.
    ``conflict`` when an engine holds or listens at ``path``, or when the path cannot be
    used.
    """
    parent = os.path.dirname(path) or "."
    try:
        os.makedirs(parent, mode=0o700, exist_ok=True)
        st = os.lstat(parent)
    except OSError as ex:
        raise _conflict(f"IPC directory {parent}: {ex.strerror or ex}") from ex
    if private_dir and (
        not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077
    ):
        raise _conflict(f"IPC directory {parent} must be a directory of this user with mode 0700")
    lock = PathLock.take(path)
    try:
        _remove_stale(path)
    except BaseException:
        lock.release()
        raise
    return lock


def _remove_stale(path: str) -> None:
    """Remove a socket nobody listens on (left by an engine that died); the path's lock is
    held, so no other engine is between its probe and its bind."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as ex:
        raise _conflict(f"IPC path {path}: {ex.strerror or ex}") from ex
    if not stat.S_ISSOCK(st.st_mode):
        raise _conflict(f"IPC path {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        # Nobody listens: left behind by an engine that died.
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as ex:
            raise _conflict(f"IPC socket {path} cannot be removed: {ex.strerror or ex}") from ex
        return
    except OSError as ex:
        raise _conflict(f"IPC socket {path} cannot be checked: {ex.strerror or ex}") from ex
    finally:
        probe.close()
    raise _conflict(f"IPC socket {path} is in use by another running engine")


def _too_large() -> ApiError:
    return invalid_argument(f"frame larger than {MAX_FRAME} bytes (its newline not counted)")


def event_list(events: object) -> list[str] | None:
    """A subscription's ``events`` field (IPC frame, gRPC request) as an allow-list;
    None, empty or ``"*"``: every type. Anything but a list of known event types is
    ``invalid_argument`` on ``events`` (not on the HTTP query's ``types``)."""
    if events is None:
        return None
    if not (isinstance(events, list) and all(isinstance(e, str) for e in events)):
        raise invalid_argument("events must be a list of event types", "events")
    unknown = [e for e in events if e != "*" and e not in EVENT_CATALOGUE]
    if unknown:
        raise invalid_argument(f"unknown event type {unknown[0]!r}", "events")
    return parse_types(",".join(events)) if events else None


class IpcServer:
    """The control socket of one running engine."""

    def __init__(
        self,
        plane: ControlPlane,
        path: str,
        max_pending: int = MAX_PENDING,
        out_queue: int = OUT_QUEUE,
        private_dir: bool = False,
    ) -> None:
        self._plane = plane
        self.path = path
        self._max_pending = max_pending
        self._out_queue = out_queue
        self._lock = threading.Lock()
        self._conns: set[_Connection] = set()
        self._closing = False
        #: Held while an ipc.connected/ipc.disconnected is decided and emitted; ``_quiet``
        #: (set under it when the engine stops) ends them, so none follows engine.stopped.
        self._emit_lock = threading.Lock()
        self._quiet = False
        self._lock_file = prepare_path(path, private_dir)
        try:
            self._sock, self._identity = self._bind(path)
        except BaseException:
            self._lock_file.release()
            raise
        self._thread = threading.Thread(target=self._accept, name="spliceway-ipc", daemon=True)

    @staticmethod
    def _bind(path: str) -> tuple[socket.socket, tuple[int, int]]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # The mode the socket file is created with (Linux takes it from the socket's
            # inode): never a moment with wider permissions than 0600.
            os.fchmod(sock.fileno(), 0o600)
            sock.bind(path)
            os.chmod(path, 0o600)
            sock.listen(64)
            st = os.stat(path)
        except OSError as ex:
            sock.close()
            raise _conflict(
                f"IPC socket {path}: {os.strerror(ex.errno) if ex.errno else ex}"
            ) from ex
        return sock, (st.st_dev, st.st_ino)

    def start(self) -> None:
        """Start accepting."""
        self._thread.start()

    def stop_accepting(self) -> None:
        """Close the listening socket and remove its file (if it is still ours)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._silence()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        if self._thread.ident is not None:  # started
            self._thread.join(_JOIN_S)
        with contextlib.suppress(OSError):
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._identity:
                os.unlink(self.path)
        # The socket file is gone before the lock: the next engine finds no socket.
        self._lock_file.release()

    def stop(self) -> None:
        """Stop accepting, close every connection and join their threads."""
        self.stop_accepting()
        with self._lock:
            conns = list(self._conns)
        deadline = time.monotonic() + _JOIN_S
        for conn in conns:
            conn.wind_down(deadline)
        for conn in conns:
            conn.cut_off_at(deadline)
        for conn in conns:
            conn.join()

    def _silence(self) -> None:
        """No ipc.connected/ipc.disconnected from now on (the engine stops, and its last
        event is engine.stopped); returns once none is being emitted."""
        with self._emit_lock:
            self._quiet = True

    def _emit(self, event_type: str, payload: dict[str, Any]) -> None:
        with self._emit_lock:
            # A stop that began elsewhere (the core's own) silences us as well.
            if self._quiet or not self._plane.running:
                return
            self._plane.log.emit(event_type, payload)

    @property
    def active(self) -> int:
        """Open connections."""
        with self._lock:
            return len(self._conns)

    def _accept(self) -> None:
        # Out of descriptors, the pending connection stays queued and accept fails at
        # once again: pause with a growing delay and say so once (docs/running.md).
        backoff = AcceptBackoff(
            f"IPC socket {self.path}",
            lambda message: self._emit("engine.warning", {"code": FD_WARNING, "message": message}),
        )
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError as ex:
                if self._closing:
                    return  # the listening socket was closed
                delay = backoff.failed(ex.errno)
                if not delay:
                    logger.warning("IPC accept failed: %s", ex)
                    delay = 0.1
                # In slices, so a stop is not kept waiting for a whole pause.
                deadline = time.monotonic() + delay
                while not self._closing and (left := deadline - time.monotonic()) > 0:
                    time.sleep(min(left, 0.05))
                continue
            backoff.accepted()
            with self._lock:
                if self._closing or len(self._conns) >= MAX_CONNECTIONS:
                    refused = True
                else:
                    refused = False
                    conn = _Connection(self, client)
                    self._conns.add(conn)
                    active = len(self._conns)
            if refused:
                error = (
                    ApiError("conflict", "the engine is stopping")
                    if self._closing
                    else ApiError("rate_limited", f"at most {MAX_CONNECTIONS} IPC connections")
                )
                with contextlib.suppress(OSError):
                    client.sendall(envelope_error(error) + b"\n")
                client.close()
                continue
            self._emit("ipc.connected", {"active": active, "pipe": conn.peer})
            conn.start()

    def _closed(self, conn: _Connection, error: str | None) -> None:
        with self._lock:
            self._conns.discard(conn)
            active = len(self._conns)
        payload: dict[str, Any] = {"active": active, "pipe": conn.peer}
        if error is not None:
            payload["error"] = error
        self._emit("ipc.disconnected", payload)  # never after engine.stopped


class _Connection:
    """One client: a reader answering frames in order, a writer, maybe a pump."""

    def __init__(self, server: IpcServer, sock: socket.socket) -> None:
        self._server = server
        self._plane = server._plane
        self._sock = sock
        # A write that cannot progress for this long (a client that stopped reading
        # with a reply in flight) ends the connection instead of holding its writer.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", _SEND_S, 0))
        try:
            peer = sock.getpeername()
        except OSError:
            peer = ""
        self.peer = peer if isinstance(peer, str) else str(peer)
        self._out: queue.Queue[bytes | None] = queue.Queue(server._out_queue)
        self._sub: Subscription | None = None
        self._error: str | None = None
        self._done = threading.Event()
        self._once = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="spliceway-ipc-r", daemon=True)
        self._writer = threading.Thread(target=self._write, name="spliceway-ipc-w", daemon=True)
        self._pump: threading.Thread | None = None

    def start(self) -> None:
        self._writer.start()
        self._reader.start()

    def join(self) -> None:
        for thread in (self._reader, self._writer, self._pump):
            if thread is not None and thread is not threading.current_thread():
                thread.join(_JOIN_S)

    def close(self, *, flush: bool = False, error: str | None = None) -> None:
        """End the connection; ``flush`` lets the writer send what is queued first."""
        if error is not None and self._error is None:
            self._error = error
        if self._sub is not None:
            self._sub.close()
        if flush:
            try:
                # A client that stopped reading gets a second to take what is queued.
                self._out.put(None, timeout=1.0)
                return
            except queue.Full:
                pass
        self._shutdown()

    def wind_down(self, deadline: float) -> None:
        """At stop: end the subscription (the engine's stop already did, engine.stopped
        last; this ends it when a failed start stops us), let the pump queue what it
        still has, then tell the writer to finish."""
        if self._sub is not None:
            self._sub.close()
        pump = self._pump
        if pump is not None:
            pump.join(max(0.0, deadline - time.monotonic()))
        self.finish_soon()

    def cut_off_at(self, deadline: float) -> None:
        """Wait for the writer until ``deadline``; a client that does not read (or never
        closes) is cut off then."""
        if not self._done.wait(max(0.0, deadline - time.monotonic())):
            self._shutdown()

    def finish_soon(self) -> None:
        """Let the writer send what is queued, then end (never blocks)."""
        try:
            self._out.put_nowait(None)
        except queue.Full:
            self._shutdown()

    def _shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def _put(self, data: bytes | None, give_up: Callable[[], bool] | None = None) -> bool:
        """Queue output; False once the connection is going away (or ``give_up()``).
        Blocks while the queue is full (only this connection's reader or pump waits)."""
        while not self._done.is_set():
            if give_up is not None and give_up():
                return False
            try:
                self._out.put(data, timeout=0.25)
                return True
            except queue.Full:
                continue
        return False

    # -- reader ---------------------------------------------------------------------

    def _read(self) -> None:
        buf = bytearray()
        skipping = False  # inside a frame over the limit: drop up to its newline
        try:
            while not self._done.is_set():
                chunk = self._sock.recv(_READ)
                if not chunk:
                    break
                start = len(buf)
                buf += chunk
                while True:
                    nl = buf.find(b"\n", start)
                    if nl < 0:
                        break
                    line = bytes(buf[:nl])
                    del buf[: nl + 1]
                    start = 0
                    if skipping:  # the end of a frame already refused
                        skipping = False
                        continue
                    if len(line) > MAX_FRAME:  # whole, but longer than a frame may be
                        self._reply_error(_too_large())
                    elif line.strip():
                        self._answer(line)
                if not skipping and len(buf) > MAX_FRAME:
                    # No newline yet and already too long: refused now, the rest skipped.
                    skipping = True
                    buf.clear()
                    self._reply_error(_too_large())
                elif skipping:
                    buf.clear()
        except OSError as ex:
            self._error = self._error or f"read failed: {ex.strerror or ex}"
        finally:
            self.close(flush=True)

    def _reply_error(self, error: ApiError, request_id: Any = None) -> None:
        self._put(envelope_error(error, request_id) + b"\n")

    def _answer(self, line: bytes) -> None:
        request_id: Any = None
        try:
            try:
                frame = orjson.loads(line)
            except orjson.JSONDecodeError as ex:
                raise invalid_argument(f"frame is not JSON: {ex}") from ex
            if not isinstance(frame, dict):
                raise invalid_argument("a frame must be a JSON object")
            request_id = body_request_id(frame)
            variant, result = self._run(frame)
        except ApiError as ex:
            self._reply_error(ex, request_id)
            return
        except Exception:
            logger.exception("IPC request failed")
            self._reply_error(ApiError("internal", "internal error"), request_id)
            return
        self._put(envelope_ok({variant: result}, request_id) + b"\n")
        if variant == "subscribed":
            self._start_pump()

    def _run(self, frame: dict[str, Any]) -> tuple[str, Any]:
        keys = [k for k in frame if k != "id"]
        if frame.get("type") == "subscribe":
            if set(keys) - {"type", "events"}:
                raise invalid_argument(f"unknown field in a subscribe frame: {sorted(keys)}")
            return "subscribed", self._subscribe(frame.get("events"))
        if len(keys) != 1:
            raise invalid_argument(
                "a frame holds one request: a query name, 'command', or type 'subscribe'"
            )
        (name,) = keys
        body = frame[name]
        if name == "command":
            if not isinstance(body, dict):
                raise invalid_argument("command must be an object", "command")
            unknown = set(body) - {"method", "params"}
            if unknown:
                raise invalid_argument(f"unknown field {sorted(unknown)[0]!r}", "command")
            params = body.get("params", {})
            result = self._plane.execute(body.get("method"), params, transport="ipc")
            return "command", result
        if name not in queries.QUERIES and name not in IPC_QUERIES:
            raise invalid_argument(f"unknown request {name!r}", name)
        if not isinstance(body, dict):
            raise invalid_argument(f"{name} parameters must be an object", name)
        if name in IPC_QUERIES:
            queries.reject_unknown(body, (), f"query {name!r}")
            return name, IPC_QUERIES[name](self._plane)
        return name, self._plane.run_query(name, body)

    def _subscribe(self, events: object) -> dict[str, Any]:
        if self._sub is not None:
            raise ApiError("conflict", "this connection is already subscribed")
        types = normalize_types(event_list(events))
        self._sub = self._plane.log.subscribe(
            types, snapshot=self._plane.flow_records, max_pending=self._server._max_pending
        )
        return {"events": sorted(types) if types is not None else ["*"]}

    # -- pump and writer ----------------------------------------------------------------

    def _start_pump(self) -> None:
        pump = threading.Thread(target=self._forward, name="spliceway-ipc-s", daemon=True)
        pump.start()
        self._pump = pump  # only a started thread is ever joined

    def _forward(self) -> None:
        sub = self._sub
        assert sub is not None
        encoded: Callable[[Envelope], bytes] = self._plane.log.encoded

        def overflowed() -> bool:
            return sub.overflowed

        while not self._done.is_set() and not sub.overflowed:
            batch = sub.get_many(timeout=0.25, limit=BATCH)
            if batch:
                self._put(b"".join(encoded(e) + b"\n" for e in batch), overflowed)
                continue
            if sub.ended:
                final = sub.ended_by
                # engine.stopped ends every subscription, filter or not.
                if final is not None and not sub.accepts(final["event_type"]):
                    self._put(encoded(final) + b"\n")
                break
        if sub.overflowed:
            # No history on IPC to resume from: the client reconnects and resubscribes.
            self.close(error=f"fell more than {self._server._max_pending} events behind")

    def _write(self) -> None:
        try:
            while True:
                data = self._out.get()
                if data is None:
                    break
                self._sock.sendall(data)
        except OSError as ex:
            if self._error is None:
                self._error = f"write failed: {ex.strerror or ex}"
        finally:
            self._finish()

    def _finish(self) -> None:
        with self._once:
            if self._done.is_set():
                return
            self._done.set()
        if self._sub is not None:
            self._sub.close()
        self._shutdown()
        self._sock.close()
        self._server._closed(self, self._error)
