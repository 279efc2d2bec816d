"""The OpenAPI 3.1 document of the control API (served raw at ``GET /api/v1/openapi.json``).

The document is built here in Python from small schema helpers, and from the
same tables the engine dispatches through, so it cannot drift from them:
- every command's ``params`` schema is its pydantic model's JSON schema
  (``spliceway.control.commands.COMMANDS``), one ``components.schemas.<Model>`` each;
- the error ``code`` enum of each HTTP status comes from ``spliceway.errors`` (its
  table, and ``code_for_http_status`` for the statuses only HTTP answers: 405, 415);
- event types come from ``spliceway.config.EVENT_TYPES``; the bounds of ``limit``
  from ``spliceway.control.queries``;
- the wire shapes the engine emits (``FlowRecord``, ``EventEnvelope``, ``Stats``,
  ``Sink``) are generated from their models in ``spliceway.shapes``, which also
  generate their tables in docs/events.md.

The resource and command-result schemas, and the small helpers they are written
with, are in ``spliceway.api.schemas``; this module assembles the document (paths,
errors, components) and re-exports the helpers.

Result shapes are closed (``additionalProperties: false``) wherever the
contract fixes them, so validating real responses against this document is a
real check. Every response, success or error, is the envelope
``{api_id, id, ok, result}`` or ``{api_id, id, ok, error}``; the SSE
stream and this document itself are the two bodies of their own formats.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from spliceway.api.schemas import (
    BOOL,
    COUNT,
    LATENCY_MS,
    MODE_KIND,
    NON_EMPTY,
    OPEN_OBJECT,
    PORT,
    STR,
    STRINGS,
    UNIX_MS,
    Schema,
    array,
    command_results,
    const,
    enum,
    integer,
    obj,
    ref,
    resource_schemas,
    string,
)
from spliceway.config import EVENT_TYPES
from spliceway.control.capabilities import API_ID
from spliceway.control.commands import COMMANDS, PERMISSIONS
from spliceway.control.queries import EVENTS_LIMIT_MAX, FLOWS_LIMIT_DEFAULT, FLOWS_LIMIT_MAX
from spliceway.errors import HTTP_STATUS, code_for_http_status
from spliceway.events.logring import LEVELS as LOG_LEVELS
from spliceway.events.logring import LOGS_LIMIT_MAX
from spliceway.shapes.schema import nullable

__all__ = [
    "BOOL",
    "COUNT",
    "LATENCY_MS",
    "NON_EMPTY",
    "OPENAPI_VERSION",
    "OPEN_OBJECT",
    "PORT",
    "PREFIX",
    "STR",
    "STRINGS",
    "UNIX_MS",
    "Schema",
    "array",
    "command_component",
    "const",
    "enum",
    "error_envelope",
    "integer",
    "nullable",
    "obj",
    "openapi_document",
    "ref",
    "string",
    "success_envelope",
]

PREFIX = "/api/v1"
OPENAPI_VERSION = "3.1.0"

_JSON = "application/json"
_SSE = "text/event-stream"
_SCHEMAS = "#/components/schemas/"


def _pascal(method: str) -> str:
    """``diagnostics.trace_route`` -> ``DiagnosticsTraceRoute``."""
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[._]", method) if part)


def command_component(method: str, suffix: str) -> str:
    """Component name of one command's request variant (``Command``) or result (``Result``)."""
    return f"{_pascal(method)}{suffix}"


# ---------------------------------------------------------------------------
# Envelope and errors
# ---------------------------------------------------------------------------

_REQUEST_ID: Schema = {
    "type": ["string", "number", "null"],
    "description": "The command request's id echoed back; null for queries.",
}

_API_ERROR = obj(
    {"code": enum(HTTP_STATUS), "message": STR},
    {
        "field_path": string(description="Where the problem is, e.g. params.flow_id."),
        "cause": STR,
        "details": array(obj({"message": STR}, {"field_path": STR})),
    },
    description="The error object of the envelope.",
)

