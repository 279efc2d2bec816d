"""The Connector: the engine's event sinks, their outboxes and the intake, as one part.

Start: open the outbox directory (lock, recovery), one outbox per sink, then
one ``SinkActor`` per registration, then the intake. Stop (after the engine's
last event, engine.stopped, is in the log): the intake takes in what the log
still holds, the sinks get a short grace to deliver it, then each in-flight
request is aborted, the actors stop (making their ACKs durable) and the outbox
lock is released. Undelivered events stay in the outbox for the next start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import orjson
import pykka

from spliceway.actors.sink import SinkActor, SinkState, Transport
from spliceway.config import Api, JsonlSink, NatsSink, Sink, one_sink_environment_problems
from spliceway.connector.diskgate import DiskGate, Storage
from spliceway.connector.intake import Feed, Intake, with_source
from spliceway.connector.jetstream import NatsPublisher, parse_credentials
from spliceway.connector.jsonl import JsonlWriter
from spliceway.connector.outbox import DiskOutbox, MemoryOutbox, Outbox, OutboxStore
from spliceway.connector.policy import DeliveryPolicy
from spliceway.connector.signing import Signer, secret_key
from spliceway.connector.webhook import WebhookClient
from spliceway.errors import ApiError
from spliceway.events.log import EventLog, normalize_types
from spliceway.flows import log as flowlog
from spliceway.flows.records import Completion, crashed_completion

#: The event a sink must select to be owed crash completions.
COMPLETED = "flow.completed"

logger = logging.getLogger(__name__)

#: How long start waits, in all, for the sinks to take the crash completions.
ORPHAN_WAIT_S = 5.0
#: How long stop waits for sinks that are still making progress.
STOP_GRACE_S = 3.0
#: How long a sink a reload removes may go on delivering what it had taken in.
RETIRE_GRACE_S = 1.0
_STALL_S = 0.5


@dataclass(slots=True)
class SinkSlot:
    """One registration and the parts that serve it."""

    spec: Sink
    outbox: Outbox
    feed: Feed
    state: SinkState
    transport: Transport
    signer: Signer | None = None
    ref: pykka.ActorRef[SinkActor] | None = None


class Connector:
    """Every configured sink of one engine."""

    def __init__(self, api: Api, log: EventLog) -> None:
        self.api = api
        self.log = log
        self.policy = DeliveryPolicy.from_config(api.dispatcher)
        self.store: OutboxStore | None = None
        self.gate: DiskGate | None = None
        self.slots: list[SinkSlot] = []
        self.intake: Intake | None = None
        #: Where each sink a reload removed had taken the log to: one re-added under the
        #: same tag (or restored by a rollback) resumes there, as far as the log holds.
        self._cursors: dict[str, int] = {}

    @property
    def enabled(self) -> bool:
        """Whether any sink is configured."""
        return bool(self.api.event_sinks)

    def start(self) -> None:
        """Open the outbox and start every sink; raises ApiError (nothing left running)."""
        if not self.enabled:
            return
        try:
            self._open_store()
            for i, spec in enumerate(self.api.event_sinks):
                self.slots.append(self._open_slot(i, spec))
        except BaseException:
            self._close_all()
            raise
        for slot in self.slots:
            self._start_actor(slot)
        self.intake = Intake(self.log, [s.feed for s in self.slots], self.gate)
        self.intake.start()

    def reconfigure(self, api: Api) -> None:
        """Make the running sinks those ``api`` registers (a reload, on any thread).

        A sink whose registration and the dispatcher settings are unchanged keeps
        running untouched; a changed one restarts on its own outbox; a removed one
        stops, its undelivered events staying in its outbox on disk (``spliceway
        connector state``). A new sink takes events from now on. Raises ApiError when a
        sink cannot open; calling again with the previous ``api`` converges back.
        """
        policy_same = api.dispatcher == self.api.dispatcher
        wanted = {spec.tag: spec for spec in api.event_sinks}
        keep = [s for s in self.slots if policy_same and wanted.get(s.spec.tag) == s.spec]
        for slot in [s for s in self.slots if s not in keep]:
            self._retire(slot)
        self.api = api
        self.policy = DeliveryPolicy.from_config(api.dispatcher)
        kept = {s.spec.tag for s in keep}
        if len(kept) == len(api.event_sinks):
            return
        self._open_store()
        for i, spec in enumerate(api.event_sinks):
            if spec.tag in kept:
                continue
            slot = self._open_slot(i, spec)
            slot.feed.cursor = self._cursors.pop(spec.tag, self.log.latest_sequence)
            slot.feed.selected = self.log.count_before(slot.feed.cursor + 1, slot.feed.types)
            self.slots.append(slot)
            self._start_actor(slot)
            if self.intake is None:
                self.intake = Intake(self.log, [], self.gate)
                self.intake.start()
            with self.intake.lock:
                self.intake.feeds = [*self.intake.feeds, slot.feed]
        order = {tag: i for i, tag in enumerate(wanted)}
        self.slots.sort(key=lambda s: order[s.spec.tag])

    def _retire(self, slot: SinkSlot) -> None:
        """Stop one sink for good: it takes in every event emitted before the reload,
        delivers what it can within a short grace, and its outbox keeps the rest."""
        if self.intake is not None:
            with self.intake.lock:
                self.intake.feeds = [f for f in self.intake.feeds if f is not slot.feed]
                self.intake.take_in(slot.feed)
        self._drain([slot], RETIRE_GRACE_S)
        self._cursors[slot.spec.tag] = slot.feed.cursor
        if not isinstance(slot.transport, JsonlWriter):
            slot.transport.abort()
        if slot.ref is not None:
            with contextlib.suppress(pykka.ActorDeadError):
                slot.ref.stop(timeout=STOP_GRACE_S)
        with contextlib.suppress(OSError):
            slot.outbox.close()
        self.slots.remove(slot)

    def _start_actor(self, slot: SinkSlot) -> None:
        slot.ref = SinkActor.start(
            slot.spec.tag,
            slot.transport,
            slot.outbox,
            slot.feed,
            self.policy,
            slot.state,
            self.gate,
            slot.signer,
        )

    def orphan_flow_ids(self) -> set[str]:
        """Every flow some sink's outbox showed started and not completed at start."""
        return {flow_id for slot in self.slots for flow_id in _orphans(slot)}

    def complete_orphans(self) -> int:
        """Complete the flows a previous run left open (after engine.started, before any
        flow starts); returns how many flows were completed.

        One ``flow.completed`` with outcome ``engine_crashed`` per flow (records.py
        ``crashed_completion``, from the newest record any sink kept), emitted into the
        ring like any event, so streams see it and each sink's intake writes it to its
        outbox, the normal durable path. A sink takes only the completions of flows its
        own outbox showed open: one that had already taken a flow's flow.completed before
        the crash (the intake feeds sinks one after the other) gets no second one. A
        crash before a sink committed its completion leaves that flow open in its outbox,
        and the next start completes it again; once committed it is closed for good.
        A sink that owes a flow whose real flow.completed another sink's outbox still
        holds gets that event instead (``_resend_completions``), so every sink ends the
        flow with the same event.

        The ring must not evict a completion before every intake took it: they go out in
        chunks of a quarter of the ring, each taken by every sink before the next goes
        (a bounded wait: past it, a sink that could not take them, its disk full, gets
        them at a later start). One chunk, the usual case, does not wait at all.
        """
        owed = {slot.spec.tag: _orphans(slot) for slot in self.slots}
        if self.intake is None or not any(owed.values()):
            return 0
        resent = self._resend_completions(owed)
        kept: dict[str, list[bytes]] = {}
        for orphans in owed.values():
            for flow_id, bodies in orphans.items():
                kept.setdefault(flow_id, []).extend(bodies)
        completions: list[tuple[str, Completion]] = []
        for flow_id, bodies in kept.items():
            try:
                completions.append((flow_id, crashed_completion([orjson.loads(b) for b in bodies])))
            except (ValueError, KeyError, TypeError, AttributeError) as ex:
                # Never raised; forgotten, so the next checkpoint leaves it out.
                logger.warning("cannot complete flow %s left open by a crash: %r", flow_id, ex)
                for slot in self.slots:
                    if isinstance(slot.outbox, DiskOutbox):
                        slot.outbox.forget_flow(flow_id)
        completions.sort(key=lambda c: (c[1].occurred_at_unix_ms, c[0]))
        chunk = max(1, self.log.capacity // 4)
        deadline = time.monotonic() + ORPHAN_WAIT_S
        for start in range(0, len(completions), chunk):
            if start:
                # The previous chunk taken by every sink before the ring moves on.
                last = self.log.latest_sequence
                while time.monotonic() < deadline and any(
                    s.feed.cursor < last for s in self.slots
                ):
                    time.sleep(0.005)
            intake = self.intake
            with intake.lock:  # the intake reads none before its sinks' skips are set
                for flow_id, done in completions[start : start + chunk]:
                    envelope = self.log.emit(
                        "flow.completed",
                        done.payload,
                        principal_key=done.principal_key,
                        labels=done.labels,
                        occurred_at_unix_ms=done.occurred_at_unix_ms,
                    )
                    for slot in self.slots:
                        if flow_id not in owed[slot.spec.tag]:
                            slot.feed.skip.add(envelope["sequence"])
                    flowlog.log_completed(done.state)  # its one line, as every flow has
        logger.info(
            "completed %d flows the previous run left open (outcome engine_crashed; %d more "
            "got the flow.completed another sink had taken)",
            len(completions),
            resent,
        )
        return len(completions) + resent

    def _resend_completions(self, owed: dict[str, dict[str, list[bytes]]]) -> int:
        """Give a sink the real flow.completed of a flow it owes when another sink's outbox
        still holds it (the intake feeds sinks one after the other, so a kill can land
        after one took a completion and before the next did): the same event, same
        ``event_id``, stamped with this sink's ``source_id``, written to its outbox as a
        redelivery (not into the ring: it is an event of the previous run). The flows so
        settled leave ``owed``; returns how many flows were settled for every sink."""
        wanted = {flow_id for orphans in owed.values() for flow_id in orphans}
        real: dict[str, bytes] = {}
        for slot in self.slots:
            if isinstance(slot.outbox, DiskOutbox):
                look = wanted - owed[slot.spec.tag].keys() - real.keys()
                real.update(slot.outbox.find_completions(look))
        if not real:
            return 0
        assert self.intake is not None
        with self.intake.lock:  # the intake's own writes wait: one writer per outbox
            for slot in self.slots:
                orphans = owed[slot.spec.tag]
                mine = [flow_id for flow_id in orphans if flow_id in real]
                if not mine:
                    continue
                source = slot.feed.source_id
                try:
                    slot.outbox.append([with_source(real[flow_id], source) for flow_id in mine])
                    slot.outbox.commit()
                except OSError as ex:
                    # Still open in this sink's outbox: completed below, or at a later start.
                    logger.warning("sink %s: cannot write completions: %s", slot.spec.tag, ex)
                    continue
                slot.feed.notify()
                owed[slot.spec.tag] = {k: v for k, v in orphans.items() if k not in real}
        still = {flow_id for orphans in owed.values() for flow_id in orphans}
        return len(real.keys() - still)

    def _open_store(self) -> None:
        api = self.api
        if api.outbox_path is not None and self.store is None:
            self.store = OutboxStore(api.outbox_path)
            self.gate = DiskGate(
                api.outbox_path, api.outbox_min_free_bytes, api.outbox_min_free_percent
            )

    def _open_slot(self, i: int, spec: Sink) -> SinkSlot:
        problems = one_sink_environment_problems(i, spec)
        if problems:
            raise ApiError(
                "invalid_argument",
                f"sink {spec.tag!r} cannot start: {problems[0].message}",
                field_path=problems[0].field_path,
            )
        # Only a sink that delivers flow.completed is owed crash completions.
        track = normalize_types(spec.events) is None or COMPLETED in spec.events
        outbox: Outbox = (
            self.store.open_sink(spec.tag, track_flows=track) if self.store else MemoryOutbox()
        )
        try:
            transport, signer = self._transport(spec)
        except (OSError, ValueError) as ex:
            outbox.close()
            raise ApiError(
                "invalid_argument",
                f"sink {spec.tag!r} cannot start: {ex}",
                field_path=f"api.event_sinks[{i}]",
            ) from ex
        feed = Feed.for_sink(spec.tag, spec.events, getattr(spec, "source_id", None), outbox)
        if outbox.recovery.state != "clean":
            logger.warning(
                "sink %s: outbox recovered with damage: %s", spec.tag, outbox.recovery.to_dict()
            )
        return SinkSlot(spec, outbox, feed, SinkState(), transport, signer)

    def _transport(self, spec: Sink) -> tuple[Transport, Signer | None]:
        """What delivers ``spec``'s events; ValueError/OSError when it cannot."""
        timeout_ms = self.api.dispatcher.request_timeout_ms
        if isinstance(spec, JsonlSink):
            return JsonlWriter(spec.path), None
        if isinstance(spec, NatsSink):
            env = spec.credentials_env
            credentials = parse_credentials(os.environ[env]) if env is not None else None
            return NatsPublisher(spec.servers, spec.subject, timeout_ms, credentials), None
        signer = Signer(secret_key(os.environ[spec.secret_env])) if spec.secret_env else None
        return WebhookClient(spec.url, spec.headers, timeout_ms), signer

    def stop(self) -> None:
        """Take in the log's last events, let sinks deliver briefly, then stop them."""
        if self.intake is not None:
            self.intake.stop()
            self.intake = None
        self._drain(self.slots, STOP_GRACE_S)
        for slot in self.slots:
            if not isinstance(slot.transport, JsonlWriter):
                slot.transport.abort()
        for slot in self.slots:
            if slot.ref is not None:
                with contextlib.suppress(pykka.ActorDeadError):
                    slot.ref.stop(timeout=STOP_GRACE_S)
        self._close_all()

    def _drain(self, slots: list[SinkSlot], grace_s: float) -> None:
        """Wait up to ``grace_s`` for ``slots`` to deliver, while they make progress."""
        deadline = time.monotonic() + grace_s
        last = _backlog(slots)
        progress_at = time.monotonic()
        while last and time.monotonic() < deadline:
            time.sleep(0.02)
            now = _backlog(slots)
            if now < last:
                progress_at = time.monotonic()
            elif time.monotonic() - progress_at > _STALL_S:
                return
            last = now

    def _close_all(self) -> None:
        for slot in self.slots:
            with contextlib.suppress(OSError):
                slot.outbox.close()
        self.slots = []
        if self.store is not None:
            self.store.close()
            self.store = None

    # -- the sinks resource -----------------------------------------------------------

    def status(self) -> list[dict[str, Any]]:
        """``GET /api/v1/sinks`` items (docs/http-api.md, sinks)."""
        storage = None
        if self.gate is not None:
            with contextlib.suppress(OSError):
                storage = self.gate.read()
        return [sink_status(slot, storage) for slot in self.slots]


def _orphans(slot: SinkSlot) -> dict[str, list[bytes]]:
    """The flows ``slot``'s outbox showed started and not completed when it opened."""
    return getattr(slot.outbox, "orphans", {})


def _backlog(slots: list[SinkSlot]) -> int:
    return sum(s.outbox.pending - s.outbox.unflushed_acks for s in slots)


def sink_status(slot: SinkSlot, storage: Storage | None) -> dict[str, Any]:
    """One sink's status item."""
    s, feed, outbox = slot.state, slot.feed, slot.outbox
    pending = outbox.pending
    item: dict[str, Any] = {
        "name": slot.spec.tag,
        "type": slot.spec.type,
        "pending": pending,
        "total_delivered": s.total_delivered,
        "total_failed": s.total_failed,
        "total_dead_lettered": s.total_dead_lettered,
        "total_discarded": s.total_discarded,
        "dead_letters": outbox.dead_letters,
        "replay_gaps": feed.replay_gaps,
        "cursor_sequence": feed.cursor,
        "last_success_at_unix_ms": s.last_success_at_unix_ms,
        "last_failure_at_unix_ms": s.last_failure_at_unix_ms,
        "last_error": feed.last_write_error or s.last_error,
    }
    if storage is not None:
        item["outbox_storage"] = storage.to_dict(feed.write_blocked)
    busy = pending or s.in_flight or s.retry_pending or s.ack_retry_pending
    if busy:
        item["delivery"] = {
            "in_flight": s.in_flight,
            "retry_pending": s.retry_pending,
            "ack_retry_pending": s.ack_retry_pending,
            "durable_pending": pending if outbox.durable else 0,
            "next_retry_at_unix_ms": s.next_retry_at_unix_ms,
        }
    item["outbox_recovery"] = outbox.recovery.to_dict()
    return item
