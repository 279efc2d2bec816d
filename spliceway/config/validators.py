"""Field validators, the Annotated scalar types built on them, and the models' base.

Every validator raises ``ValueError`` with the message the user sees (the schema pass
turns it into a :class:`~spliceway.errors.Detail`). Names with a leading underscore are
private to :mod:`spliceway.config`: its model modules share them, nothing else imports them.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from typing import Annotated, Any, TypeVar
from urllib.parse import SplitResult, urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    Strict,
)

from spliceway.events.catalogue import EVENT_CATALOGUE
from spliceway.support.probe_url import parse_probe_url

DEFAULT_API_KEY_ENV = "SPLICEWAY_API_KEY"

#: Rule condition keys in the order used for ``matched_rule.condition`` text.
CONDITION_KEYS: tuple[str, ...] = (
    "domain",
    "domain_suffix",
    "domain_keyword",
    "domain_regex",
    "geosite",
    "ip_cidr",
    "geoip",
    "ip_asn",
    "source_ip_cidr",
    "source_geoip",
    "source_ip_asn",
    "port",
    "source_port",
    "network",
    "inbound_tag",
    "principal_key",
    "process_name",
    "rule_set",
)

#: Conditions on the target's address: they may need a domain target resolved (unless the
#: rule says ``no_resolve``).
ADDRESS_CONDITION_KEYS: frozenset[str] = frozenset({"ip_cidr", "geoip", "ip_asn"})

#: ``geoip`` codes that name built-in ranges rather than database entries (mihomo's
#: ``GEOIP,LAN``): private, loopback, link-local, multicast and unspecified addresses.
GEOIP_BUILTIN_CODES: frozenset[str] = frozenset({"private", "lan"})

#: Every event type (valid in a sink's ``events`` filter, with ``"*"``): the catalogue's names.
EVENT_TYPES: frozenset[str] = frozenset(EVENT_CATALOGUE)

BUILTIN_DIRECT = "direct"

# ---------------------------------------------------------------------------
# Field validators (each raises ValueError with the message shown to the user)
# ---------------------------------------------------------------------------

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PORT_SPEC = re.compile(r"(\d{1,5})(?:-(\d{1,5}))?")
_DNS_SERVER = re.compile(r"(udp|tcp)://(\[[^\]]+\]|[^:/\[\]]+)(?::(\d{1,5}))?")


def _check_ip_address(value: str) -> str:
    if value == "localhost":
        return value
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(f"{value!r} is not an IP address (or 'localhost')") from None
    return value


def _check_cidr(value: str) -> str:
    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise ValueError(f"{value!r} is not a valid CIDR (e.g. '10.0.0.0/8')") from None
    return value


def _check_interface_address(value: str) -> str:
    try:
        ipaddress.ip_interface(value)
    except ValueError:
        raise ValueError(f"{value!r} is not an interface address (IP or IP/prefix)") from None
    return value


def _check_netmask(value: str) -> str:
    try:
        ipaddress.IPv4Network(f"0.0.0.0/{value}")
    except ValueError:
        raise ValueError(f"{value!r} is not an IPv4 netmask") from None
    return value


def _check_domain(value: str) -> str:
    if not value or value.startswith(".") or any(c.isspace() for c in value) or ".." in value:
        raise ValueError(f"{value!r} is not a domain name (no leading dot, no spaces)")
    return value


def _check_keyword(value: str) -> str:
    if not value:
        raise ValueError("must not be empty")
    return value


def _check_regex(value: str) -> str:
    try:
        re.compile(value, re.IGNORECASE)
    except re.error as exc:
        raise ValueError(f"invalid regular expression: {exc}") from None
    return value


_GEO_CODE = re.compile(r"[A-Za-z0-9_-]+")
_GEOSITE_NAME = re.compile(r"[^\s@!][^\s@]*(?:@[^\s@]+)*")


def _check_geo_code(value: str) -> str:
    if not _GEO_CODE.fullmatch(value):
        raise ValueError(f"{value!r} is not a country code (letters, digits, '-', '_')")
    return value


def _check_asn(value: str) -> str:
    if not value.isascii() or not value.isdigit() or int(value) > 0xFFFFFFFF:
        raise ValueError(f"{value!r} is not an AS number (digits, e.g. '13335')")
    return value


def _check_geosite_name(value: str) -> str:
    if value.startswith("!"):
        raise ValueError(
            f"{value!r}: a negated list ('!name') is not supported; use `invert` on the rule"
        )
    if not _GEOSITE_NAME.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a geosite list name ('google', 'category-ads-all', 'google@cn')"
        )
    return value


def parse_port_spec(value: str) -> tuple[int, int]:
    """Parse ``"443"`` or ``"8000-8100"`` into an inclusive ``(low, high)`` range."""
    m = _PORT_SPEC.fullmatch(value)
    if m is None:
        raise ValueError(f"{value!r} is not a port ('443') or port range ('8000-8100')")
    low = int(m.group(1))
    high = int(m.group(2)) if m.group(2) is not None else low
    if high > 65535:
        raise ValueError(f"{value!r}: ports are 0..65535")
    if low > high:
        raise ValueError(f"{value!r}: range start is above its end")
    return low, high


def _check_port_spec(value: str) -> str:
    parse_port_spec(value)
    return value


def _port_to_str(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


def _url_with_host(value: str, schemes: tuple[str, ...]) -> SplitResult:
    """``value`` split, when it is a URL of one of ``schemes`` with a host (and a valid
    port, if any); ValueError saying what is wrong otherwise."""
    try:
        parts = urlsplit(value)
        _ = parts.port  # raises ValueError on a bad port
    except ValueError:
        raise ValueError(f"{value!r} is not a valid URL") from None
    if parts.scheme not in schemes or not parts.hostname:
        kinds = " or ".join(f"{scheme}://" for scheme in schemes)
        article = "an" if schemes[0][0] in "aehiou" else "a"
        raise ValueError(f"must be {article} {kinds} URL with a host (got {value!r})")
    return parts


def _check_webhook_url(value: str) -> str:
    _url_with_host(value, ("http", "https"))
    return value


def _check_nats_url(value: str) -> str:
    parts = _url_with_host(value, ("nats", "tls"))
    if parts.username is not None or parts.password is not None:
        raise ValueError("must not carry credentials: name them with credentials_env")
    return value


#: A publish subject: dot-separated tokens, no wildcards, no whitespace (NATS subjects).
_NATS_SUBJECT = re.compile(r"[^.*>\s]+(?:\.[^.*>\s]+)*")


def _check_nats_subject(value: str) -> str:
    if not _NATS_SUBJECT.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a NATS publish subject (dot-separated tokens, no spaces, "
            "no wildcards * or >)"
        )
    return value


def _check_env_name(value: str) -> str:
    if not _ENV_NAME.fullmatch(value):
        raise ValueError(f"{value!r} is not an environment variable name")
    return value


def _check_credential(value: str) -> str:
    if not 1 <= len(value.encode("utf-8")) <= 255:
        raise ValueError("must be 1..255 bytes long (UTF-8)")
    return value


def _check_event_type(value: str) -> str:
    if value != "*" and value not in EVENT_TYPES:
        raise ValueError(f"unknown event type {value!r}")
    return value


def parse_dns_server(value: str) -> tuple[str, str | None, int | None]:
    """Parse a ``runtime.dns.servers`` item into ``(kind, ip, port)``.

    ``"system"`` gives ``("system", None, None)``; ``"udp://1.1.1.1"`` gives
    ``("udp", "1.1.1.1", 53)``; ``"tcp://[::1]:5353"`` gives ``("tcp", "::1", 5353)``.
    """
    if value == "system":
        return "system", None, None
    m = _DNS_SERVER.fullmatch(value)
    if m is None:
        raise ValueError(f"{value!r} is not 'system', 'udp://IP[:PORT]' or 'tcp://IP[:PORT]'")
    host = m.group(2)
    bracketed = host.startswith("[")
    host = host.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{value!r}: {host!r} is not an IP address") from None
    if (ip.version == 6) != bracketed:
        raise ValueError(f"{value!r}: IPv6 addresses go in brackets, IPv4 ones do not")
    port = int(m.group(3)) if m.group(3) is not None else 53
    if not 1 <= port <= 65535:
        raise ValueError(f"{value!r}: port must be 1..65535")
    return m.group(1), host, port


def _check_dns_server(value: str) -> str:
    parse_dns_server(value)
    return value


def _one_or_many(value: Any) -> Any:
    """Accept a single string (or integer) where a list is expected."""
    if isinstance(value, str | int) and not isinstance(value, bool):
        return (value,)
    return value


def _float_out(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


# ---------------------------------------------------------------------------
# Annotated scalar types
# ---------------------------------------------------------------------------

SStr = Annotated[str, Strict()]
SBool = Annotated[bool, Strict()]
Tag = Annotated[str, Strict(), Field(min_length=1)]
NonEmptyStr = Annotated[str, Strict(), Field(min_length=1)]
PosInt = Annotated[int, Strict(), Field(ge=1)]
NonNegInt = Annotated[int, Strict(), Field(ge=0)]
ListenPort = Annotated[int, Strict(), Field(ge=0, le=65535)]
RemotePort = Annotated[int, Strict(), Field(ge=1, le=65535)]
Timeout = Annotated[int, Strict(), Field(ge=1)]
IpAddr = Annotated[str, Strict(), AfterValidator(_check_ip_address)]
Cidr = Annotated[str, Strict(), AfterValidator(_check_cidr)]


def _check_probe_url(value: str) -> str:
    try:
        parse_probe_url(value)
    except ValueError as ex:
        raise ValueError(f"{ex} (got {value!r})") from None
    return value


#: A URL probed with HEAD through an outbound: plain ``http://`` only.
ProbeUrl = Annotated[str, Strict(), AfterValidator(_check_probe_url)]
EnvName = Annotated[str, Strict(), AfterValidator(_check_env_name)]
Credential = Annotated[str, Strict(), AfterValidator(_check_credential)]
Percent = Annotated[
    float, Strict(), Field(ge=0, le=100), PlainSerializer(_float_out, return_type=float | int)
]


_Item = TypeVar("_Item")
#: A rule condition's value: a non-empty list of items, or one item standing for a list
#: of one. A generic alias (not a function returning ``Annotated``) so type checkers see
#: the types below as types.
CondList = Annotated[tuple[_Item, ...], BeforeValidator(_one_or_many), Field(min_length=1)]

DomainList = CondList[Annotated[str, Strict(), AfterValidator(_check_domain)]]
KeywordList = CondList[Annotated[str, Strict(), AfterValidator(_check_keyword)]]
RegexList = CondList[Annotated[str, Strict(), AfterValidator(_check_regex)]]
CidrList = CondList[Cidr]
PortList = CondList[
    Annotated[str, BeforeValidator(_port_to_str), Strict(), AfterValidator(_check_port_spec)]
]
NameList = CondList[NonEmptyStr]
GeoCodeList = CondList[Annotated[str, Strict(), AfterValidator(_check_geo_code)]]
AsnList = CondList[
    Annotated[str, BeforeValidator(_port_to_str), Strict(), AfterValidator(_check_asn)]
]
GeositeList = CondList[Annotated[str, Strict(), AfterValidator(_check_geosite_name)]]


class _Model(BaseModel):
    # Field docstrings are the descriptions of the JSON Schema (``spliceway config-schema``)
    # and of docs/configuration.md.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def _schema_optional(*names: str) -> Callable[[dict[str, Any]], None]:
    """JSON Schema hook: ``names`` are filled in by a before-validator, so they may be omitted."""

    def hook(schema: dict[str, Any]) -> None:
        schema["required"] = [n for n in schema.get("required", ()) if n not in names]

    return hook


def _rule_schema(schema: dict[str, Any]) -> None:
    """JSON Schema hook of ``Rule``: list conditions also take a single item (see ``_one_or_many``),
    and port items may be integers."""
    for key in CONDITION_KEYS:
        prop = schema["properties"][key]
        many = next((s for s in prop.get("anyOf", ()) if s.get("type") == "array"), None)
        if many is None:
            continue  # network: a single string
        item = many["items"]
        if key in ("port", "source_port"):
            item = {"anyOf": [item, {"type": "integer", "minimum": 0, "maximum": 65535}]}
        elif key in ("ip_asn", "source_ip_asn"):
            item = {"anyOf": [item, {"type": "integer", "minimum": 0}]}
        prop["anyOf"] = [item, {"type": "array", "items": item, "minItems": 1}, {"type": "null"}]


def _fill_from(data: Any, key: str, source: str, *, first: bool = False) -> Any:
    """Before-validator helper: default ``key`` to ``data[source]`` (or its first item)."""
    if not isinstance(data, dict) or data.get(key) is not None:
        return data
    value = data.get(source)
    if first:
        value = value[0] if isinstance(value, list | tuple) and value else None
    if isinstance(value, str):
        return {**data, key: value}
    return data
