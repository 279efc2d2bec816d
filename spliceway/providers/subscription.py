"""A proxy provider's body (a subscription) read into outbound entries, or refused.

:func:`parse_proxy_body` reads one body in one of three formats:

- ``clash``: a YAML document (YAML 1.2, as mihomo reads it) with a ``proxies:`` list of
  Clash proxies, each converted as the importer converts it;
- ``links``: share links (``ss://``, ``socks5://``, ``http(s)://``, ``trojan://``...), one
  per line, or the whole list base64-encoded, as subscription services send them;
- ``spliceway``: a JSON or YAML document with an ``outbounds`` list of spliceway outbound
  entries (``tag`` is the name).

With no format given it is detected as mihomo does (``adapter/provider/provider.go``
``NewProxiesParser``): a YAML mapping with ``proxies`` is ``clash`` (with ``outbounds``,
``spliceway``); anything else is read as links.

A proxy spliceway cannot carry (an unsupported type, cipher or plugin) is *skipped*
with its reason; the body is still good. A body is *refused* (:class:`BodyError`, and
the engine keeps the provider's last good copy) when it is not text, not a document of
its format, holds no proxy at all, or names two proxies alike or one not at all:
unlike mihomo, which keeps the first of two proxies of one name and drops nameless
ones, a subscription that does so is taken to be broken.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

from spliceway.clash import links as clash_links
from spliceway.clash import proxies as clash_proxies
from spliceway.clash import yaml12
from spliceway.config import validate_document

__all__ = [
    "BodyError",
    "Change",
    "ProxyContent",
    "ProxyEntry",
    "SkippedProxy",
    "SubscriptionInfo",
    "detect_format",
    "origin_of",
    "parse_proxy_body",
    "parse_userinfo",
]

Format = Literal["clash", "links", "spliceway"]


class BodyError(ValueError):
    """A body that cannot be a provider's content; the message says why."""


@dataclass(frozen=True, slots=True)
class ProxyEntry:
    """One proxy carried: its ``name`` and its spliceway outbound entry (without its tag,
    which the merge assigns)."""

    name: str
    outbound: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class SkippedProxy:
    """One proxy not carried: its name, its type (``""`` when unknown) and why."""

    name: str
    type: str
    reason: str


@dataclass(frozen=True, slots=True)
class Change:
    """A setting of a carried proxy that spliceway takes differently or drops."""

    name: str
    key: str
    why: str


@dataclass(frozen=True, slots=True)
class ProxyContent:
    """What a good body holds: the proxies carried and skipped, and the format read."""

    format: Format
    entries: tuple[ProxyEntry, ...] = ()
    skipped: tuple[SkippedProxy, ...] = ()
    changes: tuple[Change, ...] = field(default=())


def _text(body: bytes) -> str:
    try:
        text = body.decode("utf-8-sig")
    except UnicodeDecodeError as ex:
        raise BodyError(f"not UTF-8 text (byte {ex.start} is {body[ex.start]:#04x})") from None
    if "\x00" in text:
        raise BodyError("not text (it holds NUL bytes)")
    return text


def _looks_like_html(text: str) -> bool:
    head = text.lstrip()[:512].lower()
    return head.startswith(("<!doctype html", "<html", "<head", "<body", "<?xml")) or (
        "<html" in head
    )


def _load_yaml(text: str) -> Any:
    """The document, or None when the text is not YAML mihomo would read."""
    try:
        return yaml12.load(text)
    except (yaml12.YamlError, RecursionError):
        return None


def detect_format(text: str) -> Format:
    """The format of a body's text when none is configured (see the module docstring)."""
    doc = _load_yaml(text)
    if isinstance(doc, Mapping):
        if "proxies" in doc:
            return "clash"
        if "outbounds" in doc:
            return "spliceway"
    return "links"


def _checked_names(items: list[tuple[str, int]]) -> None:
    """Refuse a body that names a proxy twice or not at all (``(name, position)`` each)."""
    first: dict[str, int] = {}
    for name, position in items:
        if not name:
            raise BodyError(f"proxy #{position + 1} has no name")
        if name in first:
            raise BodyError(
                f"two proxies are named {name!r} (#{first[name] + 1} and #{position + 1})"
            )
        first[name] = position


def _from_clash(proxies: list[Any], fmt: Format) -> ProxyContent:
    """The content of a list of Clash proxy mappings."""
    if not proxies:
        raise BodyError("the `proxies` list is empty" if fmt == "clash" else "no proxy in it")
    entries: list[ProxyEntry] = []
    skipped: list[SkippedProxy] = []
    changes: list[Change] = []
    names: list[tuple[str, int]] = []
    for position, mapping in enumerate(proxies):
        result = clash_proxies.convert_proxy(mapping)
        names.append((result.name, position))
        if isinstance(result, clash_proxies.Skipped):
            skipped.append(SkippedProxy(result.name, result.type, result.reason))
            continue
        if result.dialer_proxy is not None:
            # A chain through another proxy or group cannot be kept as one outbound;
            # carrying the proxy without it would reach its server another way.
            skipped.append(
                SkippedProxy(
                    result.name,
                    result.type,
                    f"dialer-proxy {result.dialer_proxy!r}: a provider's proxy cannot be "
                    "chained through another outbound in this build",
                )
            )
            continue
        outbound = {k: v for k, v in result.outbound.items() if k != "tag"}
        entries.append(ProxyEntry(result.name, outbound))
        changes.extend(Change(result.name, c.key, c.why) for c in result.changes)
    _checked_names(names)
    return ProxyContent(fmt, tuple(entries), tuple(skipped), tuple(changes))