#: Error statuses documented per operation, their response component and description.
_ERROR_RESPONSES: dict[int, tuple[str, str]] = {
    400: (
        "BadRequest",
        "invalid_argument: a parameter or the body is not valid, or a query parameter is "
        "unknown to this endpoint or given twice (field_path names it).",
    ),
    401: ("Unauthenticated", "unauthenticated: a key is required and none (or a wrong one) came."),
    403: (
        "PermissionDenied",
        "permission_denied: the key lacks the permission this needs; or, with no key "
        "configured, a browser-protection refusal (foreign Host, cross-origin Origin, "
        "cross-site Sec-Fetch-Site; see the document's description).",
    ),
    404: ("NotFound", "not_found: no such resource (or no such endpoint)."),
    405: ("MethodNotAllowed", "unsupported: this path does not answer this method (see Allow)."),
    409: (
        "Conflict",
        "conflict: the state does not allow it now (for commands: the engine is stopping).",
    ),
    413: (
        "ContentTooLarge",
        "invalid_argument: the body is (or is declared) larger than 16 MiB; refused before "
        "it is read, and the connection is closed.",
    ),
    415: (
        "UnsupportedMediaType",
        "invalid_argument (field_path Content-Type): the command body was not sent as "
        "Content-Type: application/json.",
    ),
    429: (
        "RateLimited",
        "rate_limited: over a rate or concurrency limit; retry after Retry-After.",
    ),
    500: ("InternalError", "internal: an unexpected failure."),
    501: ("NotImplemented", "unsupported / feature_disabled: not built in this engine."),
}


def _codes_for(status: int) -> list[str]:
    codes = [code for code, mapped in HTTP_STATUS.items() if mapped == status]
    # Statuses only HTTP answers (405 unsupported, 415 invalid_argument) are not in
    # the table; errors.code_for_http_status names their code.
    return codes or [code_for_http_status(status)]


def success_envelope(result: Schema) -> Schema:
    """The success envelope carrying ``result``."""
    return obj(
        {"api_id": const(API_ID), "id": _REQUEST_ID, "ok": const(True), "result": result},
        description="Success envelope.",
    )


def error_envelope(status: int) -> Schema:
    """The error envelope of one HTTP status, its ``code`` narrowed to that status's codes."""
    return obj(
        {
            "api_id": const(API_ID),
            "id": _REQUEST_ID,
            "ok": const(False),
            "error": {
                "allOf": [ref("ApiError"), {"properties": {"code": enum(_codes_for(status))}}]
            },
        },
        description=f"Error envelope for HTTP {status}.",
    )


def _header(schema: Schema, description: str, *, required: bool = True) -> Schema:
    return {"description": description, "required": required, "schema": schema}


_HEADERS: dict[str, Schema] = {
    "AccessControlAllowOrigin": _header(const("*"), "CORS: every origin may read the response."),
    "WWWAuthenticate": _header(STR, "The authentication scheme to use (Bearer)."),
    "RetryAfter": _header(integer(1), "Whole seconds to wait before retrying."),
    "Allow": _header(STR, "The methods this path answers."),
    "AccessControlAllowMethods": _header(STR, "CORS preflight: allowed methods."),
    "AccessControlAllowHeaders": _header(STR, "CORS preflight: allowed request headers."),
    "AccessControlMaxAge": _header(STR, "CORS preflight: seconds the answer may be cached."),
}


def _header_refs(*names: str) -> dict[str, Schema]:
    wire = {
        "AccessControlAllowOrigin": "Access-Control-Allow-Origin",
        "WWWAuthenticate": "WWW-Authenticate",
        "RetryAfter": "Retry-After",
        "Allow": "Allow",
        "AccessControlAllowMethods": "Access-Control-Allow-Methods",
        "AccessControlAllowHeaders": "Access-Control-Allow-Headers",
        "AccessControlMaxAge": "Access-Control-Max-Age",
    }
    return {wire[n]: {"$ref": f"#/components/headers/{n}"} for n in names}


