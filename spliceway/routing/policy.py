"""Policy groups: selection rules, member health, chains and snapshots (the pure parts).

A group's live state is a :class:`GroupView`, an immutable value that only its
``PolicyGroupActor`` replaces (``PolicyTable.publish``). Flows resolve their
route target through the current views on the dispatcher thread without asking
any actor: a route target that names a group walks selected members down to a
leaf outbound, and the tags walked are the flow's ``route.selection_chain``.

Decisions where the spec leaves room:

- Until its first probe round a member counts as healthy with unknown latency,
  so a fresh url_test or fallback uses its first member (as mihomo does).
- url_test keeps its current member while that member is healthy and at most
  ``tolerance_ms`` slower than the fastest; with no healthy measured member it
  keeps the current one unless that one is known dead.
- fallback with every member dead uses its first member: some traffic must go
  somewhere, and the failure that follows triggers the next probe round.
- load_balance spreads over healthy members (all members when none is healthy).
  ``consistent_hashing`` (by target host) and ``sticky_sessions`` (by source IP)
  use rendezvous hashing, so a member going down moves only its own share.
- A url_test or fallback group may be pinned to a member (``policies.select``,
  mihomo's ``fixed``), as mihomo's ``urltest.go`` ``fast()`` and ``fallback.go``
  ``findAliveProxy()`` do: url_test takes the pinned member while it is healthy and
  keeps the pin while it is not (its own choice applies meanwhile); fallback takes it
  while it is healthy and drops the pin once it is found unhealthy.
- A relay group is a leaf: its hops are the flow's ``path.relay_chain``.
- ``effective_chains`` stop at a nested load_balance group (its own snapshot
  lists its chains): which member a flow gets depends on the flow.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

# Re-exported: the probe URL parser sits with the pure parsers, below the configuration
# that validates with it; the groups, probes and diagnostics name it from here.
from spliceway.support.probe_url import ProbeUrl as ProbeUrl
from spliceway.support.probe_url import parse_probe_url as parse_probe_url

#: Statuses a probe accepts, as inclusive ``(low, high)`` ranges; empty: any status.
StatusRanges = tuple[tuple[int, int], ...]
#: mihomo's limit on the number of ranges (common/utils/ranges.go).
_MAX_STATUS_RANGES = 28


def parse_expected_status(text: str | None) -> StatusRanges:
    """Parse mihomo's expected-status syntax (``200``, ``200/204``, ``200-299``, ranges
    separated by ``/`` or ``,``; ``*``, empty or None: any status). ValueError when
    malformed."""
    text = (text or "").strip()
    if not text or text == "*":
        return ()
    parts = text.replace(",", "/").split("/")
    if len(parts) > _MAX_STATUS_RANGES:
        raise ValueError(f"at most {_MAX_STATUS_RANGES} ranges")
    ranges: list[tuple[int, int]] = []
    for part in parts:
        if not part:
            continue  # as mihomo: "200//204" is "200/204"
        bounds = part.split("-")
        if len(bounds) > 2:
            raise ValueError(f"{part!r} is not a status or a range")
        try:
            low, high = (int(b.strip("[ ]"), 10) for b in (bounds[0], bounds[-1]))
        except ValueError:
            raise ValueError(f"{part!r} is not a status or a range") from None
        if not (0 <= low <= high <= 65535):
            raise ValueError(f"{part!r} is not a status or an ascending range")
        ranges.append((low, high))
    return tuple(ranges)


def status_allowed(ranges: StatusRanges, status: int) -> bool:
    """Whether ``status`` is in ``ranges`` (any status when there are none)."""
    return not ranges or any(low <= status <= high for low, high in ranges)


#: Used when neither the group, ``runtime.latency_test_url`` nor the command names a URL.
DEFAULT_PROBE_URL = "http://www.gstatic.com/generate_204"
#: Per-member budget of one probe (``policies.probe``, ``diagnostics.probe_outbound``).
PROBE_TIMEOUT_S = 5.0
#: Kinds that probe their members and track health.
PROBING_KINDS = frozenset({"url_test", "fallback", "load_balance"})
#: Kinds ``GET /api/v1/policies`` reports; relay groups are in /config.
POLICY_KINDS = frozenset({"selector", "fallback", "url_test", "load_balance"})
#: ``policy.probe.completed`` triggers; ``dial_failure`` extends the spec's three.
TRIGGERS = ("startup", "scheduled", "manual", "dial_failure")


@dataclass(frozen=True, slots=True)
class MemberHealth:
    """What the last probe (or dial failure) said about one member."""

    healthy: bool = True
    latency_ms: float | None = None
    last_checked_unix_ms: int | None = None
    last_error: str | None = None


@dataclass(frozen=True, slots=True)
class GroupView:
    """One group's state as flows and queries see it."""

    tag: str
    kind: str
    members: tuple[str, ...]
    selected: str | None
    health: Mapping[str, MemberHealth]
    last_checked_unix_ms: int | None = None
    url: str | None = None
    interval_seconds: int | None = None
    tolerance_ms: int | None = None
    strategy: str | None = None
    #: The pinned member of a url_test or fallback group (mihomo's ``fixed``), or None.
    fixed: str | None = None

    @property
    def probing(self) -> bool:
        """True for kinds that probe their members."""
        return self.kind in PROBING_KINDS

    def candidates(self) -> tuple[str, ...]:
        """The members a load_balance group spreads over: healthy ones, else all."""
        healthy = tuple(m for m in self.members if self.health[m].healthy)
        return healthy or self.members


