"""The webhook delivery policy: status matrix, backoff bounds, Retry-After, exhaustion."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from email.utils import format_datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spliceway.config import Dispatcher
from spliceway.connector.policy import (
    Action,
    DeliveryPolicy,
    Step,
    Verdict,
    backoff_cap_ms,
    backoff_ms,
    classify,
    exhausted,
    next_step,
    parse_retry_after,
    retry_delay_ms,
)

NOW = 1_700_000_000.0

policies = st.builds(
    lambda initial, extra, threshold, mode: DeliveryPolicy(
        backoff_initial_ms=initial,
        backoff_max_ms=initial + extra,
        retry_threshold=threshold,
        on_exhausted=mode,
    ),
    st.integers(1, 100_000),
    st.integers(0, 1_000_000),
    st.integers(1, 50),
    st.sampled_from(["retry_forever", "dead_letter", "discard"]),
)
statuses = st.one_of(st.none(), st.integers(100, 599))
retry_afters = st.one_of(
    st.none(),
    st.integers(-10, 10**7).map(str),
    st.text(max_size=30),
    st.datetimes(
        min_value=datetime(1990, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC)
    ).map(lambda d: format_datetime(d, usegmt=True)),
)


@pytest.mark.parametrize("status", [200, 201, 202, 204, 299])
def test_2xx_is_acknowledged(status):
    assert classify(status) is Verdict.ACK


@pytest.mark.parametrize("status", [None, 429, 500, 502, 503, 504, 599])
def test_429_5xx_and_network_errors_are_retryable(status):
    assert classify(status) is Verdict.RETRY


@pytest.mark.parametrize(
    "status",
    [
        100,
        101,
        199,
        300,
        301,
        302,
        304,
        307,
        308,
        400,
        401,
        403,
        404,
        408,
        410,
        413,
        422,
        428,
        431,
        451,
        499,
        600,
    ],
)
def test_everything_else_is_rejected(status):
    # 408 is not in the spec's retry list, so it is a rejection like any other 4xx.
    assert classify(status) is Verdict.REJECT


def test_from_config_copies_the_dispatcher_settings():
    d = Dispatcher(
        request_timeout_ms=1234,
        backoff_initial_ms=7,
        backoff_max_ms=70,
        retry_threshold=3,
        on_exhausted="dead_letter",
    )
    assert DeliveryPolicy.from_config(d) == DeliveryPolicy(1234, 7, 70, 3, "dead_letter")
    assert DeliveryPolicy.from_config(Dispatcher()) == DeliveryPolicy()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"request_timeout_ms": 0},
        {"backoff_initial_ms": 0},
        {"backoff_initial_ms": 10, "backoff_max_ms": 5},
        {"retry_threshold": 0},
        {"on_exhausted": "shrug"},
    ],
)
def test_nonsense_policies_are_refused(kwargs):
    with pytest.raises(ValueError, match="must"):
        DeliveryPolicy(**kwargs)


def test_cap_doubles_from_initial_up_to_max():
    p = DeliveryPolicy(backoff_initial_ms=500, backoff_max_ms=60_000, retry_threshold=100)
    caps = [backoff_cap_ms(p, n) for n in range(1, 11)]
    assert caps == [500, 1000, 2000, 4000, 8000, 16000, 32000, 60000, 60000, 60000]
    assert backoff_cap_ms(p, 10**9) == 60_000


def test_cap_is_the_max_once_exhausted_under_retry_forever():
    p = DeliveryPolicy(backoff_initial_ms=10, backoff_max_ms=60_000, retry_threshold=2)
    assert backoff_cap_ms(p, 1) == 10
    assert backoff_cap_ms(p, 2) == 60_000


def test_full_jitter_reaches_both_ends():
    p = DeliveryPolicy(backoff_initial_ms=4, backoff_max_ms=4)
    rng = random.Random(1)
    seen = {backoff_ms(p, 1, rng) for _ in range(500)}
    assert seen == {0, 1, 2, 3, 4}


@given(policies, st.integers(1, 10_000), statuses, retry_afters, st.integers(0, 2**32))
def test_delay_is_always_within_zero_and_max(policy, attempt, status, retry_after, seed):
    delay = retry_delay_ms(policy, attempt, status, retry_after, random.Random(seed), NOW)
    assert 0 <= delay <= policy.backoff_max_ms
    assert isinstance(delay, int)


@given(policies, st.integers(1, 200))
def test_cap_is_monotone_and_bounded(policy, attempt):
    assert backoff_cap_ms(policy, attempt) <= backoff_cap_ms(policy, attempt + 1)
    assert policy.backoff_initial_ms <= backoff_cap_ms(policy, attempt) <= policy.backoff_max_ms


@given(policies, st.integers(1, 200), st.integers(0, 2**32))
def test_jitter_stays_under_the_cap(policy, attempt, seed):
    assert 0 <= backoff_ms(policy, attempt, random.Random(seed)) <= backoff_cap_ms(policy, attempt)


@given(
    policies,
    st.integers(1, 200),
    st.sampled_from([429, 503]),
    st.integers(0, 10**6),
    st.integers(0, 2**32),
)
def test_retry_after_is_honoured_up_to_max(policy, attempt, status, seconds, seed):
    delay = retry_delay_ms(policy, attempt, status, str(seconds), random.Random(seed), NOW)
    assert delay >= min(seconds * 1000, policy.backoff_max_ms)
    assert delay <= policy.backoff_max_ms


@given(st.sampled_from([500, 502, 504, None]), st.integers(0, 2**32))
def test_retry_after_is_ignored_on_other_statuses(status, seed):
    p = DeliveryPolicy(backoff_initial_ms=1, backoff_max_ms=1, retry_threshold=100)
    assert retry_delay_ms(p, 1, status, "30", random.Random(seed), NOW) <= 1


def test_retry_after_on_429_beats_a_short_backoff():
    p = DeliveryPolicy(backoff_initial_ms=1, backoff_max_ms=60_000)
    assert retry_delay_ms(p, 1, 429, "5", random.Random(0), NOW) == 5000
    assert retry_delay_ms(p, 1, 503, "5", random.Random(0), NOW) == 5000
    assert retry_delay_ms(p, 1, 429, "99999", random.Random(0), NOW) == 60_000


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", None),
        ("  ", None),
        ("0", 0),
        ("120", 120_000),
        (" 7 ", 7000),
        ("-5", None),
        ("1.5", None),
        ("soon", None),
        ("٣", None),  # a non-ASCII digit is not delta-seconds
        (format_datetime(datetime.fromtimestamp(NOW + 30, UTC), usegmt=True), 30_000),
        (format_datetime(datetime.fromtimestamp(NOW - 30, UTC), usegmt=True), None),
        ("Tue, 14 Nov 2023 22:13:50 -0000", 30_000),
        ("Tue, 32 Nov 2023 22:13:50 GMT", None),
    ],
)
def test_parse_retry_after(value, expected):
    assert parse_retry_after(value, NOW) == expected


@given(st.text(max_size=60))
def test_parse_retry_after_never_raises(value):
    result = parse_retry_after(value, NOW)
    assert result is None or result >= 0


def test_exhausted_counts_attempts_against_the_threshold():
    p = DeliveryPolicy(retry_threshold=3)
    assert [exhausted(p, n) for n in (1, 2, 3, 4)] == [False, False, True, True]


def _step(policy, attempt, status, retry_after=None):
    return next_step(policy, attempt, status, retry_after, random.Random(0), NOW)


@pytest.mark.parametrize("mode", ["retry_forever", "dead_letter", "discard"])
def test_next_step_acks_2xx_whatever_the_mode(mode):
    p = DeliveryPolicy(retry_threshold=1, on_exhausted=mode)
    assert _step(p, 5, 204) == Step(Action.DELIVERED)


@pytest.mark.parametrize(
    ("mode", "action"),
    [
        ("retry_forever", Action.DEAD_LETTER),
        ("dead_letter", Action.DEAD_LETTER),
        ("discard", Action.DISCARD),
    ],
)
def test_a_rejection_is_never_retried(mode, action):
    p = DeliveryPolicy(retry_threshold=10, on_exhausted=mode)
    for status in (301, 400, 404, 408, 422):
        assert _step(p, 1, status) == Step(action)


@pytest.mark.parametrize(
    ("mode", "action"), [("dead_letter", Action.DEAD_LETTER), ("discard", Action.DISCARD)]
)
def test_retryable_failures_retry_until_the_threshold(mode, action):
    p = DeliveryPolicy(
        backoff_initial_ms=100, backoff_max_ms=1000, retry_threshold=3, on_exhausted=mode
    )
    assert _step(p, 1, 503).action is Action.RETRY
    assert _step(p, 2, None).action is Action.RETRY
    assert _step(p, 3, 429) == Step(action)


@given(st.integers(1, 10_000), st.sampled_from([None, 429, 500, 503]), st.integers(0, 2**32))
def test_retry_forever_retries_retryable_failures_forever(attempt, status, seed):
    p = DeliveryPolicy(backoff_initial_ms=100, backoff_max_ms=1000, retry_threshold=3)
    step = next_step(p, attempt, status, None, random.Random(seed), NOW)
    assert step.action is Action.RETRY
    assert 0 <= step.delay_ms <= 1000