def _error_response(status: int) -> Schema:
    name, description = _ERROR_RESPONSES[status]
    extra = {401: ("WWWAuthenticate",), 429: ("RetryAfter",), 405: ("Allow",)}.get(status, ())
    return {
        "description": description,
        "headers": _header_refs("AccessControlAllowOrigin", *extra),
        "content": {_JSON: {"schema": ref(f"{name}Envelope")}},
    }


def _ok(result: Schema, description: str) -> Schema:
    return {
        "description": description,
        "headers": _header_refs("AccessControlAllowOrigin"),
        "content": {_JSON: {"schema": success_envelope(result)}},
    }


def _command_schemas() -> tuple[dict[str, Schema], Schema, Schema]:
    """Components for params, request variants and results; the request and result unions."""
    components: dict[str, Schema] = {}
    results = command_results()
    variants: list[Schema] = []
    mapping: dict[str, str] = {}
    result_refs: list[Schema] = []
    for method, command in COMMANDS.items():
        model = command.params
        params = model.model_json_schema(ref_template=_SCHEMAS + "{model}")
        components.update(params.pop("$defs", {}))
        components[model.__name__] = params
        variant_name = command_component(method, "Command")
        note = f"Needs the {command.permission} permission."
        if command.missing is not None:
            note += f" Not available in this build (answers 501): needs {command.missing}."
        components[variant_name] = obj(
            {"method": string(const=method), "params": ref(model.__name__)},
            {"id": _REQUEST_ID},
            description=f"``{method}``. {note}",
        )
        variants.append(ref(variant_name))
        mapping[method] = _SCHEMAS + variant_name
        result_name = command_component(method, "Result")
        components[result_name] = results.get(
            method, {"type": "object", "description": "Result shape not documented yet."}
        )
        if ref(result_name) not in result_refs:
            result_refs.append(ref(result_name))
    request = {
        "description": "One command: its method and that method's params.",
        "oneOf": variants,
        "discriminator": {"propertyName": "method", "mapping": mapping},
    }
    result = {"description": "The result of the command named by method.", "anyOf": result_refs}
    return components, request, result


# ---------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------

_COMMON_ERRORS = (401, 403, 405, 429, 500)
_SECURITY: list[dict[str, list[str]]] = [{}, {"bearer": []}, {"apiKey": []}]


def _responses(success: dict[str, Schema], *errors: int) -> dict[str, Schema]:
    out = dict(success)
    for status in sorted({*errors, *_COMMON_ERRORS}):
        out[str(status)] = {"$ref": f"#/components/responses/{_ERROR_RESPONSES[status][0]}"}
    return out


def _get(
    op_id: str,
    summary: str,
    result: Schema,
    *errors: int,
    parameters: list[Schema] | None = None,
) -> Schema:
    op: Schema = {"operationId": op_id, "summary": summary, "tags": ["queries"]}
    if parameters:
        op["parameters"] = parameters
    op["responses"] = _responses({"200": _ok(result, summary)}, *errors)
    return op


def _options(op_id: str) -> Schema:
    return {
        "operationId": op_id,
        "summary": "CORS preflight (never authenticated or rate limited).",
        "description": (
            "With no key configured, a preflight from another origin (or to a foreign "
            "Host) is refused with 403, as the request itself would be."
        ),
        "tags": ["cors"],
        "security": [],
        "responses": {
            "200": {
                "description": "Preflight answer: an empty success envelope.",
                "headers": _header_refs(
                    "AccessControlAllowOrigin",
                    "AccessControlAllowMethods",
                    "AccessControlAllowHeaders",
                    "AccessControlMaxAge",
                ),
                "content": {_JSON: {"schema": ref("PreflightEnvelope")}},
            },
            "403": {"$ref": "#/components/responses/PermissionDenied"},
        },
    }


def _path_param(name: str, description: str) -> Schema:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "description": description,
        "schema": string(minLength=1),
    }


def _query_param(name: str, schema: Schema, description: str, **extra: Any) -> Schema:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "description": description,
        "schema": schema,
        **extra,
    }


