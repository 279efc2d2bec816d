"""The resolver's answer cache and the pure parts of spliceway.dns (no sockets, no sleeps)."""

from __future__ import annotations

import pytest

from spliceway.config import DnsSettings
from spliceway.dns import (
    AnswerCache,
    CacheEntry,
    InvalidHostname,
    Resolver,
    dns_cache_result,
    dns_lookup_result,
    normalize_hostname,
)
from spliceway.errors import ApiError


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_lru_evicts_least_recently_used(clock):
    cache = AnswerCache(2, clock=clock)
    cache.put("a.test", ["10.0.0.1"], 60)
    cache.put("b.test", ["10.0.0.2"], 60)
    assert cache.get("a.test") == ("10.0.0.1",)  # a is now the most recently used
    cache.put("c.test", ["10.0.0.3"], 60)
    assert cache.get("b.test") is None
    assert cache.get("a.test") == ("10.0.0.1",)
    assert cache.get("c.test") == ("10.0.0.3",)
    assert len(cache) == 2


def test_replacing_an_entry_does_not_evict(clock):
    cache = AnswerCache(2, clock=clock)
    cache.put("a.test", ["10.0.0.1"], 60)
    cache.put("b.test", ["10.0.0.2"], 60)
    cache.put("a.test", ["10.0.0.9"], 60)
    assert cache.get("a.test") == ("10.0.0.9",)
    assert cache.get("b.test") == ("10.0.0.2",)


def test_peek_does_not_refresh_lru_position(clock):
    cache = AnswerCache(2, clock=clock)
    cache.put("a.test", ["10.0.0.1"], 60)
    cache.put("b.test", ["10.0.0.2"], 60)
    assert cache.peek("a.test") == CacheEntry("a.test", ("10.0.0.1",), 60)
    cache.put("c.test", ["10.0.0.3"], 60)
    assert cache.peek("a.test") is None  # a stayed least recently used


@pytest.mark.parametrize(
    ("min_ttl", "max_ttl", "ttl", "expected"),
    [
        (None, None, 300, 300),
        (30, None, 5, 30),
        (None, 60, 300, 60),
        (30, 60, 45, 45),
        (30, 60, 0, 30),
        (30, 30, 999, 30),
    ],
)
def test_ttl_is_clamped(clock, min_ttl, max_ttl, ttl, expected):
    cache = AnswerCache(8, min_ttl, max_ttl, clock=clock)
    assert cache.clamp_ttl(ttl) == expected
    cache.put("a.test", ["10.0.0.1"], ttl)
    assert cache.peek("a.test").ttl_seconds == expected


def test_zero_ttl_and_empty_answers_are_not_stored(clock):
    cache = AnswerCache(8, clock=clock)
    cache.put("zero.test", ["10.0.0.1"], 0)
    cache.put("empty.test", [], 60)
    assert cache.get("zero.test") is None
    assert cache.get("empty.test") is None
    assert len(cache) == 0


def test_empty_answer_drops_a_stale_entry(clock):
    cache = AnswerCache(8, clock=clock)
    cache.put("a.test", ["10.0.0.1"], 60)
    cache.put("a.test", [], 60)
    assert cache.get("a.test") is None


def test_entries_expire_on_the_injected_clock(clock):
    cache = AnswerCache(8, clock=clock)
    cache.put("a.test", ["10.0.0.1"], 10)
    cache.put("b.test", ["10.0.0.2"], 20)
    clock.now += 9.5
    assert cache.peek("a.test").ttl_seconds == 1  # rounded up while alive
    assert cache.peek("b.test").ttl_seconds == 11
    clock.now += 0.5
    assert cache.get("a.test") is None
    assert len(cache) == 1
    clock.now += 10
    assert cache.entries() == []
    assert len(cache) == 0


def test_entries_are_most_recent_first_and_limited(clock):
    cache = AnswerCache(8, clock=clock)
    for i in range(4):
        cache.put(f"n{i}.test", [f"10.0.0.{i}"], 60)
    cache.get("n1.test")
    assert [e.domain for e in cache.entries()] == ["n1.test", "n3.test", "n2.test", "n0.test"]
    assert [e.domain for e in cache.entries(2)] == ["n1.test", "n3.test"]
    assert cache.entries(0) == []


def test_keys_ignore_case_and_trailing_dot(clock):
    cache = AnswerCache(8, clock=clock)
    cache.put("Example.TEST.", ["10.0.0.1"], 60)
    assert cache.get("example.test") == ("10.0.0.1",)
    assert cache.peek("EXAMPLE.test.").domain == "example.test"