def initial_view(spec: Any, url: str | None) -> GroupView:
    """The state of a group from its validated config entry, before any probe."""
    members = tuple(spec.outbounds)
    kind = spec.kind
    view = GroupView(
        tag=spec.tag,
        kind=kind,
        members=members,
        selected=None,
        health=MappingProxyType(dict.fromkeys(members, MemberHealth())),
        url=url if kind in PROBING_KINDS else None,
        interval_seconds=getattr(spec, "interval_seconds", None) if kind in PROBING_KINDS else None,
        tolerance_ms=getattr(spec, "tolerance_ms", None),
        strategy=getattr(spec, "strategy", None),
    )
    if kind == "selector":
        return replace(view, selected=spec.default)
    return replace(view, selected=choose(view, None))


def carried_view(spec: Any, url: str | None, live: GroupView | None) -> GroupView:
    """The state of a changed group whose members are all that changed (a proxy provider's
    refresh, or an apply that edits the member list): what ``live`` knew carries over.

    The selection (a selector's) and the pin (a url_test or fallback group's) stay when
    the member is still there, and every kept member keeps its health, so a refresh
    moves no traffic that it need not move. Any other change, or no live view, gives
    :func:`initial_view`.
    """
    fresh = initial_view(spec, url)
    if live is None or not _same_but_members(live, fresh):
        return fresh
    health = dict(fresh.health)
    health.update((m, h) for m, h in live.health.items() if m in health)
    view = replace(
        fresh,
        health=MappingProxyType(health),
        last_checked_unix_ms=live.last_checked_unix_ms,
        fixed=live.fixed if live.fixed in health else None,
    )
    if view.kind == "selector":
        if live.selected in health:
            return replace(view, selected=live.selected)
        return view
    if view.kind in PINNABLE_KINDS:
        return replace(
            view, selected=choose(view, live.selected if live.selected in health else None)
        )
    return view


def next_view(
    before: tuple[Any, str] | None, spec: Any, url: str, live: GroupView | None
) -> GroupView:
    """The state of group ``spec`` (probing ``url``) after an apply changed it: carried over
    from ``live`` when only its members changed (``before`` is its previous entry and URL),
    else its initial state."""
    if before is not None and before[1] == url and members_only_change(before[0], spec):
        return carried_view(spec, url, live)
    return initial_view(spec, url)


def members_only_change(old: Any, new: Any) -> bool:
    """Whether group config entry ``new`` differs from ``old`` in its members alone (and,
    for a selector, in a ``default`` that is in both its first member, as it is when
    unset), so :func:`carried_view` may keep what the running group knows."""
    if type(old) is not type(new) or old.tag != new.tag:
        return False
    aside: dict[str, Any] = {"outbounds": ()}
    if new.kind == "selector":
        aside["default"] = None
    if old.model_copy(update=aside) != new.model_copy(update=aside):
        return False
    if new.kind != "selector" or old.default == new.default:
        return True
    return old.default == _first(old.outbounds) and new.default == _first(new.outbounds)


def _first(members: Any) -> str | None:
    return members[0] if members else None


def _same_but_members(a: GroupView, b: GroupView) -> bool:
    return (a.tag, a.kind, a.url, a.interval_seconds, a.tolerance_ms, a.strategy) == (
        b.tag,
        b.kind,
        b.url,
        b.interval_seconds,
        b.tolerance_ms,
        b.strategy,
    )


def probe_url_for(spec_url: str | None, latency_test_url: str | None) -> str:
    """The URL a group probes: its own, else ``runtime.latency_test_url``, else the default."""
    return spec_url or latency_test_url or DEFAULT_PROBE_URL


#: Kinds whose member can be pinned (``policies.select``, ``policies.unfix``).
PINNABLE_KINDS = frozenset({"url_test", "fallback"})


