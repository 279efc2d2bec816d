"""The Clash API's plain HTTP routes (mihomo's ``hub/route``), over the command table.

Every route reads through ``ctx.plane.run_query`` and acts through
``ctx.plane.execute(..., transport="clash")``, so a dashboard's selector switch, mode
change or cache flush is the same command, with the same events, as an HTTP, IPC, CLI
or gRPC caller's. Both block (a delay test for seconds), so each route's work runs in
Starlette's thread pool, never on the listener's event loop. What the answers look
like is :mod:`.mapping`'s; docs/clash-api.md has the table of routes.

Errors are mihomo's ``{"message": ...}``: 400 for a body or parameter a route cannot
use (``Body invalid`` for malformed JSON, as mihomo), 404 ``Resource not found`` for an
unknown proxy or group, an engine error with its code's status (``invalid_argument``
400, ``not_found`` 404, ``conflict`` 409...). A request a route refuses changes nothing:
each validates everything it was given before its first command.

Proxy and group names are taken from the raw path, one segment each, percent-decoded
once (mihomo's ``getEscapeParam``), so a name holding ``/`` is reachable as ``%2F``
and the partly escaped names Yacd sends resolve as they do in mihomo.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import unquote

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from spliceway import __version__
from spliceway.api.clash import mapping
from spliceway.api.clash.context import ClashContext
from spliceway.api.clash.guard import NOT_FOUND
from spliceway.api.clash.mapping import GLOBAL, Observation
from spliceway.config import read_config_document
from spliceway.errors import ApiError

__all__ = ["GROUP_DELAY_CONCURRENCY", "http_routes"]

#: Members of a group a ``/group/{name}/delay`` probes at once.
GROUP_DELAY_CONCURRENCY = 8
#: Delay tests kept per proxy that no group lists (mihomo keeps 10 per proxy).
_HISTORY = 10
#: The longest delay test the engine runs (``diagnostics.probe_outbound``'s
#: ``timeout_ms``, mihomo's ``int16``).
_TIMEOUT_MAX_MS = 32767

BODY_INVALID = "Body invalid"
TIMEOUT = "Timeout"
DELAY_FAILED = "An error occurred in the delay test"
ALL_TIMEOUT = "get delay: all proxies timeout"
MUST_BE_SELECTOR = "Must be a Selector"

_SELECTABLE = frozenset({"selector", "url_test", "fallback"})
_PINNABLE = frozenset({"url_test", "fallback"})
#: A ``name`` that is mihomo's synthetic ``GLOBAL`` (not a configured tag).
_GLOBAL_KIND = "global"
_OUTBOUND_KIND = "outbound"
#: Go's ``strconv.ParseInt`` base 10: an optional sign and ASCII digits.
_GO_INT = re.compile(r"[+-]?[0-9]+")
#: Top-level keys of a Clash (mihomo) configuration that a spliceway document never has.
_CLASH_KEYS = frozenset(
    {"proxies", "proxy-groups", "proxy-providers", "rule-providers", "mixed-port",
     "socks-port", "port", "external-controller", "log-level", "allow-lan"}
)  # fmt: skip


def _no_content() -> Response:
    return Response(status_code=204)


_Handler = Callable[[Request, bytes | None], Response]


def _endpoint(handler: _Handler) -> Callable[[Request], Awaitable[Response]]:
    """An async endpoint that reads the body (the guard bounds it) and runs ``handler``
    in the thread pool. A handler's early answer is an ``HTTPException`` (status and
    message); it and an engine error are answered in mihomo's shape by the app's
    handlers (:func:`.guard.exception_handlers`)."""

    async def endpoint(request: Request) -> Response:
        body = await request.body() if request.method in ("PUT", "PATCH", "POST") else None
        return await run_in_threadpool(handler, request, body)

    return endpoint


def _json_object(body: bytes | None) -> dict[str, Any]:
    """The body as a JSON object, else 400 ``Body invalid``."""
    try:
        data = json.loads(body or b"")
    except (ValueError, UnicodeDecodeError):
        raise HTTPException(400, BODY_INVALID) from None
    if not isinstance(data, dict):
        raise HTTPException(400, BODY_INVALID)
    return data


def _go_int(text: str | None, bits: int) -> int:
    """``strconv.ParseInt(text, 10, bits)`` as mihomo's delay routes parse ``timeout``:
    a missing, malformed or out-of-range value is 400 ``Body invalid``."""
    if text is None or not _GO_INT.fullmatch(text):
        raise HTTPException(400, BODY_INVALID)
    value = int(text)
    if not -(1 << (bits - 1)) <= value < (1 << (bits - 1)):
        raise HTTPException(400, BODY_INVALID)
    return value


def _segments(request: Request, prefix: str) -> list[str]:
    """The raw path after ``prefix``, split at ``/``, each segment percent-decoded once
    (so ``%2F`` stays inside a name, as in mihomo)."""
    raw = request.scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, bytes) else request.url.path
    rest = path[len(prefix) :] if path.startswith(prefix) else ""
    parts = rest.split("/")
    if len(parts) > 1 and parts[-1] == "":
        parts.pop()  # a trailing slash
    # Bytes that are not UTF-8 name nothing that exists: replaced, then not found.
    return [unquote(p, errors="replace") for p in parts]


class _DelayLog:
    """The delay tests of proxies no group lists, by name (the engine keeps one latest
    health only for group members): what ``history`` shows for them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, deque[Observation]] = {}

    def record(self, name: str, seen: Observation) -> None:
        with self._lock:
            self._seen.setdefault(name, deque(maxlen=_HISTORY)).append(seen)

    def snapshot(self) -> dict[str, list[Observation]]:
        with self._lock:
            return {name: list(items) for name, items in self._seen.items()}


