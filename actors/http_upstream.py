"""One forwarded request's exchange with its upstream: the request up, the response down.

The byte-moving half of :class:`~spliceway.actors.http_forward.HttpForwarding` (the
http inbound's absolute-URI forwarding): the upstream connection a client connection's
requests share (:class:`_Upstream`, sealed and opened here for shadowsocks), the request
head and body sent up, the response's interim and final heads and its body relayed down
with exact counts, a 101's switch to the C relay, and the memos that spare re-parsing a
head whose bytes repeat the previous one. :class:`HttpExchange` is a mixin of
:class:`~spliceway.actors.flow.FlowActor` through HttpForwarding.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import TYPE_CHECKING, Any

from spliceway.engine.runtime import FlowEntry
from spliceway.flows import records
from spliceway.flows.inbound import ForwardRequest
from spliceway.flows.machine import Ended, Event, Failed, FlowMachine
from spliceway.protocols import NEED_MORE, NeedMore, ProtocolError, shadowsocks
from spliceway.protocols import http as http_proto
from spliceway.protocols import http_message as framing

if TYPE_CHECKING:
    from spliceway.flows.outbounds import Dialed as DialResult


#: Largest read from either socket.
_CHUNK = 64 * 1024

#: What the client connection does after a request's flow.
_KEEP, _CLOSE, _TUNNEL = range(3)


class _ClientGone(Exception):
    """Writing to the client failed: it went away mid-response."""


class _UpstreamFailed(Exception):
    """The upstream failed a request (HttpExchange._upstream_failed answers it).

    ``answered``: the client already had bytes of a response (an interim one, or part of
    the final one), so it gets no 502."""

    def __init__(self, message: str, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered


class _Upstream:
    """An upstream connection a client connection's requests may share.

    Pooled per client connection, never across clients: a later request reuses it when
    it goes to the same outbound and target and the previous response left it usable.
    For a shadowsocks outbound the bytes are sealed and opened here, in Python.
    """

    __slots__ = (
        "chained",
        "key",
        "opener",
        "pending",
        "relay_chain",
        "remote_host",
        "remote_port",
        "resolved_ip",
        "sealer",
        "sock",
    )

    def __init__(
        self, dialed: DialResult, key: tuple[str, str, int, str | None], chained: bool
    ) -> None:
        self.sock = dialed.sock
        self.key = key
        self.chained = chained
        self.remote_host = dialed.remote_host
        self.remote_port = dialed.remote_port
        self.resolved_ip = dialed.resolved_ip
        self.relay_chain = list(dialed.relay_chain)
        #: Response bytes already read (an upstream proxy's leftover after its handshake).
        self.pending = dialed.leftover
        sealed = dialed.sealed
        self.sealer = sealed.encryptor if sealed is not None else None
        self.opener = (
            shadowsocks.Decryptor(shadowsocks.CIPHERS[sealed.cipher], sealed.master_key)
            if sealed is not None
            else None
        )

    def usable(self) -> bool:
        """Still open with nothing unread (a server that closed a kept connection shows
        its EOF here, before a request is wasted on it)."""
        try:
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            return False
        # Bytes nobody asked for, or the end: either way not for another request.
        return False


class _RequestMemo:
    """A client connection's previous request head, as bytes and as parsed.

    Parsing a head is a pure function of its bytes (and of the inbound's users, which is
    why no memo is kept when users are required): a next request whose head is the same
    bytes (a client fetching again, a poll, a benchmark) gets the same RequestHead and
    ForwardRequest, and the same origin-form heads, without the reference parser's
    ~30 us per request. Anything else is parsed as before.
    """

    __slots__ = ("raw", "request", "wires")

    def __init__(self, raw: bytes, request: ForwardRequest) -> None:
        self.raw = raw
        self.request = request
        #: origin_request()'s bytes by its ``connection`` argument.
        self.wires: dict[str, bytes] = {}


class _ResponseMemo:
    """The previous final response head from the upstream, as bytes and as judged.

    As _RequestMemo: the same head bytes to the same request method give the same parse,
    framing and Connection tokens, and the same head for the client per ``connection``.
    """

    __slots__ = ("heads", "kind", "length", "method", "raw", "response", "tokens")

    def __init__(
        self,
        raw: bytes,
        method: str,
        response: http_proto.ResponseHead,
        kind: int,
        length: int,
        tokens: frozenset[str],
    ) -> None:
        self.raw = raw
        self.method = method
        self.response = response
        self.kind = kind
        self.length = length
        self.tokens = tokens
        #: proxy_response()'s bytes by its ``connection`` argument.
        self.heads: dict[str | None, bytes] = {}


class HttpExchange:
    """HttpForwarding's request/response exchange with the upstream (see the module
    docstring)."""

    # FlowActor's and HttpForwarding's, used here.
    deps: Any
    client: socket.socket | None
    upstream: socket.socket | None
    flow_id: str
    state: records.FlowState | None
    handle: int | None
    dispatcher: Any
    actor_ref: Any
    _base: records.Traffic | None
    machine: FlowMachine
    _fwd_buf: bytes
    _fwd_up: _Upstream | None
    _fwd_upload_failed: bool
    _fwd_memo: _RequestMemo | None
    _fwd_rmemo: _ResponseMemo | None

    if TYPE_CHECKING:
        # Methods of FlowActor and HttpForwarding this mixin calls: declared for the type
        # checker only, so a change of their signatures fails mypy here.
        async def _reply(self, data: bytes, *, quiet: bool = False) -> None: ...
        def _drop_upstream(self) -> None: ...
        def _dialled(self) -> bool: ...
        def _end(self, event: Event) -> None: ...

    # -- moving the bytes ------------------------------------------------------------

    async def _exchange(self, request: ForwardRequest, up: _Upstream) -> int:
        """The request to the upstream, its response to the client; the flow completes."""
        head = request.head
        # Shadowsocks upstreams are opened in Python here, a state the C relay cannot take
        # over: no protocol switch through them (the Upgrade is not forwarded).
        upgrade = request.upgrade and up.opener is None
        # HTTP/1.1 keeps the upstream connection by default; an HTTP/1.0 request is
        # forwarded as such, and asks for keep-alive on our hop when its client did.
        if upgrade:
            connection = "upgrade"
        elif head.version == "HTTP/1.0" and request.keep_alive:
            connection = "keep-alive"
        else:
            connection = ""
        memo = self._fwd_memo
        if memo is not None and memo.request is request:
            wire = memo.wires.get(connection)
            if wire is None:
                wire = memo.wires[connection] = http_proto.origin_request(
                    head, request.path, request.host_header, connection=connection
                )
        else:
            wire = http_proto.origin_request(
                head, request.path, request.host_header, connection=connection
            )
        body = framing.BodyFramer(request.body_kind, request.body_length)
        buf = self._fwd_buf
        taken = body.feed(buf)
        self._fwd_buf = buf[taken:]
        assert self.state is not None
        self.state.traffic.inbound_rx_bytes += taken
        self._fwd_upload_failed = False
        try:
            await self._up_send(up, wire + buf[:taken] if taken else wire)
        except OSError as ex:
            return await self._upstream_failed(f"upstream connection failed: {ex}", False)
        upload = None
        if not body.done:
            upload = self.dispatcher.loop.create_task(self._upload(up, body))
        try:
            return await self._download(request, up, upload, upgrade)
        except _ClientGone:
            self._drop_upstream()
            self._end(Ended(self._dialled()))
            return _CLOSE
        finally:
            if upload is not None and not upload.done():
                upload.cancel()

    async def _upload(self, up: _Upstream, body: framing.BodyFramer) -> None:
        """The rest of a request body, from the client as it arrives, to the upstream.

        On any failure the upstream's write side is shut: the origin sees the request
        end early and answers or closes, which ends the flow (and the connection)."""
        loop = self.dispatcher.loop
        client = self.client
        assert client is not None and self.state is not None
        t = self.state.traffic
        idle = self.deps.tcp_idle_timeout_ms / 1000
        try:
            while not body.done:
                data = await _recv(loop, client, idle)
                if not data:
                    raise EOFError("client closed mid-body")
                taken = body.feed(data)
                t.inbound_rx_bytes += taken
                if taken < len(data):
                    # Pipelined: the next request's head came right after this body.
                    self._fwd_buf = data[taken:]
                    data = data[:taken]
                await self._up_send(up, data)
        except (OSError, EOFError, TimeoutError, ProtocolError):
            self._fwd_upload_failed = True
            with contextlib.suppress(OSError):
                up.sock.shutdown(socket.SHUT_WR)

    async def _download(
        self,
        request: ForwardRequest,
        up: _Upstream,
        upload: asyncio.Task[None] | None,
        upgrade: bool,
    ) -> int:
        """Relay the upstream's response to the client; what the connection does next."""
        head = request.head
        try:
            final = await self._final_head(request, up, upgrade)
            if final is None:
                return _TUNNEL
            rmemo, buf, sent = final
            tokens = rmemo.tokens
            # The connection closes after a response the client can only see end by the
            # close, when either side asked for it, or when the request body is still on its
            # way (we could not tell where the next request starts).
            close = (
                not request.keep_alive
                or "close" in tokens
                or rmemo.kind == framing.CLOSE
                or (upload is not None and not upload.done())
                or self._fwd_upload_failed
            )
            reusable = (
                not close
                and (rmemo.response.version == "HTTP/1.1" or "keep-alive" in tokens)
                and not (request.upgrade and not upgrade)
            )
            connection = (
                "close" if close else ("keep-alive" if head.version == "HTTP/1.0" else None)
            )
            in_step = await self._download_body(up, rmemo, connection, buf, sent)
        except _UpstreamFailed as ex:
            return await self._upstream_failed(str(ex), ex.answered)
        # Bytes after the response: the upstream is out of step.
        reusable = reusable and in_step
        if upload is not None and not upload.done():
            upload.cancel()
            reusable = False
        if self._fwd_upload_failed:
            close = True
        if close or not reusable:
            self._drop_upstream()
        self._end(Ended(self._dialled()))
        return _CLOSE if close else _KEEP

    async def _final_head(
        self, request: ForwardRequest, up: _Upstream, upgrade: bool
    ) -> tuple[_ResponseMemo, bytes, bool] | None:
        """Read the upstream's final response head, passing interim ones to the client.

        Returns the head's memo (the previous one when the head bytes repeat it), the bytes
        read after the head, and whether the client has had an (interim) answer; None when
        the connection switched protocols (it is a tunnel now). Raises _UpstreamFailed."""
        head = request.head
        buf, up.pending = up.pending, b""
        sent = False
        method = head.method.upper()
        rmemo = self._fwd_rmemo
        response: http_proto.ResponseHead | NeedMore
        while True:
            if rmemo is not None and rmemo.method == method and buf.startswith(rmemo.raw):
                # The previous response's head bytes again (an origin's heads differ
                # mostly by Date, once a second): its parse, framing and tokens.
                response = rmemo.response
            elif not buf:
                response = NEED_MORE  # nothing read yet: nothing to parse
            else:
                rmemo = None
                try:
                    response = http_proto.parse_response_head(buf)
                except ProtocolError as ex:
                    raise _UpstreamFailed(f"upstream response: {ex}", sent) from ex
            if response is NEED_MORE:
                buf += await self._more_response(up, sent)
                continue
            raw, buf = buf[: response.consumed], buf[response.consumed :]
            if response.status == 101 and upgrade:
                await self._to_client(http_proto.proxy_response(response, "Upgrade"))
                await self._switch_protocols(up, buf)
                return None
            if response.status >= 200:
                break
            if response.status == 101:
                raise _UpstreamFailed("upstream switched protocols unasked", sent)
            # Interim (100 Continue, 103): passed on, except to an HTTP/1.0 client, which
            # does not know them (RFC 9110 15.2).
            if head.version != "HTTP/1.0":
                await self._to_client(http_proto.proxy_response(response, None))
                sent = True
        if rmemo is None:
            try:
                kind, length = framing.response_framing(response, method)
            except ProtocolError as ex:
                raise _UpstreamFailed(str(ex), sent) from ex
            tokens = framing.connection_tokens(response.headers, "Connection")
            rmemo = self._fwd_rmemo = _ResponseMemo(
                bytes(raw), method, response, kind, length, frozenset(tokens)
            )
        return rmemo, buf, sent

    async def _more_response(self, up: _Upstream, sent: bool) -> bytes:
        """The upstream's next bytes of a response head; _UpstreamFailed when none come."""
        try:
            data = await self._up_recv(up)
        except (OSError, TimeoutError, ProtocolError) as ex:
            raise _UpstreamFailed(
                f"upstream connection failed: {str(ex) or 'timed out'}", sent
            ) from ex
        if not data:
            raise _UpstreamFailed(
                "upstream closed the connection before its response was complete", sent
            )
        return data

    async def _download_body(
        self,
        up: _Upstream,
        rmemo: _ResponseMemo,
        connection: str | None,
        buf: bytes,
        sent: bool,
    ) -> bool:
        """Send the final head, then relay the body until its framing ends.

        True when the upstream stopped in step with the body (no bytes after it).
        Raises _UpstreamFailed."""
        body = framing.BodyFramer(rmemo.kind, rmemo.length)
        try:
            taken = body.feed(buf)
        except ProtocolError as ex:
            raise _UpstreamFailed(f"upstream response body: {ex}", sent) from ex
        in_step = taken >= len(buf)
        out = rmemo.heads.get(connection)
        if out is None:
            out = rmemo.heads[connection] = http_proto.proxy_response(rmemo.response, connection)
        await self._to_client(out + buf[:taken])
        while not body.done:
            try:
                data = await self._up_recv(up)
                if not data:
                    if body.at_eof():
                        break
                    raise _UpstreamFailed(
                        "upstream closed the connection mid-response; the response to the "
                        "client is cut short",
                        True,
                    )
                taken = body.feed(data)
            except (OSError, TimeoutError, ProtocolError) as ex:
                raise _UpstreamFailed(
                    f"upstream failed mid-response ({str(ex) or 'timed out'}); the response "
                    "to the client is cut short",
                    True,
                ) from ex
            if taken < len(data):
                in_step = False
            await self._to_client(data[:taken])
        return in_step

    async def _upstream_failed(self, message: str, answered: bool) -> int:
        """The upstream failed this request: a 502 if the client has no answer yet, the
        flow completes failed, and the connection closes (a cut response cannot be
        told from a whole one any other way)."""
        s = self.state
        assert s is not None
        self._drop_upstream()
        if not answered:
            await self._reply(http_proto.response(502, body=(message + "\n").encode()), quiet=True)
        failure = records.Failure(
            "relay", "upstream_error", message, {"host": s.remote_host, "port": s.remote_port}
        )
        self._end(Failed(failure))
        return _CLOSE

    async def _switch_protocols(self, up: _Upstream, down_early: bytes) -> None:
        """A 101: from here the connection is a tunnel the C relay runs, as a CONNECT's.
        Bytes either side already sent past the switch go first."""
        s = self.state
        assert s is not None and self.client is not None
        t = s.traffic
        if self._fwd_buf:
            await self._up_send(up, self._fwd_buf)
            t.inbound_rx_bytes += len(self._fwd_buf)
            self._fwd_buf = b""
        if down_early:
            await self._to_client(down_early)
        self._fwd_up = None
        self._base = t.copy(sealed=False)
        client_fd = self.client.detach()
        upstream_fd = up.sock.detach()
        self.client = self.upstream = None
        try:
            self.handle = self.deps.bridge.hand_off(
                client_fd, upstream_fd, self.deps.tcp_idle_timeout_ms, self.actor_ref, None
            )
        except OSError:
            for fd in (client_fd, upstream_fd):
                with contextlib.suppress(OSError):
                    socket.close(fd)
            raise
        # Listed with its relay handle, so samples and flows.close reach the relay.
        self.deps.flows.put(
            self.flow_id,
            FlowEntry(
                self.actor_ref, s.render(), s.inbound_tag, s.principal_key, self.handle, self._base
            ),
        )

    async def _up_send(self, up: _Upstream, data: bytes) -> None:
        """Request bytes to the upstream (sealed for shadowsocks), counted."""
        assert self.state is not None
        t = self.state.traffic
        wire = up.sealer.seal(data) if up.sealer is not None else data
        await _send(self.dispatcher.loop, up.sock, wire)
        t.bytes_up += len(data)
        t.outbound_tx_bytes += len(wire)

    async def _up_recv(self, up: _Upstream) -> bytes:
        """Response bytes from the upstream (opened for shadowsocks), counted; b"" at
        its end. A sealed read may open to nothing yet: read on until it does not."""
        assert self.state is not None
        t = self.state.traffic
        idle = self.deps.tcp_idle_timeout_ms / 1000
        while True:
            wire = await _recv(self.dispatcher.loop, up.sock, idle)
            t.outbound_rx_bytes += len(wire)
            if up.opener is None or not wire:
                return wire
            data = up.opener.feed(wire)
            if data:
                return data

    async def _to_client(self, data: bytes) -> None:
        """Response bytes to the client, counted; _ClientGone when it has gone."""
        assert self.state is not None and self.client is not None
        try:
            await _send(self.dispatcher.loop, self.client, data)
        except OSError as ex:
            raise _ClientGone(str(ex)) from ex
        t = self.state.traffic
        t.inbound_tx_bytes += len(data)
        t.bytes_down += len(data)