def _paths(command_result: Schema) -> dict[str, Schema]:
    flows_params = [
        _query_param(
            "limit",
            integer(1, FLOWS_LIMIT_MAX, default=FLOWS_LIMIT_DEFAULT),
            "At most this many flows.",
        ),
        _query_param("inbound_tag", STR, "Only flows of this inbound."),
        _query_param("principal_key", STR, "Only flows of this principal."),
    ]
    types_schema = array(enum([*sorted(EVENT_TYPES), "*"]))
    events_params = [
        _query_param(
            "types",
            types_schema,
            "Comma-separated event types to return (default, blank or *: every type).",
            style="form",
            explode=False,
        ),
        _query_param("since", integer(0), "Only events whose sequence is greater than this."),
        _query_param(
            "limit",
            integer(1, EVENTS_LIMIT_MAX),
            "At most this many events, the oldest matching ones first "
            "(default: every matching event in the ring).",
        ),
    ]
    logs_params = [
        _query_param("since", integer(0), "Only records whose sequence is greater than this."),
        _query_param(
            "limit",
            integer(1, LOGS_LIMIT_MAX),
            "At most this many records, the oldest matching ones first "
            "(default: every matching record in the ring).",
        ),
        _query_param(
            "level",
            enum(list(LOG_LEVELS)),
            "Only records at or above this level (`trace` is `debug`; default: every "
            "record the ring holds).",
        ),
    ]
    stream_params = [
        _query_param(
            "types",
            types_schema,
            "Comma-separated event types to receive (default: every type).",
            style="form",
            explode=False,
        ),
        _query_param(
            "since",
            integer(0),
            "Replay ring events after this sequence first (wins over Last-Event-ID).",
        ),
        {
            "name": "Last-Event-ID",
            "in": "header",
            "required": False,
            "description": "The SSE resume point: the id of the last event received.",
            "schema": integer(0),
        },
    ]
    # Every query answers 400 for a query parameter it does not declare, or one given twice.
    queries: dict[str, tuple[str, str, Schema, tuple[int, ...], list[Schema] | None]] = {
        "health": ("getHealth", "Liveness of the engine.", ref("Health"), (), None),
        "capabilities": (
            "getCapabilities",
            "What this build supports, for this caller.",
            ref("Capabilities"),
            (),
            None,
        ),
        "config": ("getConfig", "The running configuration.", ref("ConfigSummary"), (), None),
        "runtime": ("getRuntime", "The runtime snapshot.", ref("Runtime"), (), None),
        "stats": ("getStats", "Cumulative counters.", ref("Stats"), (), None),
        "flows": ("listFlows", "Active flows.", ref("FlowList"), (), flows_params),
        "flows/{flow_id}": (
            "getFlow",
            "One active flow.",
            ref("FlowRecord"),
            (404,),
            [_path_param("flow_id", "An active flow's id.")],
        ),
        "policies": ("listPolicies", "Policy groups.", ref("PolicyList"), (), None),
        "policies/{policy_tag}": (
            "getPolicy",
            "One policy group.",
            ref("PolicySnapshot"),
            (404,),
            [_path_param("policy_tag", "A policy group's tag.")],
        ),
        "providers": (
            "listProviders",
            "Proxy and rule providers and geodata files: source, age, schedule, content.",
            ref("ProviderList"),
            (),
            None,
        ),
        "sinks": ("listSinks", "Event sinks.", ref("SinkList"), (), None),
        "tun_status": ("getTunStatus", "The TUN inbound.", ref("TunStatus"), (), None),
        "events": (
            "getEvents",
            "The event ring, optionally filtered.",
            ref("EventRing"),
            (),
            events_params,
        ),
        "logs": (
            "getLogs",
            "The engine's recent log records, optionally filtered.",
            ref("LogRing"),
            (),
            logs_params,
        ),
    }
    paths: dict[str, Schema] = {}
    for name, (op_id, summary, result, errors, parameters) in queries.items():
        options_id = "options" + op_id[0].upper() + op_id[1:]
        in_path = [p for p in parameters or () if p["in"] == "path"]
        in_query = [p for p in parameters or () if p["in"] != "path"]
        item: Schema = {"parameters": in_path} if in_path else {}
        item["get"] = _get(op_id, summary, result, 400, *errors, parameters=in_query)
        item["options"] = _options(options_id)
        paths[f"{PREFIX}/{name}"] = item
    paths[f"{PREFIX}/events"]["get"]["description"] = (
        "The ring's events, oldest first, filtered by `types`, `since` and `limit`: "
        f"at most `limit` (1..{EVENTS_LIMIT_MAX}) events, the oldest matching ones after "
        "`since`, so a client pages forward by passing the last sequence it got as the "
        "next `since`. `oldest_sequence`, `latest_sequence` and `capacity` describe the "
        "ring itself, not the filtered list."
    )
    paths[f"{PREFIX}/events/stream"] = {
        "get": {
            "operationId": "streamEvents",
            "summary": "Live events as Server-Sent Events, with resume.",
            "description": (
                "Frames are `id: <sequence>`, `event: <type>`, `data: <EventEnvelope JSON>`. "
                "At most 5 concurrent streams; the 6th is answered 429. Query parameters "
                "other than `types` and `since` are refused (400)."
            ),
            "tags": ["events"],
            "parameters": stream_params,
            "responses": _responses(
                {
                    "200": {
                        "description": "The event stream (never ends by itself).",
                        "headers": _header_refs("AccessControlAllowOrigin"),
                        "content": {_SSE: {"schema": string()}},
                    }
                },
                400,
            ),
        },
        "options": _options("optionsStreamEvents"),
    }
    paths[f"{PREFIX}/commands"] = {
        "post": {
            "operationId": "executeCommand",
            "summary": "Run one command of the command table.",
            "description": (
                "The body must be sent with `Content-Type: application/json` (parameters "
                "such as `charset` allowed); any other type, or none, is answered 415 "
                "before the body is read; a body over 16 MiB (declared or chunked) is answered "
                "413 and the connection closed. Commands whose subsystem is not built answer "
                "501 unsupported; params are validated (400) before that. The endpoint "
                "takes no query parameters (400)."
            ),
            "tags": ["commands"],
            "requestBody": {
                "required": True,
                "content": {_JSON: {"schema": ref("CommandRequest")}},
            },
            "responses": _responses(
                {"200": _ok(command_result, "The command's result.")},
                400,
                404,
                409,
                413,
                415,
                501,
            ),
        },
        "options": _options("optionsExecuteCommand"),
    }
    paths["/metrics"] = {
        "get": {
            "operationId": "getMetrics",
            "summary": "The engine's metrics for Prometheus (raw, not enveloped).",
            "description": (
                "Prometheus text format 0.0.4; OpenMetrics 1.0 when `Accept` asks for "
                "`application/openmetrics-text`. Needs the read permission. Takes no query "
                "parameters (400). The metrics are listed in the README."
            ),
            "tags": ["meta"],
            "responses": _responses(
                {
                    "200": {
                        "description": "One scrape.",
                        "headers": _header_refs("AccessControlAllowOrigin"),
                        "content": {
                            "text/plain": {"schema": string()},
                            "application/openmetrics-text": {"schema": string()},
                        },
                    }
                },
                400,
            ),
        },
        "options": _options("optionsGetMetrics"),
    }
    paths[f"{PREFIX}/openapi.json"] = {
        "get": {
            "operationId": "getOpenApi",
            "summary": "This document (raw, not enveloped).",
            "description": "Takes no query parameters (400).",
            "tags": ["meta"],
            "responses": _responses(
                {
                    "200": {
                        "description": "The OpenAPI 3.1 document.",
                        "headers": _header_refs("AccessControlAllowOrigin"),
                        "content": {
                            _JSON: {
                                "schema": {
                                    "type": "object",
                                    "required": ["openapi", "info", "paths", "components"],
                                    "properties": {"openapi": const(OPENAPI_VERSION)},
                                }
                            }
                        },
                    }
                },
                400,
            ),
        },
        "options": _options("optionsGetOpenApi"),
    }
    return paths


