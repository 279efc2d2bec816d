"""Share-link lists (subscriptions that are not Clash YAML) read into Clash proxy mappings.

A subscription body is either base64 of the whole list (standard or URL-safe alphabet,
with or without padding, line breaks ignored) or the list itself, one link per line.
:func:`parse_links` reads it as mihomo's ``common/convert/converter.go``
``ConvertsV2Ray`` does and returns the Clash proxy mappings (the same keys mihomo
builds, so :func:`spliceway.clash.proxies.convert_proxy` takes them) and the lines it
could not read, each with the reason.

Schemes: ``ss://`` (SIP002 ``method:password`` in base64 or percent-encoded userinfo,
with ``?plugin=``, and the legacy form with everything in base64), ``ssr://``,
``vmess://`` (v2rayN's base64 JSON, version 2, or Xray's URL form), ``vless://``,
``trojan://``, ``hysteria://``, ``hysteria2://``/``hy2://``, ``tuic://``,
``socks://``/``socks5://``/``socks5h://`` (userinfo plain or base64 ``user:pass``) and
``http://``/``https://`` (``https`` is an HTTP proxy over TLS). The ``#fragment`` is
the name, URL-decoded; a repeated name gets ``-01``, ``-02``... as in mihomo; a link
without one is named ``server:port``.

Where this differs from mihomo: a line it cannot read is reported rather than dropped
silently; an ``ss://`` plugin mihomo does not recognise is kept as ``plugin`` (so it is
reported as unsupported) instead of being dropped, which would leave a proxy that
cannot work; WebSocket options get no random ``User-Agent``.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = [
    "LINK_SCHEMES",
    "LinkSkipped",
    "Links",
    "decode_base64",
    "decode_body",
    "looks_like_links",
    "parse_links",
]

#: The schemes :func:`parse_links` reads (lower case).
LINK_SCHEMES = frozenset(
    {
        "ss",
        "ssr",
        "vmess",
        "vless",
        "trojan",
        "hysteria",
        "hysteria2",
        "hy2",
        "tuic",
        "socks",
        "socks5",
        "socks5h",
        "http",
        "https",
    }
)

_B64_CHARS = re.compile(r"[A-Za-z0-9+/\-_]*=*")
_WS = re.compile(r"[\r\n\t ]")


@dataclass(frozen=True, slots=True)
class LinkSkipped:
    """A line not read: its number in the (decoded) list, its scheme (empty when it has
    none) and why."""

    line: int
    scheme: str
    reason: str


@dataclass(frozen=True, slots=True)
class Links:
    """The proxies read (Clash mappings), the lines skipped, and whether the body was
    base64."""

    proxies: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[LinkSkipped] = field(default_factory=list)
    base64: bool = False


class _Bad(Exception):
    """The line cannot be read, for this reason."""


def decode_base64(text: str | bytes) -> bytes | None:
    """``text`` decoded as base64 in either alphabet, padded or not, with line breaks and
    spaces ignored; ``None`` when it is not base64."""
    if isinstance(text, bytes):
        try:
            text = text.decode("ascii")
        except UnicodeDecodeError:
            return None
    compact = _WS.sub("", text)
    if not compact or not _B64_CHARS.fullmatch(compact):
        return None
    core = compact.rstrip("=")
    if len(core) % 4 == 1:
        return None
    padded = core.replace("-", "+").replace("_", "/") + "=" * (-len(core) % 4)
    try:
        return base64.b64decode(padded, validate=True)
    except (binascii.Error, ValueError):
        return None


def decode_body(data: str | bytes) -> tuple[str, bool]:
    """A subscription body as text: decoded when the whole of it is base64 of UTF-8 text
    (then ``True``), else as it is (``False``)."""
    decoded = decode_base64(data)
    if decoded is not None:
        try:
            return decoded.decode("utf-8-sig"), True
        except UnicodeDecodeError:
            pass
    if isinstance(data, bytes):
        return data.decode("utf-8-sig", errors="replace"), False
    return data, False


def looks_like_links(data: str | bytes) -> bool:
    """Whether ``data`` (decoded if base64) has at least one line with a scheme
    :func:`parse_links` reads."""
    text, _ = decode_body(data)
    for line in text.splitlines():
        scheme, sep, _ = line.strip().partition("://")
        if sep and scheme.lower() in LINK_SCHEMES:
            return True
    return False


@dataclass(frozen=True, slots=True)
class _Url:
    """A link split as Go's ``url.Parse`` splits it (host as written, not lower-cased)."""

    scheme: str
    userinfo: str | None
    host: str
    port: str
    query: dict[str, list[str]]
    fragment: str

    @property
    def username(self) -> str:
        if self.userinfo is None:
            return ""
        return unquote(self.userinfo.partition(":")[0])

    @property
    def password(self) -> str | None:
        if self.userinfo is None or ":" not in self.userinfo:
            return None
        return unquote(self.userinfo.partition(":")[2])

    def get(self, key: str) -> str:
        values = self.query.get(key)
        return values[0] if values else ""


