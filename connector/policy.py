"""The webhook delivery policy as data: classification, backoff and exhaustion (pure).

Every event is one HTTP POST. The answer decides what happens to the event:

=============================================  ===========  ====================================
Outcome of the POST                            Verdict      Then
=============================================  ===========  ====================================
any 2xx                                        ``ACK``      the event is delivered
429                                            ``RETRY``    back off, honouring ``Retry-After``
any 5xx                                        ``RETRY``    back off (``Retry-After`` on 503)
network, connect, timeout or protocol error    ``RETRY``    back off
any other status (1xx, 3xx, 4xx except 429)    ``REJECT``   the exhaustion policy, at once
=============================================  ===========  ====================================

Redirects are never followed: a 3xx is just a status, and so a rejection.

Backoff after the n-th failure (n >= 1) is *full jitter*: uniform in ``[0, cap_n]`` with
``cap_n = min(backoff_max_ms, backoff_initial_ms * 2 ** (n - 1))``. A ``Retry-After`` on a 429
or 503 (delta-seconds or HTTP-date) raises the delay to at least that much, but never beyond
``backoff_max_ms``: ``delay = max(jittered, min(retry_after, backoff_max_ms))``. Garbage or a
negative/past ``Retry-After`` is ignored.

``retry_threshold`` is how many attempts one event gets; after that ``on_exhausted`` applies:
``retry_forever`` keeps retrying with the cap at ``backoff_max_ms``, ``dead_letter`` parks the
event, ``discard`` drops it. A rejected event is never retried, even under ``retry_forever``:
it is dead-lettered (or discarded when ``on_exhausted`` is ``discard``), because retrying a
request the receiver refuses can only wedge the queue behind it.
"""

from __future__ import annotations

import datetime
import email.utils
import random
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spliceway.config import Dispatcher

__all__ = [
    "Action",
    "DeliveryPolicy",
    "Step",
    "Verdict",
    "backoff_cap_ms",
    "backoff_ms",
    "classify",
    "exhausted",
    "next_step",
    "parse_retry_after",
    "retry_delay_ms",
]

ON_EXHAUSTED = ("retry_forever", "dead_letter", "discard")

# 2 ** 62 ms is longer than any configurable cap; larger exponents only build huge ints.
_MAX_DOUBLINGS = 62


class Verdict(StrEnum):
    """What one HTTP outcome means for the event that was posted."""

    ACK = "ack"
    RETRY = "retry"
    REJECT = "reject"


class Action(StrEnum):
    """What the sink does next with an event after one attempt."""

    DELIVERED = "delivered"
    RETRY = "retry"
    DEAD_LETTER = "dead_letter"
    DISCARD = "discard"


def classify(status: int | None) -> Verdict:
    """Classify an HTTP status; ``None`` stands for a network/connect/timeout/protocol error."""
    if status is None or status == 429 or 500 <= status <= 599:
        return Verdict.RETRY
    if 200 <= status <= 299:
        return Verdict.ACK
    return Verdict.REJECT


@dataclass(frozen=True, slots=True)
class DeliveryPolicy:
    """The ``api.dispatcher`` settings that govern one webhook sink's retries."""

    request_timeout_ms: int = 10000
    backoff_initial_ms: int = 500
    backoff_max_ms: int = 60000
    retry_threshold: int = 10
    on_exhausted: str = "retry_forever"

    def __post_init__(self) -> None:
        # Config validation already guarantees these; a hand-built policy gets the same checks.
        if self.request_timeout_ms <= 0:
            raise ValueError("request_timeout_ms must be positive")
        if not 0 < self.backoff_initial_ms <= self.backoff_max_ms:
            raise ValueError("backoff_initial_ms must be positive and at most backoff_max_ms")
        if self.retry_threshold < 1:
            raise ValueError("retry_threshold must be at least 1")
        if self.on_exhausted not in ON_EXHAUSTED:
            raise ValueError(f"on_exhausted must be one of {', '.join(ON_EXHAUSTED)}")

    @classmethod
    def from_config(cls, d: Dispatcher) -> DeliveryPolicy:
        """Build the policy from a validated ``spliceway.config.Dispatcher``."""
        return cls(
            request_timeout_ms=d.request_timeout_ms,
            backoff_initial_ms=d.backoff_initial_ms,
            backoff_max_ms=d.backoff_max_ms,
            retry_threshold=d.retry_threshold,
            on_exhausted=d.on_exhausted,
        )


