"""``mode``, ``rules`` and ``route``: how a new flow picks its outbound."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, model_serializer, model_validator

from spliceway.config.validators import (
    BUILTIN_DIRECT,
    CONDITION_KEYS,
    AsnList,
    CidrList,
    DomainList,
    GeoCodeList,
    GeositeList,
    KeywordList,
    NameList,
    PortList,
    RegexList,
    SBool,
    Tag,
    _Model,
    _rule_schema,
)

#: Keys of a rule that are neither conditions nor its action: dropped from the dumped
#: document when they hold their defaults, so a plain rule keeps its old shape.
_SHAPE_DEFAULTS: dict[str, Any] = {
    "type": None,
    "mode": None,
    "rules": None,
    "invert": False,
    "no_resolve": False,
    "rule_set_ip_cidr_match_source": False,
}


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


class _RuleBody(_Model):
    """What a rule matches: conditions (all must match; a list matches when any item
    does), or a logical combination of other rules."""

    model_config = ConfigDict(json_schema_extra=_rule_schema)

    type: Literal["default", "logical"] | None = None
    """`logical` for a rule made of other rules (`mode` over `rules`); `default` or absent
    for a rule of conditions."""
    mode: Literal["and", "or"] | None = None
    """How a logical rule combines `rules`: `and` (all match) or `or` (any matches);
    required on a logical rule, not allowed on another."""
    rules: tuple[SubRule, ...] | None = None
    """A logical rule's parts: rules without `action` and `outbound` (plain or logical
    themselves); required and non-empty on a logical rule, not allowed on another."""
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
    geosite: GeositeList | None = None
    """Lists of the `runtime.geodata.geosite_path` database (v2fly `geosite.dat`) the target
    (or sniffed) host is in: `google`, `category-ads-all`, `geolocation-!cn`; `name@attr`
    keeps only the list's entries carrying attribute `attr` (`google@cn`; several `@`
    must all hold). Names are case-insensitive. A single string or a list.
    """
    geoip: GeoCodeList | None = None
    """Countries of the target's address, by ISO code (`cn`, `us`; case-insensitive) in
    the `runtime.geodata.geoip_path` database (`country.iso_code`, else
    `registered_country.iso_code`), read like `ip_cidr` (a domain target is resolved unless
    `no_resolve`). `private` (or `lan`) needs no database: private, loopback, link-local,
    multicast and unspecified addresses. A single string or a list.
    """
    ip_asn: AsnList | None = None
    """Autonomous system numbers (`"13335"`, integers accepted) of the target's address in
    the `runtime.geodata.asn_path` database (else `geoip_path`): its
    `autonomous_system_number`; read like `ip_cidr`. A single item or a list.
    """
    source_geoip: GeoCodeList | None = None
    """Countries of the client's address, written like `geoip`. A single string or a list."""
    source_ip_asn: AsnList | None = None
    """Autonomous system numbers of the client's address, written like `ip_asn`. A single
    item or a list.
    """
    rule_set: NameList | None = None
    """Names of rule providers (`providers.rules`): matches when any of the sets does. A
    set matches when one of its entries does: a domain entry by the target (or sniffed)
    host, a network by the target's address (read like `ip_cidr`), a Clash rule line
    (`classical`) as a rule of its own. A single string or a list.
    """
    rule_set_ip_cidr_match_source: SBool = False
    """Match the networks of `rule_set`'s sets against the client's address instead of the
    target's (Clash `RULE-SET,name,target,src`)."""
    no_resolve: SBool = False
    """This rule's conditions on the target's address (`ip_cidr`, `geoip`, `ip_asn`, the
    networks of `rule_set`) never make the engine resolve a domain target (Clash
    `no-resolve`): they look at the address only when the client sent one, or when an
    earlier rule already had the name resolved (docs/routing.md).
    """
    invert: SBool = False
    """Match when the conditions (or, on a logical rule, its `mode` over `rules`) do not
    (Clash `NOT`)."""

    def conditions(self) -> dict[str, tuple[str, ...] | str]:
        """The conditions this rule names, in :data:`CONDITION_KEYS` order (none for a
        logical rule: its parts have them)."""
        out: dict[str, tuple[str, ...] | str] = {}
        for key in CONDITION_KEYS:
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out

    @property
    def is_logical(self) -> bool:
        """Whether this is a logical rule (``mode`` over ``rules``)."""
        return self.type == "logical"

    @model_validator(mode="after")
    def _check_shape(self) -> Any:
        if self.type == "logical":
            if self.mode is None:
                raise ValueError("a logical rule needs `mode` ('and' or 'or')")
            named = [k for k in CONDITION_KEYS if getattr(self, k) is not None]
            if named:
                raise ValueError(
                    f"a logical rule takes no conditions of its own ({', '.join(named)}): "
                    "put them in its `rules`"
                )
            if self.no_resolve or self.rule_set_ip_cidr_match_source:
                raise ValueError(
                    "`no_resolve` and `rule_set_ip_cidr_match_source` go on the parts of a "
                    "logical rule"
                )
        else:
            if self.mode is not None or self.rules is not None:
                raise ValueError("`mode` and `rules` need `type: logical`")
            if self.rule_set_ip_cidr_match_source and self.rule_set is None:
                raise ValueError("`rule_set_ip_cidr_match_source` needs `rule_set`")
        return self

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        return {
            k: v
            for k, v in data.items()
            if not (k in _SHAPE_DEFAULTS and v == _SHAPE_DEFAULTS[k])
            and (v is not None or (k not in CONDITION_KEYS and k != "outbound"))
        }


class SubRule(_RuleBody):
    """A part of a logical rule: a rule without ``action`` and ``outbound``."""


class Rule(_RuleBody):
    """One routing rule: all named conditions must match (a list matches when any item
    does), or, with ``type: logical``, its ``rules`` combined by ``mode``."""

    action: Literal["route", "block"] = "route"
    """`route` sends a matching flow to `outbound`; `block` refuses it (outcome `blocked`)."""
    outbound: Tag | None = None
    """Outbound or group tag for a matching flow; required when `action` is `route`, not
    allowed when it is `block`.
    """


_RuleBody.model_rebuild()
SubRule.model_rebuild()
Rule.model_rebuild()


class Route(_Model):
    """``route``: ``final`` is used when no rule matches."""

    final: Tag = BUILTIN_DIRECT
    """Outbound or group tag for flows that no rule matches (mode `rule`)."""
