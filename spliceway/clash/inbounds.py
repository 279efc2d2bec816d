"""mihomo's listening ports (``port``, ``socks-port``, ``mixed-port``, ``listeners``) as
spliceway inbounds.

``port`` is an ``http`` inbound, ``socks-port`` a ``socks5`` one, ``mixed-port`` a
``mixed`` one, tagged as mihomo names them for ``IN-NAME`` (``DEFAULT-HTTP``,
``DEFAULT-SOCKS``, ``DEFAULT-MIXED``); port 0 or none is no inbound, as in mihomo. They
listen on 127.0.0.1 unless ``allow-lan`` is true, then on ``bind-address`` (``*``, the
default, is every IPv4 address here: spliceway binds ``0.0.0.0``). ``authentication``
(``user:pass`` items) becomes their ``users``. Each ``listeners`` item of type
``http``, ``socks`` or ``mixed`` is an inbound tagged with its ``name`` (its own
``users``, or the global ones when it has none); its ``proxy`` (every connection to the
proxy or group named) becomes a rule on ``inbound_tag`` ahead of the others. The
:class:`InboundIndex` says which inbounds listen on which port, are of which mihomo
type, carry which name and which users exist, for ``IN-PORT``, ``IN-TYPE``,
``IN-NAME`` and ``IN-USER`` rules.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spliceway.clash.state import ImportState
from spliceway.clash.weak import (
    MISSING,
    WeakTypeError,
    lookup,
    unknown_keys,
    weak_bool,
    weak_int,
    weak_str,
)

__all__ = ["InboundIndex", "ListenerRoute", "convert_inbounds"]

#: The top-level port keys: (key, protocol, tag, mihomo inbound types).
_PORT_KEYS = (
    ("port", "http", "DEFAULT-HTTP", ("HTTP", "HTTPS")),
    ("socks-port", "socks5", "DEFAULT-SOCKS", ("SOCKS4", "SOCKS5")),
    ("mixed-port", "mixed", "DEFAULT-MIXED", ("HTTP", "HTTPS", "SOCKS4", "SOCKS5")),
)
_LISTENER_TYPES = {
    "http": ("http", ("HTTP", "HTTPS")),
    "socks": ("socks5", ("SOCKS4", "SOCKS5")),
    "mixed": ("mixed", ("HTTP", "HTTPS", "SOCKS4", "SOCKS5")),
}
_LISTENER_KEYS = ("name", "type", "listen", "port", "users", "udp", "rule", "proxy")


@dataclass(slots=True)
class InboundIndex:
    """The imported inbounds as inbound-dependent rules see them."""

    by_port: dict[int, list[str]] = field(default_factory=dict)
    by_type: dict[str, list[str]] = field(default_factory=dict)
    by_name: dict[str, str] = field(default_factory=dict)
    users: dict[str, str] = field(default_factory=dict)
    #: Whether a ``mixed`` inbound exists (its connections are both HTTP and SOCKS).
    has_mixed: bool = False


@dataclass(frozen=True, slots=True)
class ListenerRoute:
    """A listener's ``proxy``: every flow on inbound ``tag`` goes to Clash ``target``."""

    path: str
    tag: str
    target: str


def _address(doc: Mapping[str, Any], state: ImportState) -> str:
    allow_lan = doc.get("allow-lan")
    if not isinstance(allow_lan, bool) or not allow_lan:
        return "127.0.0.1"
    bind = doc.get("bind-address", "*")
    if bind in (None, "", "*"):
        state.report.add(
            "changed",
            "bind-address",
            "",
            "inbounds listen on 0.0.0.0",
            "mihomo's `*` is every IPv4 and IPv6 address; spliceway binds IPv4 only",
        )
        return "0.0.0.0"
    try:
        return str(ipaddress.ip_address(str(bind)))
    except ValueError:
        state.report.add(
            "changed",
            "bind-address",
            str(bind),
            "inbounds listen on 0.0.0.0",
            f"{bind!r} is not an IP address",
        )
        return "0.0.0.0"


def _credential_ok(text: str) -> bool:
    return 1 <= len(text.encode("utf-8")) <= 255


