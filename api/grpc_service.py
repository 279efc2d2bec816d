"""``spliceway.v1.Control``: the HTTP API's queries, commands and event stream over gRPC.

See docs/grpc.md and ``api/proto/spliceway/v1/control.proto``. Everything a call
does goes through what the HTTP API uses: ``KeyTable.authenticate`` and the
app's ``require_read`` (queries and streams need ``read``), the app's rate limits
and stream slots, ``queries.run_query``, ``commands.execute`` (which checks each
command's permission) and ``sse.open_stream`` (resume, bounds).

Errors. A refusal of the caller (``unauthenticated``, ``permission_denied``,
``rate_limited``) is a gRPC status (UNAUTHENTICATED, PERMISSION_DENIED,
RESOURCE_EXHAUSTED), so generic clients and interceptors see it; its trailing
metadata carries ``spliceway-error-code`` and, when rate limited,
``retry-after``. Every other error of ``Execute`` and ``Query`` is the envelope
with ``ok = false`` and status OK, as HTTP puts it in the body. ``Subscribe``
has no envelope, so each of its errors is a status (``STATUS_FOR_CODE``).

JSON objects travel as ``google.protobuf.Struct``: numbers are doubles there, so
an integral number in a request is handed to the tables as an int (JSON has no
int/float distinction; the tables' strict validation would refuse ``5.0``).

Needs the ``grpc`` extra; importing this module is how the engine checks for it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

import grpc
import orjson
from google.protobuf import struct_pb2
from grpc_reflection.v1alpha import reflection

from spliceway.api.app import MAX_BODY_BYTES, ControlState, caller_capabilities, require_read
from spliceway.api.auth import Principal
from spliceway.api.grpc_gen import control_pb2, control_pb2_grpc
from spliceway.api.ipc import event_list
from spliceway.api.limits import RateLimited, TokenBucket
from spliceway.api.sse import open_stream
from spliceway.control import queries
from spliceway.control.capabilities import API_ID
from spliceway.errors import ApiError, invalid_argument
from spliceway.events.log import Subscription

logger = logging.getLogger(__name__)

#: ``spliceway.v1.Control``, as reflection lists it.
SERVICE_NAME: str = control_pb2.DESCRIPTOR.services_by_name["Control"].full_name

#: The gRPC status for each error code, where a status carries it (refusals, and
#: every error of Subscribe). A test holds it to ``errors.HTTP_STATUS``; a code added
#: there and not here would be UNKNOWN.
STATUS_FOR_CODE: dict[str, grpc.StatusCode] = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "permission_denied": grpc.StatusCode.PERMISSION_DENIED,
    "insufficient_os_privilege": grpc.StatusCode.PERMISSION_DENIED,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "conflict": grpc.StatusCode.FAILED_PRECONDITION,
    "rate_limited": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "internal": grpc.StatusCode.INTERNAL,
    "feature_disabled": grpc.StatusCode.UNIMPLEMENTED,
    "unsupported": grpc.StatusCode.UNIMPLEMENTED,
}

#: Codes that refuse the caller rather than answer the request: a status, not an
#: envelope, on Execute and Query too.
REFUSALS = frozenset({"unauthenticated", "permission_denied", "rate_limited"})
#: Trailing metadata naming the error code of a status.
ERROR_CODE_KEY = "spliceway-error-code"
#: Initial metadata of Subscribe: the event types subscribed (``*``: all).
SUBSCRIBED_KEY = "spliceway-subscribed"
#: Initial metadata of Subscribe when the resume point could not be honoured exactly.
NOTICE_KEY = "spliceway-notice"
#: Calls in progress (streams included) beyond which grpc answers RESOURCE_EXHAUSTED
#: at once instead of queueing them for a worker.
MAX_CONCURRENT_RPCS = 64

_POLL_S = 0.25
_BATCH = 256
#: Doubles represent every integer up to this exactly.
_EXACT = float(2**53)


# -- Struct <-> JSON -------------------------------------------------------------------


def plain(value: struct_pb2.Value) -> Any:
    """A ``Value`` as the JSON value it encodes; integral numbers become ints."""
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        number = value.number_value
        return int(number) if number.is_integer() and abs(number) <= _EXACT else number
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "struct_value":
        return struct_to_dict(value.struct_value)
    if kind == "list_value":
        return [plain(item) for item in value.list_value.values]
    return None  # null_value, or a Value with nothing set


def struct_to_dict(struct: struct_pb2.Struct) -> dict[str, Any]:
    """A ``Struct`` as a JSON object (see :func:`plain`)."""
    return {key: plain(value) for key, value in struct.fields.items()}


def to_struct(data: Any) -> struct_pb2.Struct:
    """A JSON object as a ``Struct``, rendered first exactly as the HTTP API renders it."""
    struct = struct_pb2.Struct()
    struct.update(orjson.loads(orjson.dumps(data)))
    return struct


def ok_envelope(result: Any, request_id: str) -> control_pb2.Envelope:
    """A success envelope."""
    return control_pb2.Envelope(api_id=API_ID, id=request_id, ok=True, result=to_struct(result))


def error_envelope(error: ApiError, request_id: str) -> control_pb2.Envelope:
    """An error envelope: the HTTP envelope's ``error`` object, field for field."""
    rendered = error.to_dict()
    message = control_pb2.Error(
        code=rendered["code"],
        message=rendered["message"],
        field_path=rendered.get("field_path"),
        cause=rendered.get("cause"),
        details=[control_pb2.ErrorDetail(**d) for d in rendered.get("details", ())],
    )
    return control_pb2.Envelope(api_id=API_ID, id=request_id, ok=False, error=message)


