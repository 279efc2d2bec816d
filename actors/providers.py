"""ProviderRefresherActor: owns the providers' refresh schedule and runs every refresh.

One thread of its own (a ``pykka.ThreadingActor``, not a loop actor): a refresh waits for
downloads (which run on the dispatcher loop, through the engine's outbounds), reads and
checks bodies that may be megabytes of YAML, and applies a configuration, which waits on
the dispatcher; none of that may block the loop flows run on. Messages are handled one
at a time, so two refreshes never run side by side, and ``providers.update`` waits
behind a scheduled round rather than racing it.

The plan, recomputed after every round and every apply that changes the providers:

- a URL provider is due ``interval_seconds`` after its copy was fetched (or last found
  unchanged), so a restart does not fetch again what is still fresh; one without a good
  copy is due at once, and after a failure again within :data:`RETRY_S` at most;
- a ``path`` provider is re-read every ``interval_seconds`` (and applied only when the
  file's content changed);
- geodata is downloaded only by ``providers.update`` (never on a schedule).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pykka

from spliceway.control.messages import UpdateProviders
from spliceway.engine.providers import RETRY_S, Kind, Providers, ProviderState, RefreshPorts, counts

if TYPE_CHECKING:
    from spliceway.config import Config

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RefresherPorts:
    """What the refresher uses of the engine."""

    providers: Providers
    refresh: RefreshPorts
    #: The running configuration as written (what a new body's merge is tried on).
    source: Callable[[], Config]


class _Tick:
    """The timer's message: run what is due."""


class _Replan:
    """The providers changed (an apply): plan again."""


def check_due_at(state: ProviderState, last_ms: int) -> int | None:
    """When a proxy provider's next health check is due: ``health_check.interval_seconds``
    after the last one (or the refresher's start); None without an enabled check."""
    if state.health_check is None:
        return None
    return last_ms + state.health_check[1] * 1000


class StartRound:
    """At start: fetch every URL provider that has no copy yet (the engine waits for this
    round a short while, so a reachable subscription is in the first routes)."""


def due_at(state: ProviderState, started_ms: int) -> int | None:
    """When ``state``'s next scheduled refresh is due (UNIX ms); None: never scheduled."""
    if state.kind == "geodata" or state.interval_seconds is None:
        return None
    interval = state.interval_seconds * 1000
    failed = state.last_error is not None and state.checked_at_ms is not None
    if state.url is None:
        return (state.checked_at_ms or started_ms) + interval
    if failed:
        assert state.checked_at_ms is not None
        return state.checked_at_ms + min(interval, RETRY_S * 1000)
    if state.updated_at_ms is None:
        return started_ms  # never fetched: at once
    return state.updated_at_ms + interval


def result_item(outcome: Any, state: ProviderState | None) -> dict[str, Any]:
    """One provider's item of the ``providers.update`` result."""
    item = outcome.to_dict(state)
    if state is not None:
        item.update(counts(state))
    return item


class ProviderRefresherActor(pykka.ThreadingActor):
    """Refreshes providers on their schedule and on ``providers.update``."""

    #: A round blocked in a download must not keep the process alive.
    use_daemon_thread = True

    def __init__(self, ports: RefresherPorts) -> None:
        super().__init__()
        self.ports = ports
        self._started_ms = int(time.time() * 1000)
        self._timer: threading.Timer | None = None
        self._plan: dict[tuple[Kind, str], int] = {}
        #: When each proxy provider's health check last ran (the start until it has).
        self._checked: dict[str, int] = {}
        self._checks: dict[str, int] = {}

    def on_start(self) -> None:
        """Follow the applies that change the providers (the first plan is made by
        :class:`StartRound`, which the engine sends at once)."""
        ref = self.actor_ref

        def changed() -> None:
            with contextlib.suppress(pykka.ActorDeadError):
                ref.tell(_Replan())

        self.ports.providers.on_changed = changed

    def on_stop(self) -> None:
        """Cancel the timer; an apply no longer tells this actor."""
        self.ports.providers.on_changed = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def on_receive(self, message: Any) -> Any:
        """Run a round (scheduled, at start, or asked for) or plan again."""
        if isinstance(message, UpdateProviders):
            return self._update(message)
        if isinstance(message, StartRound):
            return self._start_round()
        if isinstance(message, _Tick):
            self._run_due()
        elif isinstance(message, _Replan):
            self._replan()
        return None

    # -- rounds ------------------------------------------------------------------------

    def _round(self, targets: list[tuple[Kind, str]], trigger: str) -> list[dict[str, Any]]:
        if not targets:
            self._replan()
            return []
        try:
            done = self.ports.providers.refresh(
                self.ports.refresh, targets, trigger, self.ports.source
            )
        finally:
            self._replan()
        return [result_item(outcome, state) for outcome, state in done]

    def _update(self, message: UpdateProviders) -> list[dict[str, Any]]:
        targets = [
            (s.kind, s.name)
            for s in self.ports.providers.states()
            if s.kind in message.kinds and message.name in (None, s.name)
        ]
        return self._round(targets, "manual")

    def _start_round(self) -> list[dict[str, Any]]:
        targets: list[tuple[Kind, str]] = [
            (s.kind, s.name)
            for s in self.ports.providers.states()
            if s.kind != "geodata" and s.url is not None and not s.has_copy
        ]
        return self._round(targets, "startup")

    def _run_due(self) -> None:
        now = int(time.time() * 1000)
        due = [key for key, at in self._plan.items() if at <= now]
        checks = [name for name, at in self._checks.items() if at <= now]
        for name in checks:
            try:
                self.ports.providers.health_check(self.ports.refresh, name)
            except Exception:  # a bug of ours must not end the refresher
                logger.exception("the health check of provider %s failed", name)
            self._checked[name] = int(time.time() * 1000)
        self._round(due, "scheduled")

    # -- the plan ----------------------------------------------------------------------

    def _replan(self) -> None:
        providers = self.ports.providers
        plan: dict[tuple[Kind, str], int] = {}
        for state in providers.states():
            at = due_at(state, self._started_ms)
            providers.schedule(state.kind, state.name, at)
            if at is not None:
                plan[(state.kind, state.name)] = at
        self._plan = plan
        checks: dict[str, int] = {}
        for state in providers.states():
            check = check_due_at(state, self._checked.get(state.name, self._started_ms))
            if state.kind == "proxies" and check is not None:
                checks[state.name] = check
        self._checks = checks
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        times = [*plan.values(), *checks.values()]
        if not times:
            return
        delay = max(0.0, (min(times) - time.time() * 1000) / 1000)
        ref = self.actor_ref

        def tick() -> None:
            with contextlib.suppress(pykka.ActorDeadError):
                ref.tell(_Tick())

        self._timer = threading.Timer(delay, tick)
        self._timer.daemon = True
        self._timer.start()