class _Routes:
    """The endpoints of one Clash listener."""

    def __init__(self, ctx: ClashContext) -> None:
        self.ctx = ctx
        self.delays = _DelayLog()

    # -- reading -------------------------------------------------------------------------

    def _query(self, name: str) -> dict[str, Any]:
        return self.ctx.plane.run_query(name)

    def _execute(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        return self.ctx.plane.execute(method, params, transport="clash")

    def _proxies(self, config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        return mapping.proxies(config, self.ctx.global_choice, self.delays.snapshot())

    @staticmethod
    def _kind(config: Mapping[str, Any], name: str) -> str | None:
        """``outbound``, the group's kind, ``global`` (mihomo's synthetic ``GLOBAL``), or
        None for a name that is none of these."""
        for group in config.get("outbound_groups") or []:
            if group["tag"] == name:
                return str(group["kind"])
        if any(o["tag"] == name for o in config.get("outbounds") or []):
            return _OUTBOUND_KIND
        if name == GLOBAL:
            return _GLOBAL_KIND
        return None

    @staticmethod
    def _group(config: Mapping[str, Any], name: str) -> Mapping[str, Any]:
        for group in config.get("outbound_groups") or []:
            if group["tag"] == name:
                return group
        raise HTTPException(404, NOT_FOUND)

    # -- / and /version ------------------------------------------------------------------

    def hello(self, request: Request, body: bytes | None) -> Response:
        # sing-box's answer: a browser goes to the dashboard when one is served.
        accept = request.headers.get("accept", "")
        if self.ctx.settings.external_ui and "text/html" in accept:
            return RedirectResponse("/ui/", status_code=307)
        return JSONResponse({"hello": "clash"})

    def version(self, request: Request, body: bytes | None) -> Response:
        return JSONResponse(mapping.version(__version__))

    # -- /configs ------------------------------------------------------------------------

    def _general(self, config: Mapping[str, Any]) -> dict[str, Any]:
        return mapping.general(config, self._query("runtime"), self._query("tun_status"))

    def get_configs(self, request: Request, body: bytes | None) -> Response:
        return JSONResponse(self._general(self._query("config")))

    def configs(self, request: Request, body: bytes | None) -> Response:
        if request.method == "GET":
            return self.get_configs(request, body)
        if request.method == "PATCH":
            return self.patch_configs(request, body)
        return self.put_configs(request, body)

    def patch_configs(self, request: Request, body: bytes | None) -> Response:
        data = _json_object(body)
        mode = data.pop("mode", None)
        if mode is not None:
            if not isinstance(mode, str) or mode.lower() not in mapping.MODES:
                raise HTTPException(400, f"mode must be one of {', '.join(mapping.MODES)}")
            mode = mode.lower()
        level = data.pop("log-level", None)
        if level is not None:
            if not isinstance(level, str) or level.lower() not in mapping.LOG_LEVELS:
                raise HTTPException(
                    400, f"log-level must be one of {', '.join(mapping.LOG_LEVELS)}"
                )
            level = mapping.LOG_LEVELS[level.lower()]
        config = self._query("config")
        if data:
            # What GET /configs says already holds is no change (a dashboard may send a
            # field back as it read it); anything else would need a new configuration.
            current = self._general(config)
            refused = [k for k, v in data.items() if k not in current or not _same(v, current[k])]
            if refused:
                raise HTTPException(
                    400,
                    f"spliceway cannot change {', '.join(refused)} over the Clash API (its "
                    "inbounds, TUN and resolver come from its configuration: change them "
                    "with config.apply or PUT /configs); nothing was changed",
                )
        if mode is not None:
            self._set_mode(config, mode)
        if level is not None:
            self._execute("log.set_level", {"level": level})
        return _no_content()

    def _set_mode(self, config: Mapping[str, Any], mode: str) -> None:
        """``mode.set``; mode global takes ``GLOBAL``'s member (its current one while
        already global, else the one a client picked, else ``route.final``)."""
        with self.ctx.lock:
            current = config.get("mode") or {}
            if mode == "global":
                outbound = mapping.global_now(config, self.ctx.global_choice)
                self._execute("mode.set", {"mode": "global", "outbound": outbound})
                self.ctx.global_choice = outbound
                return
            if current.get("kind") == "global" and current.get("outbound"):
                # GLOBAL keeps showing (and a later mode global takes) what it routed to.
                self.ctx.global_choice = str(current["outbound"])
            self._execute("mode.set", {"mode": mode})

    def put_configs(self, request: Request, body: bytes | None) -> Response:
        data = _json_object(body)
        path, payload = data.get("path", ""), data.get("payload", "")
        if not isinstance(path, str) or not isinstance(payload, str):
            raise HTTPException(400, BODY_INVALID)
        document = _document(payload) if payload else self._source_document(path)
        # Not written to the source file: mihomo loads a payload for this run only, and a
        # reloaded file is the source already.
        self._execute("config.apply_runtime", {"config": document})
        return _no_content()

    def _source_document(self, path: str) -> Any:
        """The running configuration's own file, read again (mihomo's reload)."""
        source = self._query("runtime").get("config_path")
        if not source:
            raise HTTPException(
                400,
                "the engine was started without a configuration file: send a spliceway "
                "configuration in payload",
            )
        if path:
            if not os.path.isabs(path):
                raise HTTPException(400, "path is not a absolute path")
            if os.path.realpath(path) != os.path.realpath(source):
                raise HTTPException(
                    400, f"spliceway reloads only its own configuration file ({source})"
                )
        try:
            return read_config_document(source)
        except ApiError as ex:
            raise HTTPException(400, ex.message) from ex

    # -- /proxies and /group -------------------------------------------------------------

    def list_proxies(self, request: Request, body: bytes | None) -> Response:
        return JSONResponse({"proxies": self._proxies(self._query("config"))})

    def proxy(self, request: Request, body: bytes | None) -> Response:
        parts = _segments(request, "/proxies/")
        if parts == [""] and request.method == "GET":
            return self.list_proxies(request, body)
        if len(parts) == 2 and parts[1] == "delay" and request.method == "GET":
            return self._proxy_delay(request, parts[0])
        if len(parts) != 1 or not parts[0]:
            raise HTTPException(404, NOT_FOUND)
        name = parts[0]
        config = self._query("config")
        kind = self._kind(config, name)
        if kind is None:
            raise HTTPException(404, NOT_FOUND)
        if request.method == "GET":
            return JSONResponse(self._proxies(config)[name])
        if request.method == "PUT":
            return self._select(config, name, kind, body)
        return self._unfix(name, kind)

    def _select(
        self, config: Mapping[str, Any], name: str, kind: str, body: bytes | None
    ) -> Response:
        data = _json_object(body)
        member = data.get("name")
        if not isinstance(member, str):
            raise HTTPException(400, BODY_INVALID)
        if kind == _GLOBAL_KIND:
            members = mapping.global_members(config)
        elif kind in _SELECTABLE:
            members = list(self._group(config, name).get("outbounds", []))
        else:
            raise HTTPException(400, MUST_BE_SELECTOR)
        if member not in members:
            raise HTTPException(400, f"Selector update error: {member!r} is not a member of {name}")
        if kind == _GLOBAL_KIND:
            with self.ctx.lock:
                if (config.get("mode") or {}).get("kind") == "global":
                    self._execute("mode.set", {"mode": "global", "outbound": member})
                self.ctx.global_choice = member
        else:
            self._execute("policies.select", {"policy_tag": name, "target_tag": member})
        return _no_content()

    def _unfix(self, name: str, kind: str) -> Response:
        if kind not in _PINNABLE:
            raise HTTPException(400, f"{name} is not a URLTest or Fallback group: it has no pin")
        self._execute("policies.unfix", {"policy_tag": name})
        return _no_content()

    def _probe(
        self, target: str, url: str, timeout_ms: int, expected: str
    ) -> tuple[dict[str, Any], bool]:
        """One ``diagnostics.probe_outbound`` through ``target``; the result and whether
        it ran out of time."""
        params: dict[str, Any] = {
            "target_tag": target,
            "timeout_ms": min(timeout_ms, _TIMEOUT_MAX_MS),
        }
        if url:
            params["url"] = url
        if expected:
            params["expected_status"] = expected
        started = time.monotonic()
        result = self._execute("diagnostics.probe_outbound", params)
        elapsed_ms = (time.monotonic() - started) * 1000
        # mihomo answers 504 when its context's deadline passed, whatever failed last.
        timed_out = bool(result.get("timed_out")) or (
            not result.get("reachable") and elapsed_ms >= timeout_ms
        )
        return result, timed_out

    def _record(self, name: str, result: Mapping[str, Any]) -> int:
        """Keep a delay test's outcome for ``name``'s history; its mihomo delay (0: failed)."""
        delay = mapping.delay_of(result.get("latency_ms")) if result.get("reachable") else 0
        url = result.get("url")
        self.delays.record(
            name, Observation(int(time.time() * 1000), delay, url if isinstance(url, str) else None)
        )
        return delay

    def _proxy_delay(self, request: Request, name: str) -> Response:
        config = self._query("config")
        kind = self._kind(config, name)
        if kind is None:
            raise HTTPException(404, NOT_FOUND)
        query = request.query_params
        timeout_ms = _go_int(query.get("timeout"), 16)
        if timeout_ms <= 0:
            raise HTTPException(504, TIMEOUT)
        target = name
        if kind == _GLOBAL_KIND:
            target = mapping.global_now(config, self.ctx.global_choice)
        result, timed_out = self._probe(
            target, query.get("url", ""), timeout_ms, query.get("expected", "")
        )
        delay = self._record(name, result)
        if timed_out:
            raise HTTPException(504, TIMEOUT)
        if not delay:
            raise HTTPException(503, DELAY_FAILED)
        return JSONResponse({"delay": delay})

    def list_groups(self, request: Request, body: bytes | None) -> Response:
        config = self._query("config")
        everything = self._proxies(config)
        names = mapping.group_names(config)
        if GLOBAL in everything and GLOBAL not in names:
            names.append(GLOBAL)
        return JSONResponse({"proxies": [everything[n] for n in names]})

    def group(self, request: Request, body: bytes | None) -> Response:
        parts = _segments(request, "/group/")
        if parts == [""]:
            return self.list_groups(request, body)
        if len(parts) > 2 or (len(parts) == 2 and parts[1] != "delay") or not parts[0]:
            raise HTTPException(404, NOT_FOUND)
        name = parts[0]
        config = self._query("config")
        kind = self._kind(config, name)
        if kind is None or kind == _OUTBOUND_KIND:
            raise HTTPException(404, NOT_FOUND)
        if len(parts) == 1:
            return JSONResponse(self._proxies(config)[name])
        return self._group_delay(request, config, name, kind)

    def _group_delay(
        self, request: Request, config: Mapping[str, Any], name: str, kind: str
    ) -> Response:
        query = request.query_params
        timeout_ms = _go_int(query.get("timeout"), 32)
        url, expected = query.get("url", ""), query.get("expected", "")
        if kind == _GLOBAL_KIND:
            members = mapping.global_members(config)
        else:
            group = self._group(config, name)
            members = list(group.get("outbounds", []))
            own = str(group.get("url") or "")
            # mihomo's URLTest group always tests through its own testUrl, whatever the
            # request's url; other groups use the request's, or without one their own.
            url = own if kind == "url_test" and own else (url or own)
        delays: dict[str, int] = {}
        if timeout_ms > 0 and members:
            workers = min(GROUP_DELAY_CONCURRENCY, len(members))
            with ThreadPoolExecutor(workers, thread_name_prefix="clash-group-delay") as pool:
                futures = {
                    m: pool.submit(self._probe, m, url, timeout_ms, expected) for m in members
                }
                # A bad url or expected fails every probe the same way: raised here,
                # before the pin below is touched.
                outcomes = {m: f.result()[0] for m, f in futures.items()}
            for member, result in outcomes.items():
                delay = self._record(member, result)
                if delay:
                    delays[member] = delay
        if kind in _PINNABLE:
            # mihomo's group test drops the group's pin: it chooses by its own rule again.
            self._execute("policies.unfix", {"policy_tag": name})
        if kind == "url_test":
            # The engine's delay tests inform readers only; a round makes the group choose.
            self._execute("policies.probe", {"policy_tag": name})
        if not delays:
            raise HTTPException(504, ALL_TIMEOUT)
        return JSONResponse(delays)

    # -- /rules, /providers --------------------------------------------------------------

    def rules(self, request: Request, body: bytes | None) -> Response:
        return JSONResponse({"rules": mapping.rules(self._query("config"))})

    def _proxy_providers(self) -> tuple[Mapping[str, Any], dict[str, dict[str, Any]]]:
        config = self._query("config")
        states = self._query("providers")["providers"]
        return config, mapping.proxy_providers(config, states, self._proxies(config))

    def list_proxy_providers(self, request: Request, body: bytes | None) -> Response:
        return JSONResponse({"providers": self._proxy_providers()[1]})

    def proxy_provider(self, request: Request, body: bytes | None) -> Response:
        parts = _segments(request, "/providers/proxies/")
        if not parts or not parts[0] or len(parts) > 3:
            raise HTTPException(404, NOT_FOUND)
        _, providers = self._proxy_providers()
        provider = providers.get(parts[0])
        if provider is None:
            raise HTTPException(404, NOT_FOUND)
        method = request.method
        if len(parts) == 1 and method == "GET":
            return JSONResponse(provider)
        if len(parts) == 1 and method == "PUT":
            # A Compatible provider (a group's own members, ``default``) has nothing to
            # update: mihomo answers 204 too.
            if provider["vehicleType"] != "Compatible":
                self._update(parts[0], "proxies")
            return _no_content()
        if method != "GET":
            raise HTTPException(405, "Method Not Allowed")
        members = [str(p["name"]) for p in provider["proxies"]]
        if parts[1:] == ["healthcheck"]:
            self._health_check(members, str(provider.get("testUrl") or ""))
            return _no_content()
        if parts[1] not in members or (len(parts) == 3 and parts[2] != "healthcheck"):
            raise HTTPException(404, NOT_FOUND)
        if len(parts) == 2:
            return JSONResponse(next(p for p in provider["proxies"] if p["name"] == parts[1]))
        return self._proxy_delay(request, parts[1])

    def _update(self, name: str, kind: str) -> None:
        """``providers.update`` of one provider; 503 with the reason when it failed, as
        mihomo answers a failed update."""
        for result in self._execute("providers.update", {"name": name, "kind": kind})["results"]:
            if result["outcome"] == "failed":
                raise HTTPException(503, str(result["error"]))

    def _health_check(self, members: list[str], url: str) -> None:
        """Probe every member now, each's result recorded as its latest health (mihomo's
        provider health check: 204 once done, whatever the members answered)."""
        if not members:
            return
        timeout_ms = int(mapping.PROVIDER_CHECK_TIMEOUT_MS)
        workers = min(GROUP_DELAY_CONCURRENCY, len(members))
        with ThreadPoolExecutor(workers, thread_name_prefix="clash-provider-check") as pool:
            futures = [pool.submit(self._probe, m, url, timeout_ms, "") for m in members]
            for member, future in zip(members, futures, strict=True):
                self._record(member, future.result()[0])

    def list_rule_providers(self, request: Request, body: bytes | None) -> Response:
        states = self._query("providers")["providers"]
        return JSONResponse({"providers": mapping.rule_providers(states)})

    def rule_provider(self, request: Request, body: bytes | None) -> Response:
        parts = _segments(request, "/providers/rules/")
        states = self._query("providers")["providers"]
        if len(parts) != 1 or parts[0] not in mapping.rule_providers(states):
            raise HTTPException(404, NOT_FOUND)
        self._update(parts[0], "rules")
        return _no_content()

    def update_geodata(self, request: Request, body: bytes | None) -> Response:
        states = self._query("providers")["providers"]
        if not any(s["kind"] == "geodata" for s in states):
            raise HTTPException(
                501,
                "spliceway downloads GeoIP and GeoSite databases only from "
                "runtime.geodata's geoip_url and geosite_url, and none is configured",
            )
        for result in self._execute("providers.update", {"kind": "geodata"})["results"]:
            if result["outcome"] == "failed":
                # mihomo: 500 with the error of a failed update.
                raise HTTPException(500, f"{result['name']}: {result['error']}")
        return _no_content()

    # -- /dns, /cache --------------------------------------------------------------------

    def dns_query(self, request: Request, body: bytes | None) -> Response:
        query = request.query_params
        params = {"name": query.get("name", ""), "type": query.get("type") or "A"}
        try:
            result = self._execute("diagnostics.dns_query", params)
        except ApiError as ex:
            if ex.code in ("unsupported", "feature_disabled"):
                raise HTTPException(500, ex.message) from ex  # mihomo: "DNS section is disabled"
            raise
        if result.get("error"):
            # Every server failed: mihomo answers its exchange error with 500.
            raise HTTPException(500, str(result["error"]))
        return JSONResponse(mapping.dns_answer(result))

    def flush_fakeip(self, request: Request, body: bytes | None) -> Response:
        self._execute("fakeip.clear", {})
        return _no_content()

    def flush_dns(self, request: Request, body: bytes | None) -> Response:
        self._execute("dns.cache_flush", {})
        return _no_content()


def _same(given: Any, current: Any) -> bool:
    """Whether a PATCH value says what GET /configs shows (an object: each key it names;
    no JSON ``true`` for a port 1)."""
    if isinstance(given, dict):
        return isinstance(current, dict) and all(
            k in current and _same(v, current[k]) for k, v in given.items()
        )
    return type(given) is type(current) and given == current


def _document(payload: str) -> Any:
    """A ``PUT /configs`` payload: a spliceway configuration as JSON or YAML text."""
    try:
        document = json.loads(payload)
    except ValueError:
        try:
            import yaml
        except ImportError:
            raise HTTPException(400, "payload is not JSON (YAML needs PyYAML)") from None
        try:
            # An alias repeats a subtree without its bytes: a small payload could stand
            # for a document too large to validate. Configurations do not need them.
            if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(payload)):
                raise HTTPException(400, "payload uses YAML aliases: write the document out")
            document = yaml.safe_load(payload)
        except yaml.YAMLError as ex:
            raise HTTPException(400, f"payload is neither JSON nor YAML: {ex}") from None
    if not isinstance(document, dict):
        raise HTTPException(400, "payload is not a configuration document (an object)")
    clash = sorted(_CLASH_KEYS.intersection(document))
    if clash:
        raise HTTPException(
            400,
            f"payload is a Clash configuration ({', '.join(clash)}): spliceway runs its own "
            "configuration format; convert it with `spliceway import clash FILE -o "
            "spliceway.json` (which also reports what it could not carry over) and send that",
        )
    return document


def _refusal(message: str) -> _Handler:
    """A route mihomo has and spliceway refuses: 501 with why (never a fake success)."""

    def refuse(request: Request, body: bytes | None) -> Response:
        raise HTTPException(501, message)

    return refuse


_REFUSALS: tuple[tuple[str, str, str], ...] = (
    (
        "/restart",
        "POST",
        "spliceway does not restart itself over the Clash API: restart its service, or "
        "reload its configuration with PUT /configs",
    ),
    (
        "/upgrade",
        "POST",
        "spliceway has no upgrade channel: upgrade the package it was installed from",
    ),
    (
        "/upgrade/ui",
        "POST",
        "spliceway does not download dashboards: api.clash.external_ui serves a directory "
        "you install",
    ),
    (
        "/rules/disable",
        "PATCH",
        "spliceway cannot disable single rules at run time: change its rules with config.apply",
    ),
)


def http_routes(ctx: ClashContext) -> list[BaseRoute]:
    """Every plain HTTP route of the Clash API."""
    api = _Routes(ctx)

    def route(path: str, handler: _Handler, *methods: str) -> Route:
        return Route(path, _endpoint(handler), methods=list(methods))

    routes: list[BaseRoute] = [
        route("/", api.hello, "GET"),
        route("/version", api.version, "GET"),
        route("/configs", api.configs, "GET", "PUT", "PATCH"),
        route("/proxies", api.list_proxies, "GET"),
        route("/proxies/{rest:path}", api.proxy, "GET", "PUT", "DELETE"),
        route("/group", api.list_groups, "GET"),
        route("/group/{rest:path}", api.group, "GET"),
        route("/rules", api.rules, "GET"),
        route("/providers/proxies", api.list_proxy_providers, "GET"),
        route("/providers/proxies/{rest:path}", api.proxy_provider, "GET", "PUT"),
        route("/providers/rules", api.list_rule_providers, "GET"),
        route("/providers/rules/{rest:path}", api.rule_provider, "PUT"),
        route("/upgrade/geo", api.update_geodata, "POST"),
        route("/configs/geo", api.update_geodata, "POST"),
        route("/dns/query", api.dns_query, "GET"),
        route("/cache/fakeip/flush", api.flush_fakeip, "POST"),
        route("/cache/dns/flush", api.flush_dns, "POST"),
    ]
    routes.extend(route(path, _refusal(message), method) for path, method, message in _REFUSALS)
    return routes
