"""Pure parts of the control API: token buckets, slots, key table, SSE parameters, frames."""

from __future__ import annotations

import orjson
import pytest

from spliceway.api.auth import ANONYMOUS_ADMIN, KeyTable
from spliceway.api.limits import RateLimited, Slots, TokenBucket
from spliceway.api.sse import FrameCache, parse_since
from spliceway.config import ControlApi
from spliceway.errors import ApiError
from spliceway.events.log import parse_types


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_burst_then_refill() -> None:
    clock = Clock()
    bucket = TokenBucket(10, clock=clock)
    assert [bucket.take() for _ in range(10)] == [0.0] * 10
    wait = bucket.take()
    assert wait == pytest.approx(0.1)
    clock.now += 0.05
    assert bucket.take() == pytest.approx(0.05)
    clock.now += 0.05
    assert bucket.take() == 0.0
    clock.now += 100
    assert [bucket.take() for _ in range(10)] == [0.0] * 10  # capped at the burst
    assert bucket.take() > 0


def test_retry_after_is_whole_seconds_at_least_one() -> None:
    assert RateLimited("x", 0.01).retry_after == 1
    assert RateLimited("x", 1.2).retry_after == 2
    assert RateLimited("x", 0.01).http_status == 429


def test_slots() -> None:
    slots = Slots(2)
    assert slots.acquire() and slots.acquire() and not slots.acquire()
    slots.release()
    assert slots.used == 1 and slots.acquire()


def test_key_table_without_keys_grants_everything() -> None:
    table = KeyTable([])
    assert not table.required
    assert table.authenticate(None, None) is ANONYMOUS_ADMIN


def test_key_table_matches_bearer_and_header() -> None:
    table = KeyTable([("admin", "k1", frozenset({"admin"})), ("ro", "k2", frozenset({"read"}))])
    assert table.authenticate("Bearer k1", None).name == "admin"
    assert table.authenticate("bearer   k2 ", None).name == "ro"
    assert table.authenticate(None, "k2").permissions == frozenset({"read"})
    for auth, key in [
        (None, None),
        ("Bearer", None),
        ("Token k1", None),
        (None, "k3"),
        ("Bearer k1x", None),
        (None, ""),
    ]:
        with pytest.raises(ApiError) as info:
            table.authenticate(auth, key)
        assert info.value.code == "unauthenticated" and info.value.http_status == 401


def test_key_table_from_environment() -> None:
    control = ControlApi.model_validate(
        {
            "api_key_env": "ADMIN_K",
            "keys": [{"name": "d", "key_env": "DASH_K", "permissions": ["read"]}],
        }
    )
    table = KeyTable.from_config(control, {"ADMIN_K": "a", "DASH_K": "d"})
    assert table.authenticate(None, "d").name == "d"
    with pytest.raises(ApiError) as info:
        KeyTable.from_config(control, {"ADMIN_K": "a"})
    assert "DASH_K" in info.value.message
    assert info.value.field_path == "api.control.keys[0].key_env"
    with pytest.raises(ApiError) as info:
        KeyTable.from_config(control, {"DASH_K": "d"})
    assert "ADMIN_K" in info.value.message


def test_parse_types() -> None:
    assert parse_types(None) is None and parse_types(" ") is None
    assert parse_types("flow.started, stats.sampled,") == ["flow.started", "stats.sampled"]
    assert parse_types("*") == ["*"]
    with pytest.raises(ApiError) as info:
        parse_types("flow.started,flow.bogus")
    assert info.value.field_path == "types"


def test_parse_since() -> None:
    assert parse_since(None, None) is None
    assert parse_since("5", "9") == 5
    assert parse_since(None, "9") == 9
    assert parse_since("", "7") == 7
    for bad in ("x", "-1", "1.0", "0x10"):
        with pytest.raises(ApiError):
            parse_since(bad, None)


def test_frame_format_and_cache() -> None:
    envelope = {"event_id": "e-3", "sequence": 3, "event_type": "flow.started", "payload": {}}
    cache = FrameCache(size=1)
    frame = cache.frame(envelope)
    head, data = frame.split(b"data: ", 1)
    assert head == b"id: 3\nevent: flow.started\n"
    assert data.endswith(b"\n\n") and b"\n" not in data[:-2]
    assert orjson.loads(data) == envelope
    assert cache.frame(envelope) is frame
    cache.frame({**envelope, "event_id": "e-4", "sequence": 4})
    assert cache.frame(envelope) is not frame  # evicted, re-encoded identically
    assert cache.frame(envelope) == frame
