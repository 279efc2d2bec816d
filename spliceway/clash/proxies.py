"""One Clash proxy (a mapping of ``proxies:``) as a spliceway outbound, or why not.

:func:`convert_proxy` reads a mapping as mihomo's ``adapter/parser.go`` does (weak
typing: ``port: "443"`` is 443; keys case-insensitive, ``_`` as ``-``) and returns
:class:`Converted` (the outbound, and what behaves differently in spliceway) or
:class:`Skipped` (name, type and the reason). It never raises on bad input.

What is carried: ``ss`` with the AEAD ciphers spliceway's ``shadowsocks`` outbound has
(``aes-128-gcm``, ``aes-256-gcm``, ``chacha20-ietf-poly1305``) and no plugin; ``socks5``
and ``http`` without TLS (and with TLS once their outbounds take ``tls``); ``direct``
and ``reject`` proxies (as ``direct`` and ``block`` outbounds). Every other type, cipher
or plugin is skipped with the reason. Settings spliceway has no equivalent for (``udp``
off, ``ip-version``, ``interface-name``, ``routing-mark``, ``tfo``, ``mptcp``, ``smux``,
``udp-over-tcp``, HTTP ``headers``) are reported as :class:`Change`; ``dialer-proxy`` is
returned for the importer to build a chain from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, get_args

from spliceway.clash.weak import (
    MISSING,
    WeakTypeError,
    lookup,
    unknown_keys,
    weak_bool,
    weak_int,
    weak_str,
)
from spliceway.config import validate_document
from spliceway.config.models_outbounds import AnyOutbound

__all__ = [
    "SUPPORTED_SS_CIPHERS",
    "Change",
    "Converted",
    "Skipped",
    "convert_proxy",
    "outbound_protocols",
]

#: The Shadowsocks ciphers spliceway's ``shadowsocks`` outbound speaks.
SUPPORTED_SS_CIPHERS = frozenset({"aes-128-gcm", "aes-256-gcm", "chacha20-ietf-poly1305"})

#: Every key a proxy of any type reads (``adapter/outbound/base.go`` ``BasicOption``).
_BASIC_KEYS = (
    "name",
    "type",
    "server",
    "port",
    "udp",
    "tfo",
    "mptcp",
    "interface-name",
    "routing-mark",
    "ip-version",
    "dialer-proxy",
    "smux",
)
_KEYS: dict[str, tuple[str, ...]] = {
    "ss": (
        "password",
        "cipher",
        "plugin",
        "plugin-opts",
        "udp-over-tcp",
        "udp-over-tcp-version",
        "client-fingerprint",
    ),
    "socks5": ("username", "password", "tls", "skip-cert-verify", "fingerprint"),
    "http": ("username", "password", "tls", "sni", "skip-cert-verify", "fingerprint", "headers"),
    "direct": (),
    "reject": (),
}

#: Types mihomo has and spliceway does not carry (``adapter/parser.go``), with why.
_NOT_CARRIED: dict[str, str] = {
    "ssr": "ShadowsocksR is not supported by spliceway",
    "vmess": "spliceway has no vmess outbound in this build",
    "vless": "spliceway has no vless outbound in this build",
    "trojan": "spliceway has no trojan outbound in this build",
    "hysteria": "Hysteria (v1) is not supported by spliceway",
    "hysteria2": "spliceway has no hysteria2 outbound in this build",
    "tuic": "spliceway has no tuic outbound in this build",
    "wireguard": "spliceway has no wireguard outbound in this build",
    "snell": "Snell is not supported by spliceway",
    "ssh": "spliceway has no ssh outbound",
    "mieru": "mieru is not supported by spliceway",
    "anytls": "AnyTLS is not supported by spliceway",
    "dns": "spliceway has no dns outbound (its DNS server is runtime.dns.listen)",
}


@dataclass(frozen=True, slots=True)
class Change:
    """A setting carried with a different meaning (or dropped while the proxy is kept):
    the Clash ``key`` and what differs."""

    key: str
    why: str


@dataclass(frozen=True, slots=True)
class Converted:
    """A proxy carried as ``outbound`` (a spliceway outbound entry, validated on its own),
    with its changes and the ``dialer_proxy`` it names (``None``: none)."""

    name: str
    type: str
    outbound: dict[str, Any]
    changes: tuple[Change, ...] = field(default=())
    dialer_proxy: str | None = None


@dataclass(frozen=True, slots=True)
class Skipped:
    """A proxy not carried: its ``name`` (empty when it has none), ``type`` and why."""

    name: str
    type: str
    reason: str


def outbound_protocols() -> dict[str, frozenset[str]]:
    """The outbound protocols of this build, each with the fields its entry takes."""
    out: dict[str, frozenset[str]] = {}
    for model in get_args(AnyOutbound):
        literal = model.model_fields["protocol"].annotation
        for protocol in get_args(literal):
            out[str(protocol)] = frozenset(model.model_fields)
    return out


_PROTOCOLS = outbound_protocols()


class _Skip(Exception):
    """Raised inside a converter: the proxy cannot be carried, for this reason."""


def _field(mapping: Mapping[Any, Any], key: str) -> Any:
    return lookup(mapping, key)


def _req_str(mapping: Mapping[Any, Any], key: str) -> str:
    value = _field(mapping, key)
    if value is MISSING:
        raise _Skip(f"key '{key}' missing")
    return weak_str(value, key)


def _opt_str(mapping: Mapping[Any, Any], key: str) -> str:
    value = _field(mapping, key)
    return "" if value is MISSING else weak_str(value, key)


def _opt_bool(mapping: Mapping[Any, Any], key: str) -> bool:
    value = _field(mapping, key)
    return False if value is MISSING else weak_bool(value, key)


def _server_port(mapping: Mapping[Any, Any]) -> tuple[str, int]:
    server = _req_str(mapping, "server").strip()
    value = _field(mapping, "port")
    if value is MISSING:
        raise _Skip("key 'port' missing")
    port = weak_int(value, "port")
    if not server:
        raise _Skip("server is empty")
    if not 1 <= port <= 65535:
        raise _Skip(f"port {port} is not 1..65535")
    return server, port


def _basic_changes(mapping: Mapping[Any, Any], changes: list[Change], udp_carried: bool) -> None:
    """The ``BasicOption`` settings (and ``udp``) spliceway does not carry as such."""
    udp = _opt_bool(mapping, "udp")
    if udp_carried and not udp:
        changes.append(
            Change(
                "udp",
                "udp is off in mihomo (UDP flows do not use this proxy there); spliceway "
                "relays UDP through it",
            )
        )
    if _opt_bool(mapping, "tfo"):
        changes.append(Change("tfo", "TCP Fast Open is not used by spliceway"))
    if _opt_bool(mapping, "mptcp"):
        changes.append(Change("mptcp", "Multipath TCP is not used by spliceway"))
    iface = _opt_str(mapping, "interface-name")
    if iface:
        changes.append(
            Change("interface-name", f"connections are not bound to interface {iface!r}")
        )
    mark = _field(mapping, "routing-mark")
    if mark is not MISSING and weak_int(mark, "routing-mark") != 0:
        changes.append(Change("routing-mark", "the routing mark (SO_MARK) is not set"))
    version = _opt_str(mapping, "ip-version").lower()
    if version not in ("", "dual"):
        changes.append(
            Change(
                "ip-version",
                f"ip-version {version} is not carried: the server's address is the first "
                "one runtime.dns gives",
            )
        )
    smux = _field(mapping, "smux")
    if isinstance(smux, Mapping) and _opt_bool(smux, "enabled"):
        changes.append(Change("smux", "multiplexing (sing-mux) is off: one connection per flow"))


def _check_tls(protocol: str, mapping: Mapping[Any, Any], name: str) -> dict[str, Any] | None:
    """The ``tls`` entry of a ``socks5``/``http`` proxy with ``tls: true``, when the
    outbound of this build takes one; skipped otherwise."""
    if "tls" not in _PROTOCOLS.get(protocol, frozenset()):
        raise _Skip(f"{protocol} over TLS is not supported by spliceway's {protocol} outbound")
    tls: dict[str, Any] = {"enabled": True}
    sni = _opt_str(mapping, "sni") if protocol == "http" else ""
    if sni:
        tls["server_name"] = sni
    if _opt_bool(mapping, "skip-cert-verify"):
        tls["insecure"] = True
    return tls


def _ss(mapping: Mapping[Any, Any], name: str, changes: list[Change]) -> dict[str, Any]:
    server, port = _server_port(mapping)
    password = _req_str(mapping, "password")
    cipher = _req_str(mapping, "cipher")
    plugin = _opt_str(mapping, "plugin")
    if plugin:
        raise _Skip(f"plugin {plugin!r} is not supported by spliceway's shadowsocks outbound")
    if cipher.startswith("2022-blake3-"):
        raise _Skip(
            f"cipher {cipher} (Shadowsocks 2022) is not supported by spliceway's shadowsocks "
            "outbound (aes-128-gcm, aes-256-gcm, chacha20-ietf-poly1305)"
        )
    if cipher not in SUPPORTED_SS_CIPHERS:
        raise _Skip(
            f"cipher {cipher!r} is not supported by spliceway's shadowsocks outbound "
            "(aes-128-gcm, aes-256-gcm, chacha20-ietf-poly1305)"
        )
    if not password:
        raise _Skip("password is empty")
    if _opt_bool(mapping, "udp-over-tcp"):
        changes.append(
            Change(
                "udp-over-tcp",
                "UDP over TCP is not used: spliceway sends UDP as Shadowsocks UDP packets",
            )
        )
    _basic_changes(mapping, changes, udp_carried=True)
    return {
        "tag": name,
        "protocol": "shadowsocks",
        "server": server,
        "port": port,
        "method": cipher,
        "password": password,
    }


def _socks5(mapping: Mapping[Any, Any], name: str, changes: list[Change]) -> dict[str, Any]:
    server, port = _server_port(mapping)
    username = _opt_str(mapping, "username")
    password = _opt_str(mapping, "password")
    out: dict[str, Any] = {"tag": name, "protocol": "socks5", "server": server, "port": port}
    if _opt_bool(mapping, "tls"):
        out["tls"] = _check_tls("socks5", mapping, name)
    if username:
        # mihomo authenticates whenever a username is set; RFC 1929 needs a password
        # of at least one byte, and so does spliceway's outbound.
        if not password:
            raise _Skip("username without a password: spliceway's socks5 outbound needs both")
        out["username"] = username
        out["password"] = password
    _basic_changes(mapping, changes, udp_carried=True)
    return out


def _http(mapping: Mapping[Any, Any], name: str, changes: list[Change]) -> dict[str, Any]:
    server, port = _server_port(mapping)
    username = _opt_str(mapping, "username")
    password = _opt_str(mapping, "password")
    out: dict[str, Any] = {"tag": name, "protocol": "http", "server": server, "port": port}
    if _opt_bool(mapping, "tls"):
        out["tls"] = _check_tls("http", mapping, name)
    if username:
        out["username"] = username
        out["password"] = password
    headers = _field(mapping, "headers")
    if isinstance(headers, Mapping) and headers:
        names = ", ".join(str(k) for k in headers)
        changes.append(Change("headers", f"extra CONNECT headers are not sent ({names})"))
    # mihomo's http proxy carries no UDP either: nothing changes there.
    _basic_changes(mapping, changes, udp_carried=False)
    return out


def _direct(mapping: Mapping[Any, Any], name: str, changes: list[Change]) -> dict[str, Any]:
    _basic_changes(mapping, changes, udp_carried=False)
    return {"tag": name, "protocol": "direct"}


def _reject(mapping: Mapping[Any, Any], name: str, changes: list[Change]) -> dict[str, Any]:
    return {"tag": name, "protocol": "block"}


_CONVERTERS: dict[str, Callable[[Mapping[Any, Any], str, list[Change]], dict[str, Any]]] = {
    "ss": _ss,
    "socks5": _socks5,
    "http": _http,
    "direct": _direct,
    "reject": _reject,
}


def _validated(outbound: dict[str, Any]) -> str | None:
    """Why spliceway refuses ``outbound`` on its own (``None``: it validates)."""
    # Under a neutral tag: the name is the importer's to fit among the others.
    details = validate_document({"outbounds": [{**outbound, "tag": "proxy"}]})
    if not details:
        return None
    return "; ".join(
        f"{d.field_path.removeprefix('outbounds[0].')}: {d.message}" if d.field_path else d.message
        for d in details
    )


def convert_proxy(mapping: Any) -> Converted | Skipped:
    """``mapping`` (one item of a Clash ``proxies:`` list) as a spliceway outbound
    whose tag is the proxy's name, or :class:`Skipped` with the reason. Unknown keys of
    a carried proxy are reported as changes (mihomo ignores them too)."""
    if not isinstance(mapping, Mapping):
        return Skipped("", "", "a proxy must be a mapping")
    ptype = mapping.get("type")
    name_value = lookup(mapping, "name")
    try:
        name = "" if name_value is MISSING else weak_str(name_value, "name")
    except WeakTypeError as ex:
        return Skipped("", str(ptype or ""), str(ex))
    # mihomo reads the type as written: a string, case-sensitive, no weak typing.
    if not isinstance(ptype, str):
        return Skipped(name, "", "missing type")
    if not name:
        return Skipped(
            name, ptype, "key 'name' missing" if name_value is MISSING else "name is empty"
        )
    if ptype in _NOT_CARRIED:
        return Skipped(name, ptype, _NOT_CARRIED[ptype])
    converter = _CONVERTERS.get(ptype)
    if converter is None:
        return Skipped(name, ptype, f"unsupported proxy type: {ptype} (mihomo refuses it too)")
    changes: list[Change] = []
    try:
        outbound = converter(mapping, name, changes)
        dialer = _opt_str(mapping, "dialer-proxy") or None
    except (_Skip, WeakTypeError) as ex:
        return Skipped(name, ptype, str(ex))
    refused = _validated(outbound)
    if refused is not None:
        return Skipped(name, ptype, f"not a valid spliceway outbound: {refused}")
    for key in unknown_keys(mapping, _BASIC_KEYS + _KEYS[ptype]):
        changes.append(Change(key, "unknown key, ignored (mihomo ignores it too)"))
    return Converted(name, ptype, outbound, tuple(changes), dialer)