def _users(
    items: list[tuple[str, Any, Any]], state: ImportState, index: InboundIndex
) -> list[dict[str, str]]:
    """``(path, username, password)`` items as inbound users; bad ones reported."""
    out: list[dict[str, str]] = []
    seen: set[str] = set()
    for path, raw_user, raw_password in items:
        try:
            user = weak_str(raw_user, "username")
            password = weak_str(raw_password, "password")
        except WeakTypeError as ex:
            state.report.add("skipped", path, "", "user", str(ex))
            continue
        why = ""
        if not _credential_ok(user) or not _credential_ok(password):
            why = "user name and password must each be 1..255 bytes in spliceway"
        elif ":" in user:
            why = "a user name with ':' cannot authenticate over HTTP (Basic)"
        elif user in seen:
            why = "the same user name twice (the first one is kept)"
        if why:
            state.report.add("skipped", path, user, "user", why)
            continue
        seen.add(user)
        index.users[user] = user
        out.append({"username": user, "password": password})
    return out


def _global_users(doc: Mapping[str, Any], state: ImportState, index: InboundIndex) -> list[Any]:
    raw = doc.get("authentication")
    if raw is None:
        return []
    if not isinstance(raw, list):
        state.report.add("skipped", "authentication", "", "users", "must be a list of user:pass")
        return []
    items: list[tuple[str, Any, Any]] = []
    for i, entry in enumerate(raw):
        path = f"authentication[{i}]"
        if not isinstance(entry, str) or ":" not in entry:
            # mihomo drops an item without ':' silently.
            state.report.add("skipped", path, "", "user", "not user:pass (mihomo ignores it)")
            continue
        user, _, password = entry.partition(":")
        items.append((path, user, password))
    users = _users(items, state, index)
    if users:
        state.report.add("converted", "authentication", "", f"{len(users)} users on every inbound")
    skip = doc.get("skip-auth-prefixes")
    if skip:
        state.report.add(
            "skipped",
            "skip-auth-prefixes",
            "",
            "clients from these networks still authenticate",
            "spliceway inbounds have no authentication exemptions",
        )
    return users


def _port(value: Any, path: str, state: ImportState) -> int | None:
    try:
        port = weak_int(value, path)
    except WeakTypeError as ex:
        state.report.add("skipped", path, "", "no inbound", str(ex))
        return None
    if port == 0:
        return None
    if not 1 <= port <= 65535:
        state.report.add("skipped", path, "", "no inbound", f"port {port} is not 1..65535")
        return None
    return port


def _record(
    index: InboundIndex, tag: str, port: int, types: tuple[str, ...], protocol: str
) -> None:
    index.by_port.setdefault(port, []).append(tag)
    for kind in types:
        index.by_type.setdefault(kind, []).append(tag)
    if protocol == "mixed":
        index.has_mixed = True


def _listener_options(
    item: Mapping[Any, Any],
    path: str,
    name: str,
    protocol: str,
    inbound: dict[str, Any],
    state: ImportState,
    index: InboundIndex,
    global_users: list[Any],
) -> None:
    """A listener's ``users`` (absent: the global ones; empty: none) and ``udp``."""
    raw_users = lookup(item, "users")
    if raw_users is MISSING:
        if global_users:
            inbound["users"] = global_users
    elif isinstance(raw_users, list):
        items = [
            (f"{path}.users[{j}]", lookup(u, "username"), lookup(u, "password"))
            for j, u in enumerate(raw_users)
            if isinstance(u, Mapping)
        ]
        users = _users(items, state, index)
        if users:
            inbound["users"] = users
    if protocol != "http":
        udp = lookup(item, "udp")
        try:
            if udp is not MISSING and not weak_bool(udp, "udp"):
                inbound["udp"] = False
        except WeakTypeError as ex:
            state.report.add("skipped", f"{path}.udp", name, "udp", str(ex))


