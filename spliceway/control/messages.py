"""The messages a command sends to the engine's actors: immutable values.

They are the control plane's half of the conversation, so they live here, below the
actors: ``commands`` asks with them without importing any actor, and the actors
that answer (flows, UDP associations, policy groups) import them from here.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["CloseFlow", "ProbeNow", "SelectMember", "UnfixMember", "UpdateProviders"]


class CloseFlow(NamedTuple):
    """``flows.close``: end the flow now (outcome cancelled, close_reason manual)."""

    #: Which flow (an actor holding several, a UDP association, needs it).
    flow_id: str = ""


class SelectMember(NamedTuple):
    """``policies.select``: use ``target`` (a direct member of this selector), or pin it
    (a url_test or fallback group: mihomo's ``fixed``)."""

    target: str


class UnfixMember(NamedTuple):
    """``policies.unfix``: drop a url_test or fallback group's pin."""


class ProbeNow(NamedTuple):
    """Start a probe round unless one is running; answers whether it started."""

    trigger: str


class UpdateProviders(NamedTuple):
    """``providers.update``: refresh now the providers named ``name`` of ``kinds`` (every
    provider and the geodata when ``name`` is None); answers one result per provider."""

    name: str | None = None
    kinds: tuple[str, ...] = ("proxies", "rules", "geodata")