def _split(line: str) -> _Url:
    try:
        parts = urlsplit(line)
    except ValueError as ex:
        raise _Bad(f"not a URL: {ex}") from None
    netloc = parts.netloc
    userinfo: str | None
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
    else:
        userinfo, hostport = None, netloc
    if hostport.startswith("["):
        end = hostport.find("]")
        if end < 0:
            raise _Bad("unclosed [ in the host")
        host, rest = hostport[1:end], hostport[end + 1 :]
        if rest and not rest.startswith(":"):
            raise _Bad("invalid port")
        port = rest[1:]
    else:
        host, _, port = hostport.rpartition(":") if ":" in hostport else (hostport, "", "")
    if port and not port.isdigit():
        raise _Bad(f"invalid port {port!r}")
    query = parse_qs(parts.query, keep_blank_values=True)
    return _Url(
        scheme=parts.scheme.lower(),
        userinfo=userinfo,
        host=host,
        port=port,
        query=query,
        fragment=unquote(parts.fragment, errors="replace"),
    )


def _require_host_port(url: _Url) -> None:
    if not url.host:
        raise _Bad("no server in the link")
    if not url.port:
        raise _Bad("no port in the link")


def _alpn(value: str) -> list[str]:
    return value.split(",")


def _bool(value: str) -> bool:
    # Go's strconv.ParseBool, errors read as false (mihomo ignores them).
    return value in ("1", "t", "T", "TRUE", "true", "True")


def _hysteria(line: str, body: str) -> dict[str, Any]:
    url = _split(line)
    return {
        "type": "hysteria",
        "server": url.host,
        "port": url.port,
        "sni": url.get("peer"),
        "obfs": url.get("obfs"),
        **({"alpn": _alpn(url.get("alpn"))} if url.get("alpn") else {}),
        "auth_str": url.get("auth"),
        "protocol": url.get("protocol"),
        "up": url.get("up") or url.get("upmbps"),
        "down": url.get("down") or url.get("downmbps"),
        "skip-cert-verify": _bool(url.get("insecure")),
        "_name": url.fragment,
    }


def _hysteria2(line: str, body: str) -> dict[str, Any]:
    url = _split(line)
    out: dict[str, Any] = {
        "type": "hysteria2",
        "server": url.host,
        "port": url.port or "443",
        "obfs": url.get("obfs"),
        "obfs-password": url.get("obfs-password"),
        "sni": url.get("sni"),
        "skip-cert-verify": _bool(url.get("insecure")),
        "fingerprint": url.get("pinSHA256"),
        "down": url.get("down"),
        "up": url.get("up"),
        "_name": url.fragment,
    }
    if url.get("alpn"):
        out["alpn"] = _alpn(url.get("alpn"))
    if url.userinfo:
        # mihomo takes the userinfo as written (url.User.String()).
        out["password"] = url.userinfo
    return out


def _tuic(line: str, body: str) -> dict[str, Any]:
    url = _split(line)
    out: dict[str, Any] = {
        "type": "tuic",
        "server": url.host,
        "port": url.port,
        "udp": True,
        "_name": url.fragment,
    }
    if url.password is not None:
        out["uuid"] = url.username
        out["password"] = url.password
    else:
        out["token"] = url.username
    if url.get("congestion_control"):
        out["congestion-controller"] = url.get("congestion_control")
    if url.get("alpn"):
        out["alpn"] = _alpn(url.get("alpn"))
    if url.get("sni"):
        out["sni"] = url.get("sni")
    if url.get("disable_sni") == "1":
        out["disable-sni"] = True
    if url.get("udp_relay_mode"):
        out["udp-relay-mode"] = url.get("udp_relay_mode")
    return out