def test_max_entries_must_be_positive():
    with pytest.raises(ValueError, match="max_entries"):
        AnswerCache(0)


# -- hostnames --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("Example.COM", "example.com"),
        ("example.com.", "example.com"),
        ("_sip._tcp.example.com", "_sip._tcp.example.com"),
        ("bücher.example", "xn--bcher-kva.example"),
        ("a" * 63 + ".test", "a" * 63 + ".test"),
    ],
)
def test_normalize_hostname_accepts(host, expected):
    assert normalize_hostname(host) == expected


@pytest.mark.parametrize(
    "host",
    ["", ".", "a..b", "-a.test", "a-.test", "a b.test", "a/b", "a" * 64 + ".test", "a." * 128],
)
def test_normalize_hostname_rejects(host):
    with pytest.raises(InvalidHostname):
        normalize_hostname(host)


# -- the diagnostics results, on a cache filled by hand -------------------------------


def _resolver(clock: Clock, **dns: object) -> Resolver:
    return Resolver(DnsSettings.model_validate(dns), clock=clock)


def test_dns_cache_result_shapes(clock):
    resolver = _resolver(clock, cache={"max_entries": 8, "max_ttl_seconds": 100})
    assert resolver.cache is not None
    resolver.cache.put("a.test", ["10.0.0.1", "fd00::1"], 300)
    resolver.cache.put("b.test", ["10.0.0.2"], 30)
    clock.now += 10
    assert dns_cache_result(resolver, "A.test") == {
        "enabled": True,
        "domain": "A.test",
        "hit": True,
        "addresses": ["10.0.0.1", "fd00::1"],
        "ttl_seconds": 90,
    }
    assert dns_cache_result(resolver, "missing.test") == {
        "enabled": True,
        "domain": "missing.test",
        "hit": False,
        "addresses": [],
        "ttl_seconds": None,
    }
    assert dns_cache_result(resolver) == {
        "enabled": True,
        "entries": [
            {"domain": "b.test", "addresses": ["10.0.0.2"], "ttl_seconds": 20},
            {"domain": "a.test", "addresses": ["10.0.0.1", "fd00::1"], "ttl_seconds": 90},
        ],
        "count": 2,
    }
    # count is the total number of cached entries, not the number returned.
    assert dns_cache_result(resolver, limit=1) == {
        "enabled": True,
        "entries": [{"domain": "b.test", "addresses": ["10.0.0.2"], "ttl_seconds": 20}],
        "count": 2,
    }


def test_dns_cache_result_without_cache(clock):
    resolver = _resolver(clock, cache=None)
    assert resolver.cache is None
    assert dns_cache_result(resolver) == {"enabled": False, "entries": [], "count": 0}
    assert dns_cache_result(resolver, "a.test") == {
        "enabled": False,
        "domain": "a.test",
        "hit": False,
        "addresses": [],
        "ttl_seconds": None,
    }


@pytest.mark.parametrize(
    ("domain", "limit", "field_path"),
    [(None, -1, "params.limit"), (None, True, "params.limit"), ("", 256, "params.domain")],
)
def test_dns_cache_result_rejects_bad_params(clock, domain, limit, field_path):
    with pytest.raises(ApiError) as info:
        dns_cache_result(_resolver(clock), domain, limit)
    assert (info.value.code, info.value.field_path) == ("invalid_argument", field_path)


def test_dns_lookup_result_for_literals_and_localhost_asks_no_server(clock):
    # A server that would time out if asked: the results prove no query was sent.
    resolver = _resolver(clock, servers=["udp://127.0.0.1:9"])
    assert dns_lookup_result(resolver, "192.0.2.7") == {
        "hostname": "192.0.2.7",
        "resolved_addresses": ["192.0.2.7"],
        "count": 1,
    }
    assert dns_lookup_result(resolver, "2001:db8::1") == {
        "hostname": "2001:db8::1",
        "resolved_addresses": ["2001:db8::1"],
        "count": 1,
    }
    assert dns_lookup_result(resolver, "LocalHost") == {
        "hostname": "LocalHost",
        "resolved_addresses": ["127.0.0.1", "::1"],
        "count": 2,
    }


@pytest.mark.parametrize("hostname", ["", "a..b", "x" * 300, "bad_label-.test", 42])
def test_dns_lookup_result_rejects_invalid_hostnames(clock, hostname):
    with pytest.raises(ApiError) as info:
        dns_lookup_result(_resolver(clock), hostname)
    assert info.value.code == "invalid_argument"
    assert info.value.field_path == "params.hostname"
