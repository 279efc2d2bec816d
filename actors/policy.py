"""PolicyGroupActor: owns one policy group's selection and probe state.

It runs on the dispatcher loop like the flows, so probe rounds are tasks that
dial through the same outbounds the flows use. It is the only writer of its
group's :class:`~spliceway.routing.policy.GroupView`, published to the engine's
``PolicyTable`` after every change, and it emits ``policy.selected`` (selector)
and ``policy.probe.completed`` (each finished round of a probing group).

Rounds start at startup, every ``interval_seconds``, on ``policies.probe`` and
when a flow reports that a member failed to dial; at most one runs at a time.

A url_test or fallback group left with no healthy member warns once (a WARNING log
line and ``engine.warning`` ``policy_no_healthy_member``) when it gets there, and logs
at INFO when a member is healthy again; the rounds in between say nothing more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from spliceway.actors.dispatcher import LoopActor
from spliceway.control.messages import ProbeNow, SelectMember, UnfixMember
from spliceway.errors import invalid_argument
from spliceway.events.log import now_ms
from spliceway.flows.probe import ProbeResult, probe
from spliceway.routing import policy
from spliceway.support.loop import Dispatcher

if TYPE_CHECKING:
    from spliceway.events.log import EventLog
    from spliceway.flows.outbounds import Outbound

logger = logging.getLogger(__name__)

#: The ``engine.warning`` code of a url_test or fallback group with no healthy member.
NO_HEALTHY_MEMBER = "policy_no_healthy_member"
#: Kinds that fall back to an unhealthy member when none is healthy: the warning's kinds
#: (a load_balance group spreads over all members then, a selector is never probed).
_HEALTH_WARNED_KINDS = frozenset({"url_test", "fallback"})


class MemberFailed(NamedTuple):
    """A flow could not dial through ``member``: mark it down and probe again."""

    member: str
    error: str


@dataclasses.dataclass(frozen=True, slots=True)
class GroupPorts:
    """What a PolicyGroupActor uses of the engine."""

    dispatcher: Dispatcher
    log: EventLog
    #: The policy table now (a reload replaces it; a kept group's view carries over).
    policies: Callable[[], policy.PolicyTable]
    #: The outbound a tag (an outbound or a group) uses now.
    leaf_outbound: Callable[[str], Outbound]


class PolicyGroupActor(LoopActor):
    """One outbound group (any kind); probing kinds also run probe rounds."""

    def __init__(self, ports: GroupPorts, view: policy.GroupView) -> None:
        super().__init__(ports.dispatcher)
        self.ports = ports
        self.tag = view.tag
        self._round: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        #: True from the warning about no healthy member until one is healthy again.
        self._none_healthy = False

    @property
    def view(self) -> policy.GroupView:
        """This group's current (published) view."""
        view = self.ports.policies().get(self.tag)
        assert view is not None
        return view

    def on_start(self) -> None:
        """Probing groups start their first round and their interval timer."""
        if self.view.probing:
            self._start_round("startup")
            self._arm_timer()

    def on_stop(self) -> None:
        """Cancel the timer and any running round."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._round is not None and not self._round.done():
            self._round.cancel()

    def on_receive(self, message: Any) -> Any:
        """Handle selection, probe requests and dial-failure reports."""
        if isinstance(message, SelectMember):
            return self._select(message.target)
        if isinstance(message, UnfixMember):
            return self._unfix()
        if isinstance(message, ProbeNow):
            return self._start_round(message.trigger)
        if isinstance(message, MemberFailed):
            self._member_failed(message.member, message.error)
        return None

    # -- selector ------------------------------------------------------------------

    def _select(self, target: str) -> dict[str, Any]:
        view = self.view
        if view.kind != "selector" and view.kind not in policy.PINNABLE_KINDS:
            raise invalid_argument(
                f"policy {self.tag!r} is a {view.kind} group; only a selector can be "
                "selected and only a url_test or fallback group pinned",
                field_path="params.policy_tag",
            )
        if target not in view.members:
            raise invalid_argument(
                f"{target!r} is not a member of {view.kind} {self.tag!r} "
                f"(members: {', '.join(view.members)})",
                field_path="params.target_tag",
            )
        previous = view.selected
        if view.kind == "selector":
            updated = dataclasses.replace(view, selected=target)
            action = "select"
        else:
            updated = policy.pinned(view, target)
            action = "fix"
        self.ports.policies().publish(updated)
        self._emit_selected(view, updated, action, previous)
        if action == "fix" and not view.health[target].healthy:
            # fallback.go Set: a pinned member not known alive is tested at once, so the
            # pin takes effect (or, for fallback, is dropped) without waiting a round.
            self._start_round("manual")
        result: dict[str, Any] = {"policy_tag": self.tag, "selected": updated.selected}
        if action == "fix":
            result["fixed"] = target
        return result

    def _unfix(self) -> dict[str, Any]:
        view = self.view
        if view.kind not in policy.PINNABLE_KINDS:
            raise invalid_argument(
                f"policy {self.tag!r} is a {view.kind} group; only a url_test or fallback "
                "group has a pin to drop",
                field_path="params.policy_tag",
            )
        previous_fixed = view.fixed
        if previous_fixed is not None:
            updated = policy.pinned(view, None)
            self.ports.policies().publish(updated)
            self._emit_selected(view, updated, "unfix", view.selected)
        else:
            updated = view
        return {
            "policy_tag": self.tag,
            "selected": updated.selected,
            "fixed": None,
            "previous_fixed": previous_fixed,
        }

    def _emit_selected(
        self,
        before: policy.GroupView,
        after: policy.GroupView,
        action: str,
        previous: str | None,
    ) -> None:
        self.ports.log.emit(
            "policy.selected",
            {
                "policy_tag": self.tag,
                "policy_kind": before.kind,
                "selected": after.selected,
                "previous": previous,
                "action": action,
                "fixed": after.fixed,
            },
        )

    # -- health ---------------------------------------------------------------------

    def _member_failed(self, member: str, error: str) -> None:
        view = self.view
        if not view.probing or member not in view.members:
            return
        updated = policy.mark_down(view, member, error, now_ms())
        self.ports.policies().publish(updated)
        self._watch_health(updated)
        self._start_round("dial_failure")

    def _watch_health(self, view: policy.GroupView) -> None:
        """Warn when the group has just lost its last healthy member, note when it has one
        again: once per transition, so a dead upstream does not repeat itself every round."""
        if view.kind not in _HEALTH_WARNED_KINDS or not view.members:
            return
        healthy = [m for m in view.members if view.health[m].healthy]
        none_healthy = not healthy
        if none_healthy == self._none_healthy:
            return  # no transition
        self._none_healthy = none_healthy
        if healthy:
            logger.info(
                "policy group %r (%s) has a healthy member again: %s",
                self.tag,
                view.kind,
                ", ".join(healthy),
            )
            return
        reasons = "; ".join(
            f"{m}: {view.health[m].last_error or 'unhealthy'}" for m in view.members
        )
        message = (
            f"policy group {self.tag!r} ({view.kind}) has no healthy member ({reasons}); "
            f"its flows go to {view.selected!r} until a member is healthy again"
        )
        logger.warning("%s", message)
        self.ports.log.emit("engine.warning", {"code": NO_HEALTHY_MEMBER, "message": message})

    def _arm_timer(self) -> None:
        interval = self.view.interval_seconds
        if interval:
            self._timer = self.dispatcher.loop.call_later(interval, self._on_timer)

    def _on_timer(self) -> None:
        if self.actor_stopped.is_set():
            return
        self._start_round("scheduled")
        self._arm_timer()

    def _start_round(self, trigger: str) -> bool:
        view = self.view
        busy = self._round is not None and not self._round.done()
        # A group without members (its providers gave none yet) has nothing to probe.
        if not view.probing or not view.members or busy:
            return False
        self._round = self.dispatcher.spawn(self._run_round(trigger))
        return True

    async def _run_round(self, trigger: str) -> None:
        try:
            await self._probe_members(trigger)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("probe round of %s failed", self.tag)

    async def _probe_members(self, trigger: str) -> None:
        view = self.view
        ports = self.ports
        assert view.url is not None
        url = policy.parse_probe_url(view.url)
        loop = self.dispatcher.loop
        started = now_ms()
        results: list[ProbeResult] = await asyncio.gather(
            *(probe(loop, ports.leaf_outbound(m), url) for m in view.members)
        )
        if self.actor_stopped.is_set():
            return
        completed = now_ms()
        updates = {
            m: policy.MemberHealth(r.reachable, r.latency_ms, completed, r.error)
            for m, r in zip(view.members, results, strict=True)
        }
        # Take the view again: a selection or a dial failure may have landed meanwhile.
        updated = policy.with_health(self.view, updates, completed)
        ports.policies().publish(updated)
        ports.log.emit(
            "policy.probe.completed",
            {
                "policy_tag": self.tag,
                "trigger": trigger,
                "url": view.url,
                "started_at_unix_ms": started,
                "completed_at_unix_ms": completed,
                "duration_ms": completed - started,
                "selected": updated.selected,
                "members": [
                    {
                        "target_tag": m,
                        "healthy": r.reachable,
                        "latency_ms": r.latency_ms,
                        "error": r.error,
                    }
                    for m, r in zip(view.members, results, strict=True)
                ],
            },
        )
        # After the round's own event: the warning is what the round found.
        self._watch_health(updated)