def _trojan(line: str, body: str) -> dict[str, Any]:
    url = _split(line)
    out: dict[str, Any] = {
        "type": "trojan",
        "server": url.host,
        "port": url.port,
        "password": url.username,
        "udp": True,
        "skip-cert-verify": _bool(url.get("allowInsecure")),
        "_name": url.fragment,
    }
    if url.get("sni"):
        out["sni"] = url.get("sni")
    if url.get("alpn"):
        out["alpn"] = _alpn(url.get("alpn"))
    network = url.get("type").lower()
    if network:
        out["network"] = network
    if network == "ws":
        out["ws-opts"] = {"path": url.get("path"), "headers": {}}
    elif network == "grpc":
        out["grpc-opts"] = {"grpc-service-name": url.get("serviceName")}
    out["client-fingerprint"] = url.get("fp") or "chrome"
    return out


def _v_share(url: _Url, scheme: str) -> dict[str, Any]:
    """Xray's VLESS / VMessAEAD share-link standard (mihomo ``handleVShareLink``)."""
    _require_host_port(url)
    out: dict[str, Any] = {
        "type": scheme,
        "server": url.host,
        "port": url.port,
        "uuid": url.username,
        "udp": True,
        "_name": url.fragment,
    }
    security = url.get("security").lower()
    if security.endswith("tls") or security == "reality":
        out["tls"] = True
        out["client-fingerprint"] = url.get("fp") or "chrome"
        if url.get("alpn"):
            out["alpn"] = _alpn(url.get("alpn"))
    if url.get("sni"):
        out["servername"] = url.get("sni")
    if url.get("pbk"):
        out["reality-opts"] = {"public-key": url.get("pbk"), "short-id": url.get("sid")}
    encoding = url.get("packetEncoding")
    if encoding == "packet":
        out["packet-addr"] = True
    elif encoding != "none":
        out["xudp"] = True
    _v_transport(url, out)
    return out


def _v_transport(url: _Url, out: dict[str, Any]) -> None:
    """The ``network`` and its options of a VLESS / VMessAEAD link."""
    network = url.get("type").lower() or "tcp"
    fake = url.get("headerType").lower()
    if fake == "http":
        network = "http"
    elif network == "http":
        network = "h2"
    out["network"] = network
    if network == "tcp" and fake != "none":
        http_opts: dict[str, Any] = {"path": [url.get("path") or "/"], "headers": {}}
        if url.get("host"):
            http_opts["headers"]["Host"] = [url.get("host")]
        if url.get("method"):
            http_opts["method"] = url.get("method")
        out["http-opts"] = http_opts
    elif network == "http":
        h2: dict[str, Any] = {"path": [url.get("path") or "/"], "headers": {}}
        if url.get("host"):
            h2["host"] = [url.get("host")]
        out["h2-opts"] = h2
    elif network in ("ws", "httpupgrade"):
        ws: dict[str, Any] = {"path": url.get("path"), "headers": {"Host": url.get("host")}}
        early = url.get("ed")
        if early:
            if not early.isdigit():
                raise _Bad(f"bad WebSocket max early data size: {early!r}")
            if network == "ws":
                ws["max-early-data"] = int(early)
                ws["early-data-header-name"] = "Sec-WebSocket-Protocol"
            else:
                ws["v2ray-http-upgrade-fast-open"] = True
        if url.get("eh"):
            ws["early-data-header-name"] = url.get("eh")
        out["ws-opts"] = ws
    elif network == "grpc":
        out["grpc-opts"] = {"grpc-service-name": url.get("serviceName")}


def _vless(line: str, body: str) -> dict[str, Any]:
    url = _split(line)
    out = _v_share(url, "vless")
    if url.get("flow"):
        out["flow"] = url.get("flow").lower()
    return out


