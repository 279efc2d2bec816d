"""Proxy providers' outbounds merged into a configuration: the configuration the engine runs.

:func:`materialise` takes a validated configuration (as its author wrote it: groups name
providers in ``providers``) and the current content of every proxy provider, and returns
the configuration with each provider's outbounds as ordinary ``outbounds`` entries and
each group's provider members appended to its ``outbounds``, validated again by
``parse_config``. Everything downstream (reuse of unchanged outbounds, the C route
table, the policy views, the Clash API's ``/proxies``) then sees plain outbounds.

Decisions (mihomo's semantics where it has one, ``adapter/outboundgroup/parser.go`` and
``adapter/provider/provider.go``):

- A group's members are its inline ``outbounds`` first, then each provider's outbounds
  in the order the group lists the providers, each provider's in the order of its body.
- ``filter`` keeps an outbound whose name one of the expressions matches (searched,
  Python ``re``), in mihomo's order: the first expression's matches in body order, then
  the next one's; ``exclude_filter`` drops one any of its expressions matches. Both look
  at the name as the body gives it, before ``override``'s prefix and suffix (as mihomo
  filters before it renames).
- A group's own ``filter`` and ``exclude_filter`` then apply as mihomo applies a group's
  (``adapter/outboundgroup/groupbase.go``, read at v1.19.2): ``filter`` to the provider
  members only, in the same order (with two or more expressions and two or more sources,
  inline members counting as one, every member is then put in filter order, those none
  matches last); ``exclude_filter`` to every member, inline ones by their tag. They match
  a provider outbound's name with its provider's override prefix and suffix (mihomo's
  group filters see the renamed proxy). Each group filters the provider's one copy: one
  fetch, one cache, one status however many groups filter it.
- An outbound's tag is ``name_prefix + name + name_suffix``. A tag already taken (by an
  inline outbound or group, the built-in ``direct``, or an earlier provider's outbound)
  becomes ``<tag> (<provider>)``, then ``<tag> (<provider>) #2``, ``#3``...: the same
  inputs always give the same tags, and each renaming is reported.
- A relay group takes provider outbounds that can be hops (``socks5``, ``http``, and one
  ``shadowsocks`` as the last hop); the others are left out of it and reported.
- A selector whose ``default`` is not among its members after the merge starts on its
  first member.
- A group without providers is merged only when it has an ``exclude_filter`` (the
  document's cross-checks make sure it keeps a member).
- A group left with no member stays: the engine routes its flows to a stand-in that
  fails them (code ``no_member``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spliceway.config import BUILTIN_DIRECT, Config, parse_config
from spliceway.config.checks import RELAY_HOP_PROTOCOLS
from spliceway.config.models_providers import ProxyProvider
from spliceway.providers.subscription import ProxyContent, ProxyEntry

__all__ = ["Materialised", "ProviderMembers", "group_members", "materialise", "provider_tags"]


@dataclass(frozen=True, slots=True)
class ProviderMembers:
    """What one proxy provider contributed to a materialised configuration."""

    #: The tags its outbounds got, in order.
    tags: tuple[str, ...] = ()
    #: Each of those outbounds' name with the override's prefix and suffix (its tag unless
    #: the tag was taken): what groups' ``filter`` and ``exclude_filter`` match, as
    #: mihomo's match a provider proxy's name.
    names: tuple[str, ...] = ()
    #: Outbounds its ``filter`` / ``exclude_filter`` left out, by name.
    filtered_out: tuple[str, ...] = ()
    #: ``(name, tag)`` of each outbound whose tag was taken and is renamed.
    renamed: tuple[tuple[str, str], ...] = ()
    #: ``(group, tag, why)`` of each outbound a group could not take (a relay's hops).
    left_out: tuple[tuple[str, str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Materialised:
    """A configuration with its providers' outbounds merged in, and where each came from."""

    config: Config
    #: The provider each merged outbound came from, by tag.
    origins: Mapping[str, str] = field(default_factory=dict)
    #: What each proxy provider contributed, by name (every configured one).
    members: Mapping[str, ProviderMembers] = field(default_factory=dict)


def _matches(patterns: tuple[str, ...] | None, name: str) -> bool:
    return any(re.search(p, name) for p in patterns or ())


def _kept(
    spec: ProxyProvider, entries: tuple[ProxyEntry, ...]
) -> tuple[list[ProxyEntry], list[str]]:
    """The entries ``filter`` keeps and ``exclude_filter`` leaves, in mihomo's order: the
    first expression's matches in body order, then the next one's (each entry once)."""
    candidates = [e for e in entries if not _matches(spec.exclude_filter, e.name)]
    kept: list[ProxyEntry] = []
    if spec.filter is None:
        kept = candidates
    else:
        seen: set[str] = set()
        for pattern in spec.filter:
            for entry in candidates:
                if entry.name not in seen and re.search(pattern, entry.name):
                    seen.add(entry.name)
                    kept.append(entry)
    chosen = {e.name for e in kept}
    return kept, [e.name for e in entries if e.name not in chosen]


def _free_tag(wanted: str, provider: str, taken: set[str]) -> str:
    if wanted not in taken:
        return wanted
    base = f"{wanted} ({provider})"
    tag, n = base, 1
    while tag in taken:
        n += 1
        tag = f"{base} #{n}"
    return tag


def _outbound_entry(spec: ProxyProvider, entry: ProxyEntry, tag: str) -> dict[str, Any]:
    outbound = {**entry.outbound, "tag": tag}
    timeout = spec.override.connect_timeout_ms
    if timeout is not None and outbound.get("protocol") != "block":
        outbound["connect_timeout_ms"] = timeout
    return outbound


