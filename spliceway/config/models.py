"""The document: :class:`Config`, the root model over the section models."""

from __future__ import annotations

from typing import Any

from pydantic import Field, PrivateAttr

from spliceway.config.models_api import Api
from spliceway.config.models_inbounds import Inbound
from spliceway.config.models_outbounds import (
    AnyGroup,
    AnyOutbound,
    DirectOutbound,
    Outbound,
    OutboundGroup,
)
from spliceway.config.models_providers import Providers
from spliceway.config.models_route import Mode, Route, Rule
from spliceway.config.models_runtime import Runtime
from spliceway.config.validators import BUILTIN_DIRECT, _Model

_BUILTIN_DIRECT_OUTBOUND = DirectOutbound(tag=BUILTIN_DIRECT, protocol="direct")


class Config(_Model):
    """A validated configuration. Build it with :func:`parse_config`, not directly.

    Constructing ``Config`` runs only the schema; :func:`parse_config` adds the
    cross-checks (references, uniqueness, cycles) that the engine relies on.
    """

    mode: Mode = Field(default_factory=Mode)
    """The routing mode."""
    inbounds: tuple[Inbound, ...] = ()
    """Listeners that accept client connections."""
    outbounds: tuple[Outbound, ...] = ()
    """Ways to reach targets. The built-in `direct` outbound exists even when not listed."""
    outbound_groups: tuple[OutboundGroup, ...] = ()
    """Groups that choose among outbounds (or other groups) or chain them."""
    rules: tuple[Rule, ...] = ()
    """Routing rules, tried in order in mode `rule`; the first match wins."""
    route: Route = Field(default_factory=Route)
    """What happens to flows no rule matches."""
    providers: Providers = Field(default_factory=Providers)
    """Proxy providers (subscriptions) and rule providers (rule sets)."""
    runtime: Runtime = Field(default_factory=Runtime)
    """Logging, timeouts, sampling, the event ring and DNS."""
    api: Api = Field(default_factory=Api)
    """Control API, event sinks and their outbox."""

    _outbounds: dict[str, AnyOutbound] = PrivateAttr(default_factory=dict)
    _groups: dict[str, AnyGroup] = PrivateAttr(default_factory=dict)

    def model_post_init(self, context: Any, /) -> None:
        """Index tags (the first occurrence wins; duplicates are cross-check errors)."""
        outbounds: dict[str, AnyOutbound] = {}
        for ob in self.outbounds:
            outbounds.setdefault(ob.tag, ob)
        outbounds.setdefault(BUILTIN_DIRECT, _BUILTIN_DIRECT_OUTBOUND)
        groups: dict[str, AnyGroup] = {}
        for g in self.outbound_groups:
            groups.setdefault(g.tag, g)
        self._outbounds, self._groups = outbounds, groups

    def to_dict(self) -> dict[str, Any]:
        """The normalised document (every default filled in); ``parse_config`` accepts it."""
        return self.model_dump(mode="json")

    def outbound_tags(self) -> tuple[str, ...]:
        """Tags of plain outbounds in document order, plus the built-in ``direct`` if unlisted."""
        return tuple(self._outbounds)

    def group_tags(self) -> tuple[str, ...]:
        """Tags of outbound groups in document order."""
        return tuple(self._groups)

    def is_target(self, tag: str) -> bool:
        """Whether ``tag`` names an outbound (built-in ``direct`` included) or a group."""
        return tag in self._outbounds or tag in self._groups

    def find_outbound(self, tag: str) -> AnyOutbound | None:
        """The plain outbound ``tag`` (the built-in ``direct`` if unlisted), else None."""
        return self._outbounds.get(tag)

    def find_group(self, tag: str) -> AnyGroup | None:
        """The outbound group ``tag``, else None."""
        return self._groups.get(tag)


def resolve_ipc(config: Config, unset_default: bool) -> Config:
    """``config`` with ``api.ipc.enabled`` decided (see :meth:`IpcApi.serves`), so the
    running engine, its ``config`` query and a reload's comparison see a plain bool."""
    ipc = config.api.ipc
    if ipc.enabled is not None:
        return config
    decided = ipc.model_copy(update={"enabled": ipc.serves(unset_default)})
    return config.model_copy(update={"api": config.api.model_copy(update={"ipc": decided})})
