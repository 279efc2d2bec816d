"""``mode``, ``rules`` and ``route``: how a new flow picks its outbound."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, model_serializer

from spliceway.config.validators import (
    BUILTIN_DIRECT,
    CONDITION_KEYS,
    CidrList,
    DomainList,
    KeywordList,
    NameList,
    PortList,
    RegexList,
    Tag,
    _Model,
    _rule_schema,
)


class Mode(_Model):
    """``mode``: ``rule`` (rules then final), ``global`` (all to ``outbound``), ``direct``."""

    kind: Literal["rule", "global", "direct"] = "rule"
    """How new flows are routed: `rule` tries `rules` in order, then `route.final`; `global`
    sends every flow to `mode.outbound`; `direct` sends every flow to the built-in `direct`
    outbound. The `mode.set` command changes it while the engine runs (not written back to
    the file).
    """
    outbound: Tag | None = None
    """Outbound or group tag every flow takes when `kind` is `global` (required then); not used
    by the other kinds.
    """


class Rule(_Model):
    """One routing rule: all named conditions must match (a list matches when any item does)."""

    model_config = ConfigDict(json_schema_extra=_rule_schema)

    domain: DomainList | None = None
    """Target host names matched exactly (case-insensitive, trailing dot ignored); the sniffed
    host is tried too. A single string or a list.
    """
    domain_suffix: DomainList | None = None
    """Domain suffixes: `example.com` matches `example.com` and `www.example.com`, never
    `badexample.com`. The sniffed host is tried too. A single string or a list.
    """
    domain_keyword: KeywordList | None = None
    """Substrings of the target (or sniffed) host name. A single string or a list."""
    domain_regex: RegexList | None = None
    """Regular expressions searched in the target (or sniffed) host name, case-insensitive
    (Python `re` syntax). A single string or a list.
    """
    ip_cidr: CidrList | None = None
    """Networks (`10.0.0.0/8`, `2001:db8::/32`) containing the target's address: the address
    the client asked for, in any spelling (`2130706433` and `127.1` are 127.0.0.1), else,
    for a flow to a domain, the first address the engine resolver gives for it once
    matching reaches this rule (docs/routing.md). A single string or a list.
    """
    source_ip_cidr: CidrList | None = None
    """Networks containing the client's address. A single string or a list."""
    port: PortList | None = None
    """Target ports: `"443"` or an inclusive range `"8000-8100"` (integers are accepted too). A
    single item or a list.
    """
    source_port: PortList | None = None
    """Client source ports, written like `port`. A single item or a list."""
    network: Literal["tcp", "udp"] | None = None
    """`tcp` or `udp`: SOCKS5 UDP associations' destinations and the TUN's UDP sessions are
    `udp` flows."""
    inbound_tag: NameList | None = None
    """Tags of the inbounds the flow arrived on. A single string or a list."""
    principal_key: NameList | None = None
    """Principal keys of authenticated users (see `inbounds[].users`); a flow without a user
    never matches. A single string or a list.
    """
    process_name: NameList | None = None
    """Names of the client's process: the base name of its executable (`curl`, `firefox`),
    compared exactly. Only a flow whose client runs on this host has one, found while
    `runtime.process_lookup` is `auto` or `always`; with `off` such a rule never matches.
    A single string or a list.
    """
    action: Literal["route", "block"] = "route"
    """`route` sends a matching flow to `outbound`; `block` refuses it (outcome `blocked`)."""
    outbound: Tag | None = None
    """Outbound or group tag for a matching flow; required when `action` is `route`, not
    allowed when it is `block`.
    """

    def conditions(self) -> dict[str, tuple[str, ...] | str]:
        """The conditions this rule names, in :data:`CONDITION_KEYS` order."""
        out: dict[str, tuple[str, ...] | str] = {}
        for key in CONDITION_KEYS:
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        return {
            k: v
            for k, v in data.items()
            if v is not None or (k not in CONDITION_KEYS and k != "outbound")
        }


class Route(_Model):
    """``route``: ``final`` is used when no rule matches."""

    final: Tag = BUILTIN_DIRECT
    """Outbound or group tag for flows that no rule matches (mode `rule`)."""