def backoff_cap_ms(policy: DeliveryPolicy, attempt: int) -> int:
    """The upper bound of the jittered delay after ``attempt`` failures (>= 1).

    Once the retry budget is spent (only reachable under ``retry_forever``) the cap is
    ``backoff_max_ms`` whatever the doubling has reached, so a stuck receiver is polled at the
    slowest rate.
    """
    if exhausted(policy, attempt):
        return policy.backoff_max_ms
    doublings = min(max(attempt, 1) - 1, _MAX_DOUBLINGS)
    return min(policy.backoff_max_ms, policy.backoff_initial_ms << doublings)


def backoff_ms(policy: DeliveryPolicy, attempt: int, rng: random.Random) -> int:
    """The full-jitter delay after ``attempt`` failures so far: uniform in ``[0, cap]``."""
    return rng.randint(0, backoff_cap_ms(policy, attempt))


def parse_retry_after(value: str | None, now_unix_s: float) -> int | None:
    """A ``Retry-After`` value in milliseconds from now, or ``None`` when absent or unusable.

    Accepts delta-seconds (``"120"``) and an HTTP-date; anything else, and a date in the past,
    is ignored rather than trusted.
    """
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    if text.isascii() and text.isdigit():
        return int(text) * 1000
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        # RFC 9110 dates are always GMT; "-0000" parses as naive.
        when = when.replace(tzinfo=datetime.UTC)
    delta_ms = round((when.timestamp() - now_unix_s) * 1000)
    return delta_ms if delta_ms >= 0 else None


def retry_delay_ms(
    policy: DeliveryPolicy,
    attempt: int,
    status: int | None,
    retry_after: str | None,
    rng: random.Random,
    now_unix_s: float,
) -> int:
    """The wait before the next attempt after ``attempt`` failures, within ``[0, backoff_max]``.

    ``Retry-After`` counts only on 429 and 503, and only up to ``backoff_max_ms``.
    """
    delay = backoff_ms(policy, attempt, rng)
    if status in (429, 503):
        hinted = parse_retry_after(retry_after, now_unix_s)
        if hinted is not None:
            delay = max(delay, min(hinted, policy.backoff_max_ms))
    return delay


def exhausted(policy: DeliveryPolicy, attempt: int) -> bool:
    """Whether an event that has failed ``attempt`` times has used up its retry budget."""
    return attempt >= policy.retry_threshold


@dataclass(frozen=True, slots=True)
class Step:
    """The decision after one attempt: what to do, and how long to wait first when retrying."""

    action: Action
    delay_ms: int = 0


def next_step(
    policy: DeliveryPolicy,
    attempt: int,
    status: int | None,
    retry_after: str | None,
    rng: random.Random,
    now_unix_s: float,
) -> Step:
    """Decide what follows an attempt; ``attempt`` counts the attempts made so far, this one too.

    ``status`` is the HTTP status, or ``None`` for a network/timeout/protocol error.
    """
    verdict = classify(status)
    if verdict is Verdict.ACK:
        return Step(Action.DELIVERED)
    if verdict is Verdict.REJECT:
        return Step(Action.DISCARD if policy.on_exhausted == "discard" else Action.DEAD_LETTER)
    if exhausted(policy, attempt) and policy.on_exhausted != "retry_forever":
        return Step(Action(policy.on_exhausted))
    return Step(Action.RETRY, retry_delay_ms(policy, attempt, status, retry_after, rng, now_unix_s))