def pinned(view: GroupView, fixed: str | None) -> GroupView:
    """``view`` with its pin set to ``fixed`` (None: unpinned), reselected."""
    return _reselected(replace(view, fixed=fixed), {})


def choose(view: GroupView, current: str | None) -> str | None:
    """The member a url_test or fallback group uses now (None for other kinds): its
    healthy pinned member, else its kind's own choice."""
    members, health = view.members, view.health
    if not members:
        return None  # a group whose providers gave it no member yet
    if view.fixed is not None and view.fixed in health and health[view.fixed].healthy:
        return view.fixed
    if view.kind == "fallback":
        return next((m for m in members if health[m].healthy), members[0])
    if view.kind != "url_test":
        return None
    measured = [m for m in members if health[m].healthy and health[m].latency_ms is not None]
    if not measured:
        alive = [m for m in members if health[m].healthy]
        if current in alive:
            return current
        return alive[0] if alive else (current or members[0])
    # min() keeps the first of equal latencies, so ties go to list order.
    best = min(measured, key=lambda m: health[m].latency_ms or 0.0)
    if current in measured:
        gain = (health[current].latency_ms or 0.0) - (health[best].latency_ms or 0.0)
        if gain <= (view.tolerance_ms or 0):
            return current
    return best


def with_health(view: GroupView, updates: Mapping[str, MemberHealth], now_ms: int) -> GroupView:
    """``view`` after a probe round: new member health, reselected by its kind's rule."""
    return _reselected(view, updates, last_checked_unix_ms=now_ms)


def mark_down(view: GroupView, member: str, error: str, now_ms: int) -> GroupView:
    """``view`` after ``member`` failed to dial: unhealthy at once, latency unknown."""
    return _reselected(view, {member: MemberHealth(False, None, now_ms, error)})


def _reselected(view: GroupView, updates: Mapping[str, MemberHealth], **changes: Any) -> GroupView:
    health = dict(view.health)
    health.update(updates)
    updated = replace(view, health=MappingProxyType(health), **changes)
    fixed = updated.fixed
    found_dead = fixed is not None and fixed in updates and not health[fixed].healthy
    if view.kind == "fallback" and found_dead:
        # fallback.go findAliveProxy: a pinned member found dead loses its pin.
        updated = replace(updated, fixed=None)
    if view.kind in PINNABLE_KINDS:
        return replace(updated, selected=choose(updated, view.selected))
    return updated