def event_message(data: bytes) -> control_pb2.Event:
    """An event envelope's JSON (the event log's own rendering) as an ``Event``."""
    envelope = orjson.loads(data)
    return control_pb2.Event(
        schema_id=envelope["schema_id"],
        event_id=envelope["event_id"],
        event_type=envelope["event_type"],
        occurred_at_unix_ms=envelope["occurred_at_unix_ms"],
        source_id=envelope.get("source_id"),
        sequence=envelope["sequence"],
        principal_key=envelope.get("principal_key"),
        labels=envelope.get("labels") or {},
        payload=to_struct(envelope["payload"]),
    )


# -- the service -----------------------------------------------------------------------


class _Stream:
    """One Subscribe call's subscription and event-stream slot; ``close`` is idempotent
    (the call's end callback, the pump's exit and the server's stop all call it)."""

    def __init__(self, sub: Subscription, release: Callable[[_Stream], None]) -> None:
        self.sub = sub
        self._release: Callable[[_Stream], None] | None = release
        self._lock = threading.Lock()

    def close(self) -> None:
        self.sub.close()
        with self._lock:
            release, self._release = self._release, None
        if release is not None:
            release(self)


class ControlService(control_pb2_grpc.ControlServicer):
    """The servicer: one per engine, over the HTTP app's shared state."""

    def __init__(self, state: ControlState) -> None:
        self._plane = state.plane
        self._state = state
        self._lock = threading.Lock()
        self._streams: set[_Stream] = set()

    def close_streams(self) -> None:
        """End every open event stream (server stop)."""
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.close()

    # -- admission ---------------------------------------------------------------------

    def _admit(
        self, context: grpc.ServicerContext, bucket: TokenBucket, *, read: bool
    ) -> Principal:
        """Authenticate, check ``read`` where needed, take a rate-limit token: the HTTP
        gate's order."""
        metadata: dict[str, str] = {}
        for key, value in context.invocation_metadata():
            if isinstance(value, str):
                metadata.setdefault(key, value)
        principal = self._state.keys.authenticate(
            metadata.get("authorization"), metadata.get("x-service-api-key")
        )
        if read:
            require_read(principal)
        wait = bucket.take()
        if wait:
            kind = "command" if bucket is self._state.command_bucket else "query"
            raise RateLimited(f"{kind} rate limit exceeded", wait)
        return principal

    @staticmethod
    def _refuse(context: grpc.ServicerContext, error: ApiError) -> NoReturn:
        """End the call with the error's status (raises, as ``context.abort`` does)."""
        trailing = [(ERROR_CODE_KEY, error.code)]
        if isinstance(error, RateLimited):
            trailing.append(("retry-after", str(error.retry_after)))
        context.set_trailing_metadata(tuple(trailing))
        context.abort(STATUS_FOR_CODE.get(error.code, grpc.StatusCode.UNKNOWN), error.message)
        raise AssertionError("context.abort returned")  # pragma: no cover

    def _answer(
        self, context: grpc.ServicerContext, request_id: str, run: Callable[[], Any]
    ) -> control_pb2.Envelope:
        """The envelope for ``run()``'s result or error; refusals become statuses."""
        try:
            return ok_envelope(run(), request_id)
        except ApiError as ex:
            if ex.code in REFUSALS:
                self._refuse(context, ex)
            return error_envelope(ex, request_id)
        except Exception:
            logger.exception("gRPC call failed")
            return error_envelope(ApiError("internal", "internal error"), request_id)

    # -- methods -----------------------------------------------------------------------

    def Execute(
        self, request: control_pb2.CommandRequest, context: grpc.ServicerContext
    ) -> control_pb2.Envelope:
        """Run one command (``POST /api/v1/commands``)."""

        def run() -> Any:
            principal = self._admit(context, self._state.command_bucket, read=False)
            # Unset params is a missing one: invalid_argument on "params", as over HTTP.
            params = struct_to_dict(request.params) if request.HasField("params") else None
            return self._plane.execute(
                request.method, params, principal.permissions, transport="grpc"
            )

        return self._answer(context, request.id, run)

    def Query(
        self, request: control_pb2.QueryRequest, context: grpc.ServicerContext
    ) -> control_pb2.Envelope:
        """Answer one query (``GET /api/v1/<name>``)."""

        def run() -> Any:
            principal = self._admit(context, self._state.query_bucket, read=True)
            name = request.name
            if name not in queries.QUERIES:
                known = ", ".join(queries.QUERIES)
                raise invalid_argument(f"unknown query {name!r}; one of: {known}", "name")
            params = struct_to_dict(request.params)
            if name == "capabilities":
                # The caller's own grants, as over HTTP (the table's entry grants all).
                queries.check_params(name, params)
                return caller_capabilities(self._plane, principal)
            return self._plane.run_query(name, params)

        return self._answer(context, request.id, run)

    def Subscribe(
        self, request: control_pb2.SubscribeRequest, context: grpc.ServicerContext
    ) -> Iterator[control_pb2.Event]:
        """Stream events: catch-up after ``since``, flow.snapshot, then live events."""
        try:
            self._admit(context, self._state.query_bucket, read=True)
            types = event_list(list(request.events))
            since = request.since if request.HasField("since") else None
            stream, notice = self._open(types, since)
        except ApiError as ex:
            self._refuse(context, ex)
        except Exception:
            logger.exception("gRPC Subscribe failed")
            context.abort(grpc.StatusCode.INTERNAL, "internal error")
        # The call's end, however it comes (client cancel, deadline, server stop),
        # wakes the pump and gives the slot back.
        if not context.add_callback(stream.close):
            stream.close()
            return iter(())
        subscribed = sorted(stream.sub.types) if stream.sub.types is not None else ["*"]
        metadata = [(SUBSCRIBED_KEY, ",".join(subscribed))]
        if notice:
            metadata.append((NOTICE_KEY, notice))
        context.send_initial_metadata(tuple(metadata))
        return self._pump(stream, context)

    def _open(self, types: list[str] | None, since: int | None) -> tuple[_Stream, str]:
        state = self._state
        # One budget with the SSE streams: the limit is per engine.
        if not state.sse_slots.acquire():
            raise RateLimited(
                f"at most {state.sse_slots.capacity} concurrent event streams "
                "(SSE and gRPC together)",
                1.0,
            )
        try:
            sub, preface = open_stream(self._plane.log, types, since, self._plane.flow_records)
        except BaseException:
            state.sse_slots.release()
            raise
        stream = _Stream(sub, self._release)
        with self._lock:
            self._streams.add(stream)
        # open_stream's gap notice is an SSE comment; the text is what matters here.
        notice = preface.decode().strip().removeprefix(":").strip()
        return stream, notice

    def _release(self, stream: _Stream) -> None:
        with self._lock:
            self._streams.discard(stream)
        self._state.sse_slots.release()

    def _pump(self, stream: _Stream, context: grpc.ServicerContext) -> Iterator[control_pb2.Event]:
        sub = stream.sub
        encoded = self._plane.log.encoded
        try:
            while not sub.overflowed:
                batch = sub.get_many(timeout=_POLL_S, limit=_BATCH)
                if batch:
                    for envelope in batch:
                        yield event_message(encoded(envelope))
                    continue
                if sub.ended:
                    final = sub.ended_by
                    # engine.stopped ends every stream, filter or not, so a client can
                    # tell a shutdown from a dropped connection.
                    if final is not None and not sub.accepts(final["event_type"]):
                        yield event_message(encoded(final))
                    return
                if not context.is_active():
                    return
            # The client read too slowly: its subscription hit its bound, and the engine
            # does not wait for anyone. It resumes from the ring with since.
            context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
            context.set_details(
                "this stream fell too far behind the engine's events; subscribe again "
                "with since = the last sequence received"
            )
        finally:
            stream.close()


def build_server(
    service: ControlService, address: str, port: int, workers: int
) -> tuple[grpc.Server, ThreadPoolExecutor, int]:
    """A bound, unstarted server with the service and reflection; and its executor and
    bound port. ``conflict`` when the address cannot be bound."""
    executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="spliceway-grpc")
    server = grpc.server(
        executor,
        options=(
            # grpc sets SO_REUSEPORT by default: a second engine would then share the
            # port silently instead of being refused.
            ("grpc.so_reuseport", 0),
            # As large as an HTTP command body may be (a whole configuration).
            ("grpc.max_receive_message_length", MAX_BODY_BYTES),
        ),
        maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
    )
    control_pb2_grpc.add_ControlServicer_to_server(service, server)
    reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME), server)
    host = f"[{address}]" if ":" in address else address
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio raises when it cannot bind (older ones returned 0)
        bound = 0
    if not bound:
        server.stop(None)
        executor.shutdown(wait=False)
        raise ApiError(
            "conflict",
            f"gRPC control API cannot listen on {host}:{port} (the control API's port + 1)",
            field_path="api.control.listen.port",
        )
    return server, executor, bound