def _components(command_components: dict[str, Schema], command_request: Schema) -> Schema:
    schemas: dict[str, Schema] = {
        "ApiError": _API_ERROR,
        **{f"{name}Envelope": error_envelope(s) for s, (name, _) in _ERROR_RESPONSES.items()},
        "PreflightEnvelope": success_envelope(obj({})),
        "Permission": enum(PERMISSIONS),
        "ModeKind": MODE_KIND,
        "EventType": enum(EVENT_TYPES),
        "CommandMethod": enum(COMMANDS),
        **resource_schemas(),
        "CommandRequest": command_request,
        **command_components,
    }
    return {
        "schemas": schemas,
        "responses": {name: _error_response(s) for s, (name, _) in _ERROR_RESPONSES.items()},
        "headers": _HEADERS,
        "securitySchemes": {
            "bearer": {
                "type": "http",
                "scheme": "bearer",
                "description": "Authorization: Bearer <key>.",
            },
            "apiKey": {
                "type": "apiKey",
                "in": "header",
                "name": "X-Service-Api-Key",
                "description": "The same key in a header of its own.",
            },
        },
    }


_DESCRIPTION = (
    "The reference in prose is in the project's docs/: http-api.md (this API), "
    "commands.md (every command), events.md (every event and its payload), "
    "security.md (keys, permissions, browser protection).\n\n"
    "Every response is the envelope {api_id, id, ok, result | error}, except the SSE "
    "stream and this document, and every response carries "
    "`Access-Control-Allow-Origin: *`. "
    "An engine with no API key configured needs no authentication; otherwise send the "
    "key as a bearer token or in X-Service-Api-Key.\n\n"
    "Browser protection with no key configured (see docs/security.md): anyone who can "
    "reach the port may call the API, so a web page must not be able to call it through "
    "a visitor's browser. Every request, CORS preflights included, is refused with 403 "
    "permission_denied when (1) its `Host` names neither the listen address nor a "
    "loopback name (`localhost`, `*.localhost`, 127.0.0.0/8, `[::1]`; any IP literal "
    "when the API listens on a wildcard address), or names another port than the bound "
    "one (no port means 80): this stops DNS rebinding; (2) its `Origin` is present and "
    "is not `http://` followed by that `Host` (compared without case; `Origin: null` is "
    "refused); (3) its `Sec-Fetch-Site` is present and is neither `same-origin` nor "
    "`none`. Requests without these headers (curl, scripts) are unaffected. With a key "
    "configured none of these checks apply: cross-origin callers that hold a key work.\n\n"
    "Whatever the keys, `POST /api/v1/commands` needs `Content-Type: application/json` "
    "(415 invalid_argument otherwise, field_path `Content-Type`), the one body type a "
    "browser will not send cross-origin without a preflight. No endpoint ignores a "
    "query parameter: one it does not declare, or one given twice, is 400 "
    "invalid_argument with the parameter's name as field_path."
)


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1.0 document of every control API endpoint.

    A fresh tree on every call: the helpers share small schema dicts, so the
    result is deep-copied and a caller may mutate it freely.
    """
    command_components, command_request, command_result = _command_schemas()
    document = {
        "openapi": OPENAPI_VERSION,
        "jsonSchemaDialect": "https://spec.openapis.org/oas/3.1/dialect/base",
        "info": {
            "title": "spliceway control API",
            "version": "1",
            "description": _DESCRIPTION,
        },
        "servers": [{"url": "/"}],
        "security": _SECURITY,
        "tags": [
            {"name": "queries", "description": "Read-only resources (read permission)."},
            {"name": "commands", "description": "The command table (per-method permission)."},
            {"name": "events", "description": "The live event stream."},
            {"name": "meta", "description": "This document."},
            {"name": "cors", "description": "CORS preflight."},
        ],
        "paths": _paths(command_result),
        "components": _components(command_components, command_request),
    }
    return copy.deepcopy(document)