def _listener(
    i: int,
    item: Any,
    state: ImportState,
    index: InboundIndex,
    global_users: list[Any],
    taken: set[str],
    routes: list[ListenerRoute],
) -> dict[str, Any] | None:
    path = f"listeners[{i}]"
    if not isinstance(item, Mapping):
        state.report.add("skipped", path, "", "listener", "must be a mapping")
        return None
    ltype = item.get("type")
    name_value = lookup(item, "name")
    name = str(name_value) if name_value is not MISSING else ""
    if not isinstance(ltype, str) or ltype not in _LISTENER_TYPES:
        state.report.add(
            "skipped",
            path,
            name,
            f"{ltype} listener",
            "spliceway inbounds are http, socks5 and mixed only",
        )
        return None
    protocol, types = _LISTENER_TYPES[ltype]
    if not name:
        state.report.add("skipped", path, "", f"{ltype} listener", "key 'name' missing")
        return None
    raw_port = lookup(item, "port")
    if raw_port is MISSING:
        state.report.add("skipped", path, name, f"{ltype} listener", "no port")
        return None
    # A listener's port 0 is one the system chooses (mihomo's top-level 0 is "off").
    port = 0 if raw_port in (0, "0") else _port(raw_port, f"{path}.port", state)
    if port is None:
        return None
    listen = lookup(item, "listen")
    address = "0.0.0.0" if listen is MISSING or listen == "" else str(listen)
    try:
        address = str(ipaddress.ip_address(address))
    except ValueError:
        state.report.add(
            "changed", f"{path}.listen", name, "listens on 0.0.0.0", f"{listen!r} is not an IP"
        )
        address = "0.0.0.0"
    tag = name
    n = 1
    while tag in taken:
        n += 1
        tag = f"{name} ({n})"
    taken.add(tag)
    inbound: dict[str, Any] = {
        "tag": tag,
        "protocol": protocol,
        "listen": {"address": address, "port": port},
    }
    _listener_options(item, path, name, protocol, inbound, state, index, global_users)
    if lookup(item, "rule") is not MISSING:
        state.report.add(
            "skipped",
            f"{path}.rule",
            name,
            "the listener's sub-rules",
            "spliceway has no sub-rule lists: its flows follow the main rules",
        )
    proxy = lookup(item, "proxy")
    if proxy is not MISSING:
        routes.append(ListenerRoute(f"{path}.proxy", tag, str(proxy)))
    for key in unknown_keys(item, _LISTENER_KEYS):
        state.report.add(
            "skipped", f"{path}.{key}", name, "listener option", "not carried by spliceway"
        )
    index.by_name[name] = tag
    _record(index, tag, port, types, protocol)
    state.report.add("converted", path, name, f"{protocol} inbound {tag!r} on {address}:{port}")
    return inbound


def convert_inbounds(
    doc: Mapping[str, Any], state: ImportState
) -> tuple[list[dict[str, Any]], InboundIndex, list[ListenerRoute]]:
    """The inbounds of ``doc`` (see the module), the index for inbound rules, and the
    listeners' ``proxy`` routes."""
    index = InboundIndex()
    users = _global_users(doc, state, index)
    address = _address(doc, state)
    inbounds: list[dict[str, Any]] = []
    taken: set[str] = set()
    for key, protocol, tag, types in _PORT_KEYS:
        if key not in doc or doc[key] is None:
            continue
        port = _port(doc[key], key, state)
        if port is None:
            continue
        inbound: dict[str, Any] = {
            "tag": tag,
            "protocol": protocol,
            "listen": {"address": address, "port": port},
        }
        if users:
            inbound["users"] = users
        inbounds.append(inbound)
        taken.add(tag)
        index.by_name[tag] = tag
        _record(index, tag, port, types, protocol)
        state.report.add("converted", key, "", f"{protocol} inbound {tag!r} on {address}:{port}")
    routes: list[ListenerRoute] = []
    listeners = doc.get("listeners")
    if isinstance(listeners, list):
        for i, item in enumerate(listeners):
            inbound_or_none = _listener(i, item, state, index, users, taken, routes)
            if inbound_or_none is not None:
                inbounds.append(inbound_or_none)
    elif listeners is not None:
        state.report.add("skipped", "listeners", "", "listeners", "must be a list")
    return inbounds, index, routes