async def _send(loop: asyncio.AbstractEventLoop, sock: socket.socket, data: bytes) -> None:
    """All of ``data``: one send when the socket buffer takes it (the usual case for a
    head and a small body, without a coroutine), the loop's sendall for the rest."""
    try:
        n = sock.send(data)
    except (BlockingIOError, InterruptedError):
        n = 0
    if n < len(data):
        await loop.sock_sendall(sock, memoryview(data)[n:])


async def _recv(loop: asyncio.AbstractEventLoop, sock: socket.socket, timeout: float) -> bytes:
    """One read: at once when bytes are there (no timer), else within ``timeout``.

    A bare reader callback and one timer handle, not ``asyncio.timeout`` around
    ``loop.sock_recv``: that pair costs a Timeout context, a task and a reader handle
    per wait, and a forwarded request waits twice (its response, the next request),
    which made it a measurable share of the dispatcher's time per request. The reader
    is removed as soon as the wait ends (fired, timed out or cancelled), so no
    registration outlives the wait and closing the socket later is always safe.
    """
    try:
        return sock.recv(_CHUNK)
    except (BlockingIOError, InterruptedError):
        pass
    fd = sock.fileno()
    # One cell for the current wait's future: the timer fails whichever wait is current.
    cell = [loop.create_future()]
    loop.add_reader(fd, _ready, cell)
    timer = loop.call_later(timeout, _expire, cell)
    try:
        while True:
            await cell[0]
            try:
                return sock.recv(_CHUNK)
            except (BlockingIOError, InterruptedError):
                # Woken without bytes (spurious readiness): wait again, same deadline.
                cell[0] = loop.create_future()
    finally:
        timer.cancel()
        loop.remove_reader(fd)


def _ready(cell: list[asyncio.Future[None]]) -> None:
    if not cell[0].done():
        cell[0].set_result(None)


def _expire(cell: list[asyncio.Future[None]]) -> None:
    if not cell[0].done():
        cell[0].set_exception(TimeoutError())