def _vmess_json(values: dict[str, Any]) -> dict[str, Any]:
    """v2rayN's vmess link (version 2): base64 of a JSON object."""
    name = values.get("ps")
    if not isinstance(name, str):
        raise _Bad("vmess JSON has no string 'ps' (name)")
    out: dict[str, Any] = {
        "type": "vmess",
        "server": values.get("add"),
        "port": values.get("port"),
        "uuid": values.get("id"),
        "alterId": values.get("aid", 0),
        "udp": True,
        "xudp": True,
        "tls": False,
        "skip-cert-verify": False,
        "cipher": values.get("scy") or "auto",
        "_name": name,
    }
    if values.get("sni"):
        out["servername"] = values["sni"]
    network = str(values.get("net") or "").lower()
    if values.get("type") == "http":
        network = "http"
    elif network == "http":
        network = "h2"
    out["network"] = network
    tls = values.get("tls")
    if isinstance(tls, str):
        if tls.lower().endswith("tls"):
            out["tls"] = True
        if isinstance(values.get("alpn"), str) and values["alpn"]:
            out["alpn"] = _alpn(values["alpn"])
    host = values.get("host")
    path = values.get("path")
    if network == "http":
        out["http-opts"] = {
            "path": [path or "/"],
            "headers": {"Host": [host]} if host else {},
        }
    elif network == "h2":
        out["h2-opts"] = {"path": path, "headers": {"Host": [host]} if host else {}}
    elif network in ("ws", "httpupgrade"):
        ws: dict[str, Any] = {"path": path or "/", "headers": {"Host": host} if host else {}}
        out["ws-opts"] = ws
    elif network == "grpc":
        out["grpc-opts"] = {"grpc-service-name": path}
    return out