def _hrw(key: str, members: tuple[str, ...]) -> str:
    def weight(member: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{member}".encode(), digest_size=8).digest()

    return max(members, key=weight)


class PolicyTable:
    """The current view of every group, shared by flows (readers) and group actors.

    Views are immutable and replaced whole; the only other mutable state is the
    round-robin position of each load_balance group.
    """

    def __init__(
        self, views: list[GroupView], on_publish: Callable[[], None] | None = None
    ) -> None:
        # Replacing a key keeps its place, so iteration stays in config order.
        self._views: dict[str, GroupView] = {v.tag: v for v in views}
        self._round_robin = {v.tag: itertools.count() for v in views}
        self._lock = threading.Lock()
        #: The latest ``diagnostics.probe_outbound`` result of each tag (an outbound or a
        #: group), beside what the groups' own rounds found.
        self._probed: dict[str, MemberHealth] = {}
        #: Called after every publish (the engine recompiles the C route table).
        self._on_publish = on_publish

    def publish(self, view: GroupView) -> None:
        """Replace a group's view (called by its actor only)."""
        with self._lock:
            views = dict(self._views)
            views[view.tag] = view
            self._views = views
        if self._on_publish is not None:
            self._on_publish()

    def get(self, tag: str) -> GroupView | None:
        """The current view of ``tag``, or None when it is not a group."""
        return self._views.get(tag)

    def views(self) -> list[GroupView]:
        """Every group's current view, in config order."""
        return list(self._views.values())

    def __contains__(self, tag: object) -> bool:
        return tag in self._views

    def _pick(self, view: GroupView, host: str, source_ip: str) -> str | None:
        if view.kind != "load_balance":
            # None only for a group without members: the walk ends at the group, whose
            # outbound refuses the flow (code no_member).
            return view.selected
        candidates = view.candidates()
        if not candidates:
            return None
        if view.strategy == "consistent_hashing":
            return _hrw(host, candidates)
        if view.strategy == "sticky_sessions":
            return _hrw(source_ip, candidates)
        return candidates[next(self._round_robin[view.tag]) % len(candidates)]

    def resolve(self, tag: str, host: str = "", source_ip: str = "") -> list[str]:
        """The selection chain from ``tag`` to its leaf outbound for a flow to ``host``
        from ``source_ip`` (just ``[tag]`` for an outbound or a relay)."""
        return _walk(self._views, tag, lambda v: self._pick(v, host, source_ip))

    def effective_chains(self, tag: str) -> list[list[str]]:
        """The chains group ``tag`` would use now, ``[[tag]]`` for an outbound."""
        views = self._views
        view = views.get(tag)
        if view is None:
            return [[tag]]
        if view.kind == "relay":
            return [list(view.members)]
        if view.kind == "load_balance":
            return [[tag, *_walk(views, m, _static)] for m in view.candidates()]
        return [_walk(views, tag, _static)]

    def latency_ms(self, tag: str) -> float | None:
        """A group's latency: its selected member's (None when unknown or not probed)."""
        view = self._views.get(tag)
        if view is None or view.selected is None:
            return None
        if view.selected in self._views:
            return self.latency_ms(view.selected)
        return view.health[view.selected].latency_ms if view.probing else None

    def record_probe(self, tag: str, health: MemberHealth) -> None:
        """Keep a ``diagnostics.probe_outbound`` result as ``tag``'s latest health (a
        dashboard's delay test shows in the next read), unless something newer is known.
        It informs readers only: a group's selection follows its own rounds."""
        with self._lock:
            probed = dict(self._probed)
            probed[tag] = health
            self._probed = probed

    def latest_health(self) -> dict[str, tuple[MemberHealth, str | None]]:
        """Per tag, the newest health recorded for it: by any probing group (a probe
        round or a dial failure; with that group's tag) or by ``record_probe`` (with
        None). Tags nothing has checked yet are absent. A tie goes to the group listed
        first, then to the groups over ``record_probe``."""
        latest: dict[str, tuple[MemberHealth, str | None]] = {}
        for view in self._views.values():
            if not view.probing:
                continue
            for member, health in view.health.items():
                checked = health.last_checked_unix_ms
                if checked is None:
                    continue
                known = latest.get(member)
                if known is None or checked > (known[0].last_checked_unix_ms or 0):
                    latest[member] = (health, view.tag)
        for tag, health in self._probed.items():
            known = latest.get(tag)
            checked = health.last_checked_unix_ms or 0
            if known is None or checked > (known[0].last_checked_unix_ms or 0):
                latest[tag] = (health, None)
        return latest

    def snapshot(self, tag: str) -> dict[str, Any]:
        """The PolicySnapshot of group ``tag``: the config summary's group fields and more."""
        view = self._views[tag]
        # Engine-wide, not this group's: a selector's members (which it never probes) and a
        # member another group checked more recently show what is known of them now.
        latest = self.latest_health()
        member_health = []
        for m in view.members:
            known = latest.get(m)
            h, by = known if known is not None else (None, None)
            member_health.append(
                {
                    "member_tag": m,
                    "healthy": h.healthy if h is not None else None,
                    "latency_ms": h.latency_ms if h is not None else None,
                    "last_checked_unix_ms": h.last_checked_unix_ms if h is not None else None,
                    "last_error": h.last_error if h is not None else None,
                    "checked_by": by,
                }
            )
        members = []
        if view.probing:
            for m in view.members:
                h = view.health[m]
                members.append(
                    {
                        "member_tag": m,
                        "healthy": h.healthy,
                        "latency_ms": h.latency_ms,
                        "last_checked_unix_ms": h.last_checked_unix_ms,
                        "last_error": h.last_error,
                        "effective_chains": self.effective_chains(m),
                    }
                )
        snap: dict[str, Any] = {
            "tag": view.tag,
            "kind": view.kind,
            "outbounds": list(view.members),
            "selected": view.selected,
            "fixed": view.fixed,
            "latency_ms": self.latency_ms(tag),
            "last_checked_unix_ms": view.last_checked_unix_ms,
            "effective_chains": self.effective_chains(tag),
            "url_test_members": members,
            "member_health": member_health,
        }
        if view.probing:
            snap["url"] = view.url
            snap["interval_seconds"] = view.interval_seconds
        if view.kind == "url_test":
            snap["tolerance_ms"] = view.tolerance_ms
        if view.kind == "load_balance":
            snap["strategy"] = view.strategy
        return snap


def _static(view: GroupView) -> str | None:
    # A load_balance group's pick depends on the flow: a display walk stops there.
    return None if view.kind == "load_balance" else view.selected


def _walk(
    views: Mapping[str, GroupView], tag: str, pick: Callable[[GroupView], str | None]
) -> list[str]:
    chain = [tag]
    view = views.get(tag)
    # Config validation rejects cycles, so the walk ends at a leaf.
    while view is not None and view.kind != "relay":
        nxt = pick(view)
        if nxt is None:
            break
        chain.append(nxt)
        view = views.get(nxt)
    return chain
