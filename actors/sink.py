"""SinkActor: one per event-sink registration; delivers its outbox, in order.

The actor's own thread is the sink's delivery worker, so a receiver that hangs
blocks only its own sink. It takes committed records from the outbox (the
intake fills it), sends each as one POST (signed when the sink has a secret),
appends batches to the JSONL file, or publishes pipelined batches to JetStream,
and applies the delivery policy: a 2xx is acknowledged, a retryable failure
waits out its backoff (a timer wakes the actor; it never sleeps in a handler
longer than one request), a non-retryable one goes to the exhaustion policy.
ACKs are group-committed to the outbox ledger at most every ``ACK_INTERVAL_S``
and whenever the sink runs dry, and only then leave the outbox.

The actor alone writes its ``SinkState``; the sinks query reads it (plain
counters, read without stopping delivery).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import pykka

from spliceway.connector.diskgate import DiskGate
from spliceway.connector.intake import Feed, event_id_of
from spliceway.connector.jetstream import MAX_BATCH, NatsPublisher
from spliceway.connector.jsonl import JsonlWriter
from spliceway.connector.outbox import Item, Outbox
from spliceway.connector.policy import Action, DeliveryPolicy, Verdict, classify, next_step
from spliceway.connector.signing import Signer
from spliceway.connector.webhook import DeliveryError, WebhookClient
from spliceway.events.log import now_ms

logger = logging.getLogger(__name__)

ACK_INTERVAL_S = 0.05
#: Longest stretch one handler delivers before yielding to the actor's inbox (stop).
_SLICE_S = 0.05
_TAKE = 256


@dataclass(slots=True)
class SinkState:
    """Delivery counters and stages of one sink (docs/http-api.md, sinks)."""

    total_delivered: int = 0
    total_failed: int = 0
    total_dead_lettered: int = 0
    total_discarded: int = 0
    last_success_at_unix_ms: int | None = None
    last_failure_at_unix_ms: int | None = None
    last_error: str | None = None
    in_flight: int = 0
    retry_pending: int = 0
    ack_retry_pending: int = 0
    next_retry_at_unix_ms: int | None = None
    #: Set when the actor found nothing to deliver; the intake's notify clears it.
    idle: bool = False


class _Pump:
    """Deliver what is due."""


_PUMP = _Pump()


Transport = WebhookClient | JsonlWriter | NatsPublisher


class SinkActor(pykka.ThreadingActor):
    """Delivers one sink's events (webhook POSTs, JSONL appends or JetStream publishes)."""

    def __init__(
        self,
        tag: str,
        transport: Transport,
        outbox: Outbox,
        feed: Feed,
        policy: DeliveryPolicy,
        state: SinkState,
        gate: DiskGate | None,
        signer: Signer | None = None,
    ) -> None:
        super().__init__()
        self.tag = tag
        self.transport = transport
        self.signer = signer
        self.outbox = outbox
        self.feed = feed
        self.policy = policy
        self.state = state
        self.gate = gate
        self._queue: deque[Item] = deque()
        self._attempts = 0
        self._first_attempt_ms = 0
        self._retry_at = 0.0
        #: The head event's failure was final but its dead letter is not written yet:
        #: ``(reason, status)``. It is never posted again; only the write is retried.
        self._disposal: tuple[str, int | None] | None = None
        self._timer: threading.Timer | None = None
        self._ack_due = 0.0
        self._rng = random.Random()
        self._take = _TAKE
        if isinstance(transport, JsonlWriter):
            self._deliver = self._append_lines
        elif isinstance(transport, NatsPublisher):
            self._deliver = self._publish_batch
            # One pipelined batch waits for its last PubAck: the larger, the fewer waits.
            self._take = MAX_BATCH
        else:
            self._deliver = self._post_head

    # -- lifecycle ----------------------------------------------------------------

    def on_start(self) -> None:
        """Start delivering what the outbox already holds (a restart's backlog)."""
        self.feed.notify = self.wake
        self.actor_ref.tell(_PUMP)

    def on_stop(self) -> None:
        """Make the ACKs so far durable; what is left stays in the outbox."""
        if self._timer is not None:
            self._timer.cancel()
        with contextlib.suppress(OSError):
            self.outbox.flush_acks()
        self.transport.close()

    def wake(self) -> None:
        """Called by the intake after new events were committed (any thread)."""
        if self.state.idle:
            self.state.idle = False
            with contextlib.suppress(pykka.ActorDeadError):
                self.actor_ref.tell(_PUMP)

    def on_receive(self, message: Any) -> None:
        """The actor's one message: deliver."""
        if message is _PUMP:
            self._pump()

    # -- delivery -----------------------------------------------------------------

    def _pump(self) -> None:
        until = time.monotonic() + _SLICE_S
        while True:
            now = time.monotonic()
            if self._retry_at > now:
                self._flush_acks()
                self._schedule(self._retry_at - now)
                break
            if not self._queue:
                self._queue.extend(self.outbox.take(self._take))
            if not self._queue:
                self._flush_acks()
                self.state.idle = True
                # The intake may have committed between the take and the flag.
                more = self.outbox.take(self._take)
                if not more:
                    break
                self.state.idle = False
                self._queue.extend(more)
            if now >= until:
                self.actor_ref.tell(_PUMP)
                break
            if self._disposal is not None:
                self._give_up(self._queue[0], Action.DEAD_LETTER, *self._disposal)
            else:
                self._deliver()
            if self.outbox.unflushed_acks and time.monotonic() >= self._ack_due:
                self._flush_acks()

    def _schedule(self, delay_s: float) -> None:
        if self._timer is not None and self._timer.is_alive():
            return
        self._timer = threading.Timer(delay_s, self._wake_after_backoff)
        self._timer.daemon = True
        self._timer.start()

    def _wake_after_backoff(self) -> None:
        with contextlib.suppress(pykka.ActorDeadError):
            self.actor_ref.tell(_PUMP)

    def _post_head(self) -> None:
        item = self._queue[0]
        if self._attempts == 0:
            self._first_attempt_ms = now_ms()
        self.state.in_flight = 1
        status: int | None
        signer = self.signer
        # Signed at each attempt: a retry carries its own timestamp, the same webhook-id.
        extra = signer.headers(event_id_of(item.body), item.body) if signer else b""
        try:
            response = self.transport.post(item.body, extra)  # type: ignore[union-attr]
            status, retry_after, error = response.status, response.retry_after, None
        except DeliveryError as ex:
            status, retry_after, error = None, None, str(ex)
        finally:
            self.state.in_flight = 0
        if classify(status) is Verdict.ACK:
            self._acknowledge([item])
            return
        self._failed(error or f"HTTP {status}")
        step = next_step(self.policy, self._attempts, status, retry_after, self._rng, time.time())
        if step.action is Action.RETRY:
            self._retry_later(step.delay_ms)
        else:
            self._give_up(item, step.action, error or f"HTTP {status}", status)

    def _publish_batch(self) -> None:
        items = list(itertools.islice(self._queue, MAX_BATCH))
        if self._attempts == 0:
            self._first_attempt_ms = now_ms()
        self.state.in_flight = len(items)
        try:
            acked, error = self.transport.publish(  # type: ignore[union-attr]
                [(event_id_of(item.body), item.body) for item in items]
            )
        finally:
            self.state.in_flight = 0
        if acked:
            self._acknowledge(items[:acked])
        if error is None:
            return
        # The first unacknowledged event is the head now; it meets the delivery policy.
        self._failed(error)
        step = next_step(self.policy, self._attempts, None, None, self._rng, time.time())
        if step.action is Action.RETRY:
            self._retry_later(step.delay_ms)
        else:
            self._give_up(self._queue[0], step.action, error, None)

    def _append_lines(self) -> None:
        items = list(self._queue)
        try:
            self.transport.write_batch([i.body for i in items])  # type: ignore[union-attr]
        except OSError as ex:
            self._failed(f"write failed: {ex.strerror or ex}")
            step = next_step(self.policy, self._attempts, None, None, self._rng, time.time())
            if step.action is Action.RETRY:
                self._retry_later(step.delay_ms)
            else:
                reason = self.state.last_error or "write failed"
                for item in items:
                    if not self._give_up(item, step.action, reason, None):
                        break
            return
        self._acknowledge(items)

    def _finish(self, items: list[Item]) -> None:
        """The head ``items`` are done (delivered or disposed of): ack them in order."""
        for item in items:
            self.outbox.ack(item.record_id)
            self._queue.popleft()
        if self.outbox.unflushed_acks == len(items):
            self._ack_due = time.monotonic() + ACK_INTERVAL_S
        self._attempts = 0
        self._disposal = None
        self.state.retry_pending = 0
        self.state.next_retry_at_unix_ms = None

    def _acknowledge(self, items: list[Item]) -> None:
        self._finish(items)
        s = self.state
        s.total_delivered += len(items)
        s.last_success_at_unix_ms = now_ms()
        s.last_error = None

    def _failed(self, error: str) -> None:
        s = self.state
        s.total_failed += 1
        s.last_failure_at_unix_ms = now_ms()
        s.last_error = error
        self._attempts += 1

    def _retry_later(self, delay_ms: int) -> None:
        self._retry_at = time.monotonic() + delay_ms / 1000
        self.state.retry_pending = 1
        self.state.next_retry_at_unix_ms = now_ms() + delay_ms

    def _give_up(self, item: Item, action: Action, reason: str, status: int | None) -> bool:
        """Apply the exhaustion policy's ``action`` (``next_step`` chose it): discard
        (counted) or keep as a dead letter. False when the dead letter must wait."""
        if action is Action.DISCARD:
            self.state.total_discarded += 1
        else:
            meta = {
                "reason": reason,
                "status": status,
                "attempts": self._attempts,
                "first_attempt_at_unix_ms": self._first_attempt_ms,
                "last_attempt_at_unix_ms": now_ms(),
                "record_id": item.record_id,
            }
            try:
                if self.gate is not None:
                    storage = self.gate.read()
                    if not storage.allows_maintenance(len(item.body) + 1024):
                        raise OSError(28, "no space above the emergency reserve")
                self.outbox.dead_letter(item, meta)
            except OSError as ex:
                # Keep the event rather than lose it; write the dead letter again later.
                self._disposal = (reason, status)
                self.state.last_error = f"dead letter not written: {ex.strerror or ex}"
                self._retry_later(self.policy.backoff_initial_ms)
                return False
            self.state.total_dead_lettered += 1
            logger.warning(
                "sink %s: event dead-lettered (%s): %s", self.tag, reason, event_id_of(item.body)
            )
        self._finish([item])
        return True

    def _flush_acks(self) -> None:
        try:
            self.outbox.flush_acks()
        except OSError as ex:
            self.state.ack_retry_pending = self.outbox.unflushed_acks
            self.state.last_error = f"ACK not written: {ex.strerror or ex}"
            self._ack_due = time.monotonic() + self.policy.backoff_initial_ms / 1000
            self.state.next_retry_at_unix_ms = now_ms() + self.policy.backoff_initial_ms
            self._schedule(self.policy.backoff_initial_ms / 1000)
            return
        self.state.ack_retry_pending = 0
