"""Browser protection for a listener without a key: which requests a web page may not send.

Without a key (or secret) anyone who can reach the port may call an API, and a web page
open in a browser on the same machine can try to: loopback alone does not stop it, the
browser makes the request. Both HTTP listeners that may run keyless, the control API
(``api.app``) and the Clash API (``api.clash.guard``), refuse the same requests, with
these rules (docs/security.md):

- a ``Host`` that names neither a loopback name or address (``localhost``,
  ``*.localhost``, 127.0.0.0/8, ``[::1]``) nor the listen address (any IP literal when
  listening on a wildcard address), with the bound port (no port: 80): this stops DNS
  rebinding, where a foreign name resolving to this machine makes the browser treat the
  API as the attacker's own site;
- an ``Origin`` other than the API's own (``http://`` + that ``Host``, compared without
  case), ``Origin: null`` included, unless the listener lists it as allowed;
- a ``Sec-Fetch-Site`` other than ``same-origin`` or ``none`` (browsers send it on
  requests that carry no ``Origin``, such as an ``<img>``'s GET), unless the request's
  ``Origin`` is one the listener allows.

The module is framework-free: each listener reads the headers its own way and words
the refusal for its own users through :class:`KeylessRules`.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = [
    "KeylessRules",
    "foreign_refusal",
    "host_refusal",
    "is_same_origin",
    "normalize_origin",
]

#: ``host[:port]`` as a Host header carries it: a DNS name or IPv4 literal, or a
#: bracketed IPv6 literal; an ASCII decimal port.
_HOST_RE = re.compile(
    r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9][A-Za-z0-9.-]*))(?::(?P<port>[0-9]{1,5}))?"
)
#: The ``Sec-Fetch-Site`` values of a request a page of the API's own origin (or the
#: user, typing the address) sent.
_SAME_SITE = frozenset({"same-origin", "none"})
_DEFAULT_PORTS = {"http": "80", "https": "443"}


def normalize_origin(origin: str) -> str:
    """``origin`` as compared: lower case, no trailing ``/``, no default port (browsers
    send ``https://example.com``, a configuration may say ``https://Example.com:443/``)."""
    value = origin.strip().rstrip("/").lower()
    scheme, sep, rest = value.partition("://")
    default = _DEFAULT_PORTS.get(scheme)
    if sep and default is not None and rest.endswith(f":{default}") and "/" not in rest:
        value = f"{scheme}://{rest[: -len(default) - 1]}"
    return value


@dataclass(frozen=True, slots=True)
class KeylessRules:
    """How one keyless listener words its refusals, and which other origins it allows.

    A refusal reads ``"<kind> refused: <what>; <subject> <accepts...>; <remedy> <whom>
    (see <see>)"``, for example ``"... a control API without a key accepts only
    same-origin requests; configure a key (...) to allow cross-origin callers (see
    docs/security.md)"``.
    """

    #: Who refuses: ``"a control API without a key"``.
    subject: str
    #: What the operator can do, ending with "to allow": ``"configure a key (...) to allow"``.
    remedy: str
    #: Where the rules are explained: ``"docs/security.md"``.
    see: str
    #: Origins (besides the API's own) allowed, as configured; ``*`` allows every origin.
    allowed_origins: Iterable[str] = ()
    #: The setting that lists them, named in the Origin refusal (None: not configurable).
    origins_setting: str | None = None
    _allowed: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        allowed = frozenset(normalize_origin(origin) for origin in self.allowed_origins)
        object.__setattr__(self, "_allowed", allowed)

    def allows_origin(self, origin: str) -> bool:
        """Whether ``origin`` is one of the configured other origins (``*``: any)."""
        return "*" in self._allowed or normalize_origin(origin) in self._allowed


def host_refusal(host: str, listen: tuple[str | None, int]) -> str | None:
    """Why ``host`` (a Host header) is not this API's own, or None when it is.

    ``listen`` is the bound ``(address, port)``; a None address (unknown) lets only
    loopback names and addresses pass.
    """
    bound_address, bound_port = listen
    match = _HOST_RE.fullmatch(host)
    if match is None:
        return "is not a valid host[:port]"
    port = int(match["port"]) if match["port"] else 80
    name = (match["v6"] or match["name"]).lower()
    if port != bound_port:
        return f"names port {port}, but this API listens on port {bound_port}"
    if match["name"] is not None and (name == "localhost" or name.endswith(".localhost")):
        return None
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return (
            "is not a loopback name (a foreign name that resolves to this machine is "
            "how DNS rebinding reaches it)"
        )
    if match["v6"] is not None and ip.version != 6:
        return "is not a valid host[:port]"
    if ip.is_loopback:
        return None
    if bound_address is not None:
        bound = ipaddress.ip_address(bound_address)
        if bound.is_unspecified or ip == bound:
            return None
    return "is neither this API's listen address nor a loopback address"


def is_same_origin(origin: str, host: str | None) -> bool:
    """Whether ``origin`` is ``http://`` + ``host`` (the page was served by this API)."""
    return host is not None and origin.lower() == f"http://{host}".lower()


def foreign_refusal(
    rules: KeylessRules,
    listen: tuple[str | None, int],
    host: str | None,
    origin: str | None,
    site: str | None,
) -> str | None:
    """Why a keyless listener must refuse a request with these ``Host``, ``Origin`` and
    ``Sec-Fetch-Site`` headers (None: absent), or None to serve it."""
    if host is not None:
        problem = host_refusal(host, listen)
        if problem is not None:
            return (
                f"request refused: Host {host} {problem}; {rules.subject} answers only "
                "requests addressed to localhost, a loopback address or its listen address, "
                f"on its port; {rules.remedy} other hosts (see {rules.see})"
            )
    if origin is not None:
        if rules.allows_origin(origin):
            # A configured origin is a cross-site page by definition: its Sec-Fetch-Site
            # says so, and is not held against it.
            return None
        if not is_same_origin(origin, host):
            own = f" ({'http://' + host})" if host is not None else ""
            listed = f" nor listed in {rules.origins_setting}" if rules.origins_setting else ""
            return (
                f"cross-origin request refused: Origin {origin} is not this API's origin"
                f"{own}{listed}; {rules.subject} accepts only same-origin requests; "
                f"{rules.remedy} cross-origin callers (see {rules.see})"
            )
    if site is not None and site.strip().lower() not in _SAME_SITE:
        return (
            f"cross-site request refused: Sec-Fetch-Site is {site}; {rules.subject} accepts "
            f"only same-origin requests; {rules.remedy} cross-site callers (see {rules.see})"
        )
    return None
