"""Which components two configurations differ in: what an apply must replace.

A pure value over two validated documents, in the manner of Vector's ``ConfigDiff``
(``src/config/diff.rs``): :func:`diff` compares, :class:`ConfigDiff` says what differs,
and the reload (:mod:`spliceway.engine.reconcile`) acts on it and reports
:attr:`ConfigDiff.changed` as ``changed_components``. Nothing here binds, resolves or
reads the running engine, so every rule below is tested on documents alone.

What counts as a change, per component (in :data:`COMPONENTS` order):

- ``proxy_listeners``: an inbound added, removed or changed, by tag. Every kept inbound
  counts as changed when ``runtime.tcp_idle_timeout_seconds`` changes, since a
  listener carries the idle timeout of the flows it accepts. Reordering inbounds
  changes nothing (a listener is found by its tag).
- ``outbounds``: the ``outbounds`` list (order included).
- ``policy_groups``: ``outbound_groups`` or ``runtime.latency_test_url`` (the groups'
  default probe URL).
- ``routing``: ``rules``, ``route`` or ``mode``.
- ``dns``: ``runtime.dns``.
- ``flow_hook``: ``api.flow_hook``.
- ``event_dispatcher``: ``api.event_sinks`` or ``api.dispatcher``.
- ``runtime``: anything in ``runtime`` (so also with ``dns`` or ``tun``).
- ``tun``: ``runtime.tun``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from spliceway.config.models import Config

#: The components an apply reconciles, in the order it reports them.
COMPONENTS: Final = (
    "proxy_listeners",
    "outbounds",
    "policy_groups",
    "routing",
    "dns",
    "flow_hook",
    "event_dispatcher",
    "runtime",
    "tun",
)


@dataclass(frozen=True, slots=True)
class Difference:
    """Keys (tags) of one keyed section: added, changed and removed (Vector's
    ``Difference``)."""

    to_add: frozenset[str] = frozenset()
    to_change: frozenset[str] = frozenset()
    to_remove: frozenset[str] = frozenset()

    @classmethod
    def between(
        cls,
        old: Mapping[str, object],
        new: Mapping[str, object],
        *,
        change_all_kept: bool = False,
    ) -> Difference:
        """The difference from ``old`` to ``new`` (each keyed by tag); with
        ``change_all_kept`` every key in both counts as changed, equal or not."""
        kept = old.keys() & new.keys()
        changed = kept if change_all_kept else {k for k in kept if old[k] != new[k]}
        return cls(
            to_add=frozenset(new.keys() - old.keys()),
            to_change=frozenset(changed),
            to_remove=frozenset(old.keys() - new.keys()),
        )

    def is_empty(self) -> bool:
        """Whether nothing was added, changed or removed."""
        return not (self.to_add or self.to_change or self.to_remove)


@dataclass(frozen=True, slots=True)
class ConfigDiff:
    """What differs between two configurations, component by component."""

    inbounds: Difference
    outbounds: bool
    policy_groups: bool
    routing: bool
    dns: bool
    flow_hook: bool
    event_dispatcher: bool
    runtime: bool
    tun: bool

    @property
    def proxy_listeners(self) -> bool:
        """Whether any listener starts, stops or restarts."""
        return not self.inbounds.is_empty()

    @property
    def changed(self) -> tuple[str, ...]:
        """The names of the components that differ, in :data:`COMPONENTS` order."""
        flags = {
            "proxy_listeners": self.proxy_listeners,
            "outbounds": self.outbounds,
            "policy_groups": self.policy_groups,
            "routing": self.routing,
            "dns": self.dns,
            "flow_hook": self.flow_hook,
            "event_dispatcher": self.event_dispatcher,
            "runtime": self.runtime,
            "tun": self.tun,
        }
        return tuple(name for name in COMPONENTS if flags[name])

    def is_empty(self) -> bool:
        """Whether the two configurations need nothing replaced."""
        return not self.changed


def diff(old: Config, new: Config) -> ConfigDiff:
    """What an apply of ``new`` over a running ``old`` must replace."""
    idle_changed = old.runtime.tcp_idle_timeout_seconds != new.runtime.tcp_idle_timeout_seconds
    return ConfigDiff(
        # Tags are unique in a validated document (a cross-check), so no inbound is lost.
        inbounds=Difference.between(
            {ib.tag: ib for ib in old.inbounds},
            {ib.tag: ib for ib in new.inbounds},
            change_all_kept=idle_changed,
        ),
        outbounds=old.outbounds != new.outbounds,
        policy_groups=(
            old.outbound_groups != new.outbound_groups
            or old.runtime.latency_test_url != new.runtime.latency_test_url
        ),
        routing=(old.rules, old.route, old.mode) != (new.rules, new.route, new.mode),
        dns=old.runtime.dns != new.runtime.dns,
        flow_hook=old.api.flow_hook != new.api.flow_hook,
        event_dispatcher=(
            (old.api.event_sinks, old.api.dispatcher) != (new.api.event_sinks, new.api.dispatcher)
        ),
        runtime=old.runtime != new.runtime,
        tun=old.runtime.tun != new.runtime.tun,
    )
