"""The http inbound's absolute-URI forwarding: one client connection, many requests.

A client that sends ``GET http://host/path HTTP/1.1`` to the proxy keeps its
connection for the next request (RFC 9112 9.3). Each request is a flow of its own:
routed by its own target, with its own flow.started / flow.routed / flow.completed
and exact byte counts, so a kept-alive connection to two hosts is two flows to two
routes, and a blocked second request is a blocked flow while the connection lives on.

Python frames the messages (:mod:`spliceway.protocols.http_message`) and moves the
bytes of a request and its response on the dispatcher loop (that half is
:mod:`spliceway.actors.http_upstream`'s); bodies are forwarded as
received, never re-encoded. Only a protocol switch (a 101 to an Upgrade) or a CONNECT
on the connection goes to the C relay, as the tunnel it then is.

This is a mixin of :class:`~spliceway.actors.flow.FlowActor`: the actor serves one
request's flow at a time, and between two requests it is a connection with no flow.
"""

from __future__ import annotations

import contextlib
import socket
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

from spliceway.actors.http_upstream import (
    _CLOSE,
    _KEEP,
    _TUNNEL,
    HttpExchange,
    _ClientGone,
    _recv,
    _RequestMemo,
    _Upstream,
)
from spliceway.flows import records
from spliceway.flows.hook import ask_about
from spliceway.flows.inbound import (
    PROXY_AUTH_REQUIRED,
    ForwardRequest,
    Handshake,
    forward_request,
    http_auth,
)
from spliceway.flows.machine import (
    Blocked,
    Closed,
    Dialed,
    Dialing,
    Ended,
    Event,
    Failed,
    FlowMachine,
    HookDenied,
    Relaying,
)
from spliceway.flows.outbounds import DialError
from spliceway.native import conn as connpath
from spliceway.protocols import NEED_MORE, ProtocolError
from spliceway.protocols import http as http_proto
from spliceway.protocols import http_message as framing
from spliceway.routing import hostnorm

if TYPE_CHECKING:
    from collections.abc import Coroutine

    from spliceway.flows.outbounds import Dialed as DialResult
    from spliceway.routing.rules import RouteDecision


