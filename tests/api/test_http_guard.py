"""The hardened server's parts that need no listener: sources and the failed-auth limiter."""

from __future__ import annotations

import pytest

from spliceway.api.http_guard import Refusal, source_key
from spliceway.api.limits import FailureLimiter


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("address", "source"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("::ffff:10.1.2.3", "10.1.2.3"),
        ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
        ("2001:db8:1:2::9", "2001:db8:1:2::/64"),
        ("fe80::1%eth0", "fe80::/64"),
        ("not-an-address", "not-an-address"),
    ],
)
def test_source_key(address: str, source: str) -> None:
    assert source_key(address) == source


def test_failure_limiter_per_source_and_global() -> None:
    clock = Clock()
    limiter = FailureLimiter(2.0, 3.0, 4.0, 5.0, clock=clock)
    assert [limiter.failed("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.failed("a") == pytest.approx(0.5)  # a's burst spent; 2/s
    # Another source has its own bucket, but the global one (burst 5) runs out.
    assert [limiter.failed("b") for _ in range(2)] == [0.0, 0.0]
    assert limiter.failed("b") == pytest.approx(0.25)
    clock.now += 1.0
    assert limiter.failed("a") == 0.0


def test_failure_limiter_forgets_least_recent_sources() -> None:
    clock = Clock()
    limiter = FailureLimiter(1.0, 1.0, 1000.0, 1000.0, max_sources=2, clock=clock)
    assert limiter.failed("a") == 0.0
    assert limiter.failed("a") > 0
    limiter.failed("b")
    limiter.failed("c")  # a is forgotten: a fresh bucket next time
    assert limiter.failed("a") == 0.0


def test_refusal_response() -> None:
    refusal = Refusal(429, b"{}", [("Retry-After", "3")])
    status, headers, body = refusal.to_response("spliceway")
    assert status == "429 Too Many Requests"
    assert headers == [("Content-Type", "application/json"), ("Retry-After", "3")]
    assert body == b"{}"