def _clash(text: str) -> ProxyContent:
    try:
        doc = yaml12.load(text)
    except (yaml12.YamlError, RecursionError) as ex:
        raise BodyError(f"not a YAML document: {ex}") from None
    if not isinstance(doc, Mapping) or "proxies" not in doc:
        raise BodyError(
            "no `proxies` list in the document (mihomo: file must have a `proxies` field)"
        )
    proxies = doc["proxies"]
    if not isinstance(proxies, list):
        raise BodyError("`proxies` is not a list")
    return _from_clash(proxies, "clash")


def _links(text: str) -> ProxyContent:
    parsed = clash_links.parse_links(text)
    if not parsed.proxies:
        if _looks_like_html(text):
            raise BodyError("an HTML page, not a subscription")
        if parsed.skipped:
            first = parsed.skipped[0]
            raise BodyError(
                f"no share link could be read ({len(parsed.skipped)} lines refused; "
                f"line {first.line}: {first.reason})"
            )
        raise BodyError("no share link in it")
    content = _from_clash(parsed.proxies, "links")
    skipped = [SkippedProxy("", f.scheme, f"line {f.line}: {f.reason}") for f in parsed.skipped]
    return ProxyContent("links", content.entries, (*content.skipped, *skipped), content.changes)


def _spliceway(text: str) -> ProxyContent:
    try:
        doc = yaml12.load(text)
    except (yaml12.YamlError, RecursionError) as ex:
        raise BodyError(f"not a JSON or YAML document: {ex}") from None
    if not isinstance(doc, Mapping) or not isinstance(doc.get("outbounds"), list):
        raise BodyError("no `outbounds` list in the document")
    items = doc["outbounds"]
    if not items:
        raise BodyError("the `outbounds` list is empty")
    entries: list[ProxyEntry] = []
    skipped: list[SkippedProxy] = []
    names: list[tuple[str, int]] = []
    for position, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise BodyError(f"outbound #{position + 1} is not an object")
        tag = item.get("tag")
        name = tag if isinstance(tag, str) else ""
        names.append((name, position))
        protocol = item.get("protocol")
        details = validate_document({"outbounds": [dict(item)]})
        if details:
            why = "; ".join(
                f"{d.field_path.removeprefix('outbounds[0].')}: {d.message}"
                if d.field_path
                else d.message
                for d in details
            )
            skipped.append(SkippedProxy(name, str(protocol or ""), why))
            continue
        entries.append(ProxyEntry(name, {k: v for k, v in item.items() if k != "tag"}))
    _checked_names(names)
    return ProxyContent("spliceway", tuple(entries), tuple(skipped))


def parse_proxy_body(body: bytes, fmt: Format | None = None) -> ProxyContent:
    """The content of a proxy provider's ``body`` read as ``fmt`` (None: detected).

    Raises :class:`BodyError` for a body that cannot be the provider's content (see the
    module docstring); never anything else for any input.
    """
    text = _text(body)
    if not text.strip():
        raise BodyError("empty")
    chosen = fmt or detect_format(text)
    if chosen == "clash":
        return _clash(text)
    if chosen == "spliceway":
        return _spliceway(text)
    return _links(text)


@dataclass(frozen=True, slots=True)
class SubscriptionInfo:
    """The ``subscription-userinfo`` header: bytes used and allowed, and the expiry
    (UNIX seconds; 0 when not given), as mihomo reads it (``subscription_info.go``)."""

    upload: int = 0
    download: int = 0
    total: int = 0
    expire: int = 0

    def to_dict(self) -> dict[str, int]:
        """``{upload, download, total, expire}``."""
        return {
            "upload": self.upload,
            "download": self.download,
            "total": self.total,
            "expire": self.expire,
        }


def _number(value: str) -> int | None:
    try:
        return int(value, 10)
    except ValueError:
        pass
    try:
        number = float(value)
    except ValueError:
        return None
    if number != number or number in (float("inf"), float("-inf")):
        return None
    return int(number)


def parse_userinfo(header: str) -> SubscriptionInfo:
    """``upload=1; download=2; total=3; expire=4`` read as mihomo does: case and spaces
    ignored, unknown keys and unreadable values skipped (and a negative value is 0)."""
    values: dict[str, int] = {}
    for part in header.lower().replace(" ", "").split(";"):
        key, sep, raw = part.partition("=")
        if not sep or key not in ("upload", "download", "total", "expire"):
            continue
        number = _number(raw)
        if number is not None:
            values[key] = max(0, number)
    return SubscriptionInfo(**values)


def origin_of(url: str | None) -> str | None:
    """``scheme://host[:port]`` of ``url``: what may be shown of it (the rest may hold a
    token)."""
    if url is None:
        return None
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        port = ""
    return f"{parts.scheme}://{host}{port}"