def _vmess(line: str, body: str) -> dict[str, Any]:
    decoded = decode_base64(body.partition("#")[0])
    if decoded is None:
        out = _v_share(_split(line), "vmess")
        url = _split(line)
        out["alterId"] = 0
        out["cipher"] = url.get("encryption") or "auto"
        return out
    try:
        values = json.loads(decoded.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _Bad("vmess link is base64 but not of a JSON object") from None
    if not isinstance(values, dict):
        raise _Bad("vmess link is base64 but not of a JSON object")
    return _vmess_json(values)


_SS_PLUGINS = ("obfs", "v2ray-plugin")


def _ss(line: str, body: str) -> dict[str, Any]:
    head = body.partition("#")[0]
    fragment = unquote(body.partition("#")[2], errors="replace")
    if "@" not in head.partition("?")[0]:
        # Legacy: ss://BASE64(method:password@host:port)[#name]
        decoded = decode_base64(head.partition("?")[0])
        if decoded is None:
            raise _Bad("ss link has neither userinfo@host:port nor a base64 body")
        try:
            head = decoded.decode("utf-8") + ("?" + head.partition("?")[2] if "?" in head else "")
        except UnicodeDecodeError:
            raise _Bad("ss link's base64 body is not text") from None
    url = _split("ss://" + head)
    _require_host_port(url)
    if url.password is not None:
        cipher, password = url.username, url.password
    else:
        decoded = decode_base64(unquote(url.userinfo or ""))
        text = decoded.decode("utf-8", errors="replace") if decoded is not None else ""
        if ":" not in text:
            raise _Bad("ss link's userinfo is not method:password (plain or base64)")
        cipher, _, password = text.partition(":")
    out: dict[str, Any] = {
        "type": "ss",
        "server": url.host,
        "port": url.port,
        "cipher": cipher,
        "password": password,
        "udp": True,
        "_name": fragment,
    }
    if url.get("udp-over-tcp") == "true" or url.get("uot") == "1":
        out["udp-over-tcp"] = True
    plugin = url.get("plugin")
    if plugin:
        info = parse_qs("pluginName=" + plugin.replace(";", "&"), keep_blank_values=True)
        plugin_name = info.get("pluginName", [""])[0]

        def opt(key: str) -> str:
            return info.get(key, [""])[0]

        if "obfs" in plugin_name:
            out["plugin"] = "obfs"
            out["plugin-opts"] = {"mode": opt("obfs"), "host": opt("obfs-host")}
        elif "v2ray-plugin" in plugin_name:
            out["plugin"] = "v2ray-plugin"
            out["plugin-opts"] = {
                "mode": opt("mode"),
                "host": opt("host"),
                "path": opt("path"),
                "tls": "tls" in plugin,
            }
        else:
            out["plugin"] = plugin_name
    return out


def _url_safe_b64(text: str) -> str:
    decoded = decode_base64(text)
    return decoded.decode("utf-8", errors="replace") if decoded is not None else ""


def _ssr(line: str, body: str) -> dict[str, Any]:
    decoded = decode_base64(body)
    if decoded is None:
        raise _Bad("ssr link is not base64")
    text = decoded.decode("utf-8", errors="replace")
    before, sep, after = text.partition("/?")
    if not sep:
        raise _Bad("ssr link has no /? part")
    fields = before.split(":")
    if len(fields) != 6:
        raise _Bad("ssr link is not host:port:protocol:method:obfs:password")
    host, port, protocol, method, obfs, password = fields
    query = parse_qs(after.replace("+", "-").replace("/", "_"), keep_blank_values=True)

    def q(key: str) -> str:
        return query.get(key, [""])[0]

    out: dict[str, Any] = {
        "type": "ssr",
        "server": host,
        "port": port,
        "cipher": method,
        "password": _url_safe_b64(password),
        "obfs": obfs,
        "protocol": protocol,
        "udp": True,
        "_name": _url_safe_b64(q("remarks")),
    }
    if _url_safe_b64(q("obfsparam")):
        out["obfs-param"] = _url_safe_b64(q("obfsparam"))
    if q("protoparam"):
        out["protocol-param"] = q("protoparam")
    return out


def _user_pass(url: _Url) -> tuple[str, str]:
    """``user:pass`` userinfo, plain or (v2rayN) base64 of ``user:pass``."""
    if url.userinfo is None:
        return "", ""
    if url.password is not None:
        return url.username, url.password
    decoded = decode_base64(unquote(url.userinfo))
    if decoded is not None:
        text = decoded.decode("utf-8", errors="replace")
        if ":" in text:
            user, _, password = text.partition(":")
            return user, password
    return url.username, ""


def _socks(line: str, body: str) -> dict[str, Any]:
    url = _split(line)
    _require_host_port(url)
    user, password = _user_pass(url)
    out: dict[str, Any] = {
        "type": "socks5",
        "server": url.host,
        "port": url.port,
        "udp": True,
        "_name": url.fragment,
    }
    if user:
        out["username"] = user
        out["password"] = password
    return out


def _http(line: str, body: str) -> dict[str, Any]:
    url = _split(line)
    _require_host_port(url)
    user, password = _user_pass(url)
    out: dict[str, Any] = {
        "type": "http",
        "server": url.host,
        "port": url.port,
        "_name": url.fragment,
    }
    if url.scheme == "https":
        out["tls"] = True
        if url.get("sni"):
            out["sni"] = url.get("sni")
    if user:
        out["username"] = user
        out["password"] = password
    return out


_READERS: dict[str, Callable[[str, str], dict[str, Any]]] = {
    "ss": _ss,
    "ssr": _ssr,
    "vmess": _vmess,
    "vless": _vless,
    "trojan": _trojan,
    "hysteria": _hysteria,
    "hysteria2": _hysteria2,
    "hy2": _hysteria2,
    "tuic": _tuic,
    "socks": _socks,
    "socks5": _socks,
    "socks5h": _socks,
    "http": _http,
    "https": _http,
}


def _unique(names: dict[str, int], taken: set[str], name: str) -> str:
    """mihomo's ``uniqueName`` (the second ``x`` is ``x-01``, the third ``x-02``), and
    again on its result while that is already taken (mihomo would give a list with
    ``x``, ``x``, ``x-01`` two proxies named ``x-01``)."""
    while True:
        if name in names:
            names[name] += 1
            candidate = f"{name}-{names[name]:02d}"
        else:
            names[name] = 0
            candidate = name
        if candidate not in taken:
            taken.add(candidate)
            return candidate
        name = candidate


def parse_links(data: str | bytes) -> Links:
    """Every link of a share-link list (base64 as a whole, or plain lines) as a Clash
    proxy mapping, in order, and the lines that could not be read with the reason."""
    text, was_base64 = decode_body(data)
    result = Links(base64=was_base64)
    names: dict[str, int] = {}
    taken: set[str] = set()
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.rstrip(" \r").lstrip()
        if not line or line.startswith(("#", "//")):
            continue
        scheme, sep, body = line.partition("://")
        if not sep:
            result.skipped.append(LinkSkipped(number, "", "not a share link (no scheme://)"))
            continue
        scheme = scheme.lower()
        reader = _READERS.get(scheme)
        if reader is None:
            result.skipped.append(
                LinkSkipped(number, scheme, f"unknown share-link scheme {scheme}://")
            )
            continue
        try:
            proxy = reader(line, body)
        except _Bad as ex:
            result.skipped.append(LinkSkipped(number, scheme, str(ex)))
            continue
        name = str(proxy.pop("_name") or "")
        if not name:
            name = f"{proxy.get('server')}:{proxy.get('port')}"
        result.proxies.append({"name": _unique(names, taken, name), **proxy})
    return result