class HttpForwarding(HttpExchange):
    """FlowActor's absolute-URI forwarding (see the module docstring); the bytes of each
    request's exchange are moved by :class:`~spliceway.actors.http_upstream.HttpExchange`."""

    # FlowActor's, used here (the rest are declared on HttpExchange).
    inbound: Any
    peer: tuple[Any, ...]

    if TYPE_CHECKING:
        # FlowActor's methods this mixin calls: declared for the type checker only, so
        # a change of their signatures in actors/flow.py fails mypy here.
        async def _establish(self, steps: Coroutine[Any, Any, None] | None = None) -> None: ...
        async def _tunnel_request(
            self, hs: Handshake, state: records.FlowState, replied: bool = False
        ) -> None: ...
        async def _decide(
            self, hs: Handshake, address: str | None = None
        ) -> tuple[RouteDecision, str | None]: ...
        async def _dial(self, outbound: Any, hs: Handshake, address: str | None) -> Any: ...
        def _new_state(self, hs: Handshake, started_at: int | None = None) -> records.FlowState: ...
        def _start_record(self, state: records.FlowState) -> None: ...
        async def _reply(self, data: bytes, *, quiet: bool = False) -> None: ...
        def _set_route(self, decision: RouteDecision, chain: list[str], outbound: Any) -> None: ...
        def _report_member_down(self, chain: list[str], error: str) -> None: ...
        def _dialled(self) -> bool: ...
        def _publish(
            self, event_type: str, payload_fn: Any, occurred: int | None = None
        ) -> None: ...
        def _end(self, event: Event) -> None: ...
        def _finish(self) -> None: ...

    # -- the connection ------------------------------------------------------------

    async def _serve_forward(
        self,
        hs: Handshake,
        state: records.FlowState,
        first: Coroutine[Any, Any, int] | None = None,
    ) -> None:
        """Serve requests on the client connection, one flow each, until it ends.

        ``first``: the first request's exchange already under way (a request C forwarded
        and handed over, see _take_over_forward) instead of starting it here."""
        if first is None:
            self._fwd_buf = hs.early
            self._fwd_up = None
            self._fwd_memo = None
            self._fwd_rmemo = None
        pid, pname, ppath = state.process_id, state.process_name, state.process_path
        while True:
            if first is not None:
                after, first = await first, None
            else:
                after = await self._forward_flow(hs, state)
            if after == _TUNNEL:
                return
            if after == _CLOSE:
                break
            following = await self._next_request()
            if following is None:
                break
            self._next_flow()
            hs = following
            state = self._new_state(hs)
            if pid is not None:
                state.set_process(pid, pname, ppath)
            if not hs.forward:
                # A CONNECT after forwarded requests: the connection becomes its tunnel.
                self._drop_upstream()
                await self._tunnel_request(hs, state)
                return
        self._finish()

    def _next_flow(self) -> None:
        """Forget the finished flow: the actor serves the next request's from here."""
        self.flow_id = self.deps.new_flow_id(self.inbound.index)
        self.state = None
        self.machine = FlowMachine()
        self._base = None
        self.handle = None

    async def _next_request(self) -> Handshake | None:
        """The next request on the connection, None when the client is done (it closed,
        went idle, or sent a head we answered with an error and the close)."""
        loop = self.dispatcher.loop
        client = self.client
        assert client is not None
        buf = self._fwd_buf
        memo = self._fwd_memo
        if memo is not None and self.inbound.users.required:
            memo = self._fwd_memo = None
        idle = self.deps.tcp_idle_timeout_ms / 1000
        while True:
            if memo is not None and buf.startswith(memo.raw):
                # The same head bytes as the previous request: the same parse, the same
                # answer (see _RequestMemo), without parsing them again.
                self._fwd_buf = buf[len(memo.raw) :]
                request = memo.request
                return Handshake(
                    "http",
                    request.host,
                    request.port,
                    None,
                    None,
                    len(memo.raw),
                    0,
                    forward=True,
                    request=request,
                )
            # Nothing buffered (a client waiting for each answer): nothing to parse yet.
            if buf:
                try:
                    head = http_proto.parse_request_head(buf)
                    if head is not NEED_MORE:
                        break
                except ProtocolError as ex:
                    await self._send_quietly(ex.reply)
                    return None
            try:
                data = await _recv(loop, client, idle)
            except (OSError, TimeoutError):
                return None
            if not data:
                return None
            buf += data
        raw = buf[: head.consumed]
        self._fwd_buf = buf[head.consumed :]
        principal, scheme, refused = http_auth(head, self.inbound.users)
        if refused is not None:
            # Checked on every request: credentials belong to a request, not a connection.
            await self._send_quietly(PROXY_AUTH_REQUIRED)
            return None
        try:
            if head.method.upper() == "CONNECT":
                host, port = http_proto.connect_authority(head.target)
                return Handshake(
                    "http", host, port, principal, scheme, head.consumed, 0, early=self._fwd_buf
                )
            request = forward_request(head)
        except ProtocolError as ex:
            await self._send_quietly(ex.reply)
            return None
        # Remembered only where the answer depends on the bytes alone: with users, the
        # credentials are checked on every request, against the users of that moment.
        self._fwd_memo = None if self.inbound.users.required else _RequestMemo(bytes(raw), request)
        return Handshake(
            "http",
            request.host,
            request.port,
            principal,
            scheme,
            head.consumed,
            0,
            forward=True,
            request=request,
        )

    async def _send_quietly(self, data: bytes | None) -> None:
        """Our own answer to a request that has no flow (a bad head, missing credentials)."""
        if data and self.client is not None:
            with contextlib.suppress(OSError):
                await self.dispatcher.loop.sock_sendall(self.client, data)

    def _drop_upstream(self) -> None:
        up, self._fwd_up = self._fwd_up, None
        if up is not None:
            with contextlib.suppress(OSError):
                up.sock.close()
        self.upstream = None

    # -- requests the C connection loop forwards ------------------------------------

    def _on_c_forwarding(self, rec: connpath.ConnRecord, outbound: Any) -> None:
        """ROUTED of a request C forwards itself (dialled, its head sent): flow.routed,
        as _forward_flow publishes it once dialled (before any of the request's bytes
        are counted). C still holds the flow: a close goes to C (``_c_flow``)."""
        s = self.state
        assert s is not None
        s.resolved_ip = rec.resolved_ip
        s.remote_host, s.remote_port = s.target_host, s.target_port
        self.machine.handle(Relaying())
        s.state = "active"
        if outbound is not None and outbound.chained:
            self.deps.counters.chained_sessions += 1
        else:
            self.deps.counters.direct_sessions += 1
        self._publish("flow.routed", records.lifecycle_payload, occurred=rec.at_unix_ms)

    def _on_c_forwarded(self, rec: connpath.ConnRecord) -> None:
        """The ENDED record of a request C forwarded: its exact counts, and the outcome
        the Python path gives (relayed; a quiet upstream failed as _upstream_failed)."""
        s = self.state
        assert s is not None
        t = s.traffic
        t.inbound_rx_bytes = rec.client_rx
        t.inbound_tx_bytes = rec.client_tx
        t.outbound_rx_bytes = rec.upstream_rx
        t.outbound_tx_bytes = t.bytes_up = rec.upstream_tx
        if rec.end != connpath.END_FWD_TIMEOUT:
            t.bytes_down = rec.client_tx
            self._end(Ended(self._dialled()))
            return
        if rec.detail == 0:
            message = "upstream connection failed: timed out"  # our 502, not the origin's
        else:
            t.bytes_down = rec.client_tx
            message = (
                "upstream failed mid-response (timed out); the response to the client is cut short"
            )
        failure = records.Failure(
            "relay", "upstream_error", message, {"host": s.remote_host, "port": s.remote_port}
        )
        self._end(Failed(failure))

    def _take_over_forward(self, d: connpath.Deferred, client: socket.socket) -> None:
        """C sent a request up and leaves its answer to Python (chunked, interim, long,
        an error...): carry on with the exchange, then the connection, in Python."""
        upstream = socket.socket(fileno=d.ufd)
        s = self.state
        if s is None or not self.machine.live or self.machine.close_requested:
            client.close()
            upstream.close()
            if s is not None and self.machine.live:
                self._end(Closed(self._dialled()))
            self._finish()
            return
        self.client = client
        self._task = self.dispatcher.spawn(self._establish(self._resume_forward(d, upstream)))

    async def _resume_forward(self, d: connpath.Deferred, upstream: socket.socket) -> None:
        s = self.state
        assert s is not None
        # The head C forwarded: Python accepts the same bytes (tests/csrc hold C to it).
        head = http_proto.parse_request_head(d.raw[: d.split])
        assert head is not NEED_MORE
        request = forward_request(head)
        t = s.traffic
        t.inbound_rx_bytes = d.client_rx
        t.inbound_tx_bytes = d.client_tx
        t.outbound_rx_bytes = d.upstream_rx
        t.outbound_tx_bytes = t.bytes_up = d.upstream_tx
        upstream.setblocking(False)
        dialed = SimpleNamespace(
            sock=upstream,
            remote_host=s.remote_host,
            remote_port=s.remote_port,
            resolved_ip=s.resolved_ip,
            relay_chain=[],
            leftover=d.raw[d.split :],
            sealed=None,
        )
        self._fwd_buf = b""
        self._fwd_memo = None
        self._fwd_rmemo = None
        self._fwd_upload_failed = False
        # Keyed as _forward_flow keys it: the host canonical, no address pinned.
        key = (s.outbound_tag or "", hostnorm.canonical_host(request.host), request.port, None)
        up = self._fwd_up = _Upstream(cast("DialResult", dialed), key, False)
        self.upstream = upstream
        hs = Handshake(
            "http",
            request.host,
            request.port,
            s.principal_key,
            s.auth_scheme,
            d.client_rx,
            0,
            forward=True,
            request=request,
        )
        await self._serve_forward(hs, s, self._resumed_download(request, up))

    async def _resumed_download(self, request: ForwardRequest, up: _Upstream) -> int:
        try:
            return await self._download(request, up, None, False)
        except _ClientGone:
            self._drop_upstream()
            self._end(Ended(self._dialled()))
            return _CLOSE

    # -- one request's flow --------------------------------------------------------

    async def _forward_flow(self, hs: Handshake, state: records.FlowState) -> int:
        """Start, route, dial and relay one request's flow; what the connection does next."""
        request = hs.request
        assert request is not None
        state.traffic.inbound_rx_bytes = request.head.consumed
        hook = self.deps.flow_hook
        if hook is not None and hook.settings.selects("tcp", self.inbound.tag):
            allow = await ask_about(hook, state)
            self._start_record(state)
            if not allow:
                return await self._refuse_request(
                    request, 403, "denied by the flow hook", HookDenied()
                )
        else:
            self._start_record(state)
        deps = self.deps
        decision, address = await self._decide(hs)
        chain = (
            deps.policies.resolve(decision.target, hs.host, self.peer[0]) if decision.target else []
        )
        outbound = deps.outbounds.get(chain[-1]) if chain else None
        self._set_route(decision, chain, outbound)
        if decision.action == "block" or outbound is None or outbound.protocol == "block":
            return await self._refuse_request(request, 403, "blocked by rule", Blocked())
        s = state
        t = s.traffic
        key = (outbound.tag, hs.host, hs.port, address)
        # A pooled upstream to the same outbound and target is this flow's dial.
        self.machine.handle(Dialing())
        up = self._fwd_up
        if up is None or up.key != key or not up.usable():
            self._drop_upstream()
            try:
                dialed = await self._dial(outbound, hs, address)
            except DialError as ex:
                if ex.member_down:
                    self._report_member_down(chain, ex.message)
                remote = (
                    {"host": hs.host, "port": hs.port} if ex.remote is None else {"host": ex.remote}
                )
                failure = records.Failure(ex.stage, ex.code, ex.message, remote)
                return await self._refuse_request(
                    request, ex.http_status, ex.message, Failed(failure)
                )
            up = self._fwd_up = _Upstream(dialed, key, outbound.chained)
            self.upstream = up.sock
            t.outbound_tx_bytes += dialed.tx_bytes
            t.outbound_rx_bytes += dialed.rx_bytes
        s.resolved_ip = up.resolved_ip
        s.remote_host = up.remote_host
        s.remote_port = up.remote_port
        s.relay_chain = list(up.relay_chain)
        self.machine.handle(Dialed())
        self.machine.handle(Relaying())
        s.state = "active"
        if up.chained:
            deps.counters.chained_sessions += 1
        else:
            deps.counters.direct_sessions += 1
        self._publish("flow.routed", records.lifecycle_payload)
        return await self._exchange(request, up)

    async def _refuse_request(
        self,
        request: ForwardRequest,
        status: int,
        message: str,
        end: Event,
    ) -> int:
        """Answer a request we do not forward with our own error, and complete its flow
        by ``end`` (denied, blocked or failed).

        The connection stays for the next request when the client wants that and this
        request's body is already here to be skipped; otherwise it closes after the answer.
        """
        keep = request.keep_alive and self._skip_body(request)
        reply = http_proto.response(
            status,
            headers=(("Connection", "keep-alive"),) if keep else (),
            body=(message + "\n").encode(),
        )
        await self._reply(reply, quiet=True)
        self._end(end)
        return _KEEP if keep else _CLOSE

    def _skip_body(self, request: ForwardRequest) -> bool:
        """Consume a refused request's body if all of it has arrived; False if not."""
        body = framing.BodyFramer(request.body_kind, request.body_length)
        try:
            taken = body.feed(self._fwd_buf)
        except ProtocolError:
            return False
        if not body.done:
            return False
        self._fwd_buf = self._fwd_buf[taken:]
        assert self.state is not None
        self.state.traffic.inbound_rx_bytes += taken
        return True