def provider_tags(
    config: Config, contents: Mapping[str, ProxyContent | None]
) -> tuple[list[dict[str, Any]], dict[str, str], dict[str, ProviderMembers]]:
    """Every provider's outbounds as outbound entries (tags assigned), the provider of
    each tag, and each provider's contribution (its groups' left-out hops not yet known)."""
    taken = {BUILTIN_DIRECT, *(ob.tag for ob in config.outbounds)}
    taken.update(g.tag for g in config.outbound_groups)
    entries: list[dict[str, Any]] = []
    origins: dict[str, str] = {}
    members: dict[str, ProviderMembers] = {}
    for name, spec in config.providers.proxies.items():
        content = contents.get(name)
        if content is None:
            members[name] = ProviderMembers()
            continue
        kept, dropped = _kept(spec, content.entries)
        tags: list[str] = []
        names: list[str] = []
        renamed: list[tuple[str, str]] = []
        for entry in kept:
            wanted = f"{spec.override.name_prefix}{entry.name}{spec.override.name_suffix}"
            tag = _free_tag(wanted, name, taken)
            if tag != wanted:
                renamed.append((entry.name, tag))
            taken.add(tag)
            tags.append(tag)
            names.append(wanted)
            origins[tag] = name
            entries.append(_outbound_entry(spec, entry, tag))
        members[name] = ProviderMembers(tuple(tags), tuple(names), tuple(dropped), tuple(renamed))
    return entries, origins, members


def _relay_hops(
    group: str, members: list[str], protocols: Mapping[str, Any]
) -> tuple[list[str], list[tuple[str, str, str]]]:
    """The members a relay can dial as hops in order, and the others with why. Inline hops
    are checked with the document, so only provider outbounds (or an inline one a group
    filter moved after a ``shadowsocks`` hop) are left out."""
    hops: list[str] = []
    left_out: list[tuple[str, str, str]] = []
    last_is_ss = False
    for tag in members:
        protocol = protocols.get(tag)
        if protocol not in RELAY_HOP_PROTOCOLS:
            left_out.append((group, tag, f"a {protocol} outbound cannot be a relay hop"))
        elif last_is_ss:
            left_out.append((group, tag, "a relay has no hop after a shadowsocks hop"))
        else:
            hops.append(tag)
            last_is_ss = protocol == "shadowsocks"
    return hops, left_out


#: A member as a group's filters see it: ``(tag, name)``.
_Member = tuple[str, str]


def _in_filter_order(patterns: tuple[str, ...], members: list[_Member]) -> list[_Member]:
    """The members some expression matches: the first one's matches in order, then the
    next one's (each member once), as mihomo's ``GroupBase.GetProxies`` orders them."""
    out: list[_Member] = []
    seen: set[str] = set()
    for pattern in patterns:
        for member in members:
            if member[0] not in seen and re.search(pattern, member[1]):
                seen.add(member[0])
                out.append(member)
    return out


def group_members(
    group: Mapping[str, Any], inline: list[str], sources: list[list[_Member]]
) -> list[str]:
    """A group's members: its ``inline`` tags, then each provider's ``(tag, name)`` list of
    ``sources`` (in the group's order), through the group's ``filter`` and
    ``exclude_filter`` as mihomo applies a group's (v1.19, ``adapter/outboundgroup/
    groupbase.go``): ``filter`` keeps each provider's matches in filter order and leaves
    inline members alone; with two or more expressions and two or more sources (inline
    members count as one) every member is then put in filter order, members none matches
    last; ``exclude_filter`` then drops any member it matches."""
    filters = tuple(group.get("filter") or ())
    excludes = tuple(group.get("exclude_filter") or ())
    parts = [[(t, t) for t in inline]] if inline else []
    parts += [_in_filter_order(filters, s) if filters else s for s in sources]
    members = [m for part in parts for m in part]
    if len(parts) > 1 and len(filters) > 1:
        ordered = _in_filter_order(filters, members)
        chosen = {m[0] for m in ordered}
        members = ordered + [m for m in members if m[0] not in chosen]
    return [tag for tag, name in members if not _matches(excludes, name)]


def materialise(config: Config, contents: Mapping[str, ProxyContent | None]) -> Materialised:
    """``config`` with its proxy providers' outbounds merged in (see the module docstring).

    ``contents`` holds each provider's current content by name (missing or None: it has
    none yet). Raises ``ApiError`` (``invalid_config``) only if the merged document does
    not validate, which the per-entry checks of the content make a bug, not a body's
    doing.
    """
    filtering = any(g.exclude_filter for g in config.outbound_groups)
    if not config.providers.proxies and not filtering:
        return Materialised(config)
    added, origins, members = provider_tags(config, contents)
    doc = config.to_dict()
    doc["outbounds"] = [*doc["outbounds"], *added]
    protocols = {ob["tag"]: ob.get("protocol") for ob in doc["outbounds"]}
    left_out: dict[str, list[tuple[str, str, str]]] = {}
    for group in doc["outbound_groups"]:
        names = group.get("providers") or ()
        if not names and not group.get("exclude_filter"):
            continue
        sources = [list(zip(members[n].tags, members[n].names, strict=True)) for n in names]
        merged = group_members(group, list(group["outbounds"]), sources)
        if group["kind"] == "relay":
            merged, dropped = _relay_hops(group["tag"], merged, protocols)
            for item in dropped:
                if item[1] in origins:
                    left_out.setdefault(origins[item[1]], []).append(item)
        group["outbounds"] = merged
        if group["kind"] == "selector" and group.get("default") not in merged:
            group["default"] = merged[0] if merged else None
    for name, dropped_hops in left_out.items():
        m = members[name]
        members[name] = ProviderMembers(
            m.tags, m.names, m.filtered_out, m.renamed, tuple(dropped_hops)
        )
    return Materialised(parse_config(doc), origins, members)
