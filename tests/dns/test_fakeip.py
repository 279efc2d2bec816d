"""The fake-ip pool: allocation, LRU reuse, reverse lookups, clear, persistence."""

from __future__ import annotations

import threading
import time

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spliceway.dns.fakeip import FakeIpPool


def test_addresses_are_handed_out_in_order_skipping_network_and_gateway():
    pool = FakeIpPool("198.18.0.0/15")
    assert pool.capacity == 2**17 - 3
    assert pool.lookup("a.example") == "198.18.0.2"
    assert pool.lookup("B.Example.") == "198.18.0.3"
    assert pool.lookup("a.example.") == "198.18.0.2"  # stable, case and dot ignored
    assert pool.domain_of("198.18.0.3") == "b.example"
    assert pool.domain_of("198.18.0.4") is None  # in the range, not mapped
    assert pool.domain_of("10.0.0.1") is None
    assert pool.domain_of("not an ip") is None
    assert pool.contains("198.19.255.254") and not pool.contains("198.19.255.255")
    assert not pool.contains("198.18.0.1") and not pool.contains("198.18.0.0")
    assert len(pool) == 2


def test_ipv6_range():
    pool = FakeIpPool("fc00::/64")
    assert pool.version == 6
    assert pool.lookup("a.example") == "fc00::2"
    assert pool.domain_of("fc00::2") == "a.example"
    assert pool.domain_of("198.18.0.2") is None


def test_tiny_range_uses_every_address():
    pool = FakeIpPool("10.9.9.8/31")
    assert pool.capacity == 2
    assert [pool.lookup(d) for d in ("a", "b")] == ["10.9.9.8", "10.9.9.9"]


def test_full_range_reuses_the_least_recently_used():
    pool = FakeIpPool("10.0.0.0/29")  # 8 addresses, 5 usable
    assert pool.capacity == 5
    ips = {d: pool.lookup(d) for d in "abcde"}
    generation = pool.generation
    pool.lookup("a")  # a used again: b is now the least recently used
    assert pool.domain_of(ips["c"]) == "c"  # a flow to c's address: c is used too
    assert pool.peek_domain(ips["b"]) == "b"  # diagnostics do not count as use
    assert pool.lookup("f") == ips["b"]
    assert pool.peek_ip("b") is None
    assert pool.domain_of(ips["b"]) == "f"
    assert pool.generation > generation
    assert pool.lookup("g") == ips["d"]
    assert len(pool) == 5


def test_clear_by_domain_ip_and_all():
    pool = FakeIpPool("10.0.0.0/24")
    a, b = pool.lookup("a.example"), pool.lookup("b.example")
    pool.lookup("c.example")
    assert pool.clear(domain="A.example.") == 1
    assert pool.clear(domain="a.example") == 0
    assert pool.clear(ip=b) == 1
    assert pool.clear(ip="10.0.0.200") == 0
    assert pool.clear(ip="192.0.2.1") == 0
    # Freed addresses are handed out again before new ones.
    assert {pool.lookup("d.example"), pool.lookup("e.example")} == {a, b}
    assert pool.clear() == 3
    assert len(pool) == 0
    assert pool.lookup("f.example") == "10.0.0.2"
    with pytest.raises(ValueError, match="not both"):
        pool.clear(domain="x", ip="10.0.0.2")


def test_persisted_mapping_survives_a_new_pool(tmp_path):
    path = str(tmp_path / "fakeip.json")
    pool = FakeIpPool("198.18.0.0/15", path)
    ip = pool.lookup("keep.example")
    pool.lookup("other.example")
    pool.close()
    again = FakeIpPool("198.18.0.0/15", path)
    assert again.peek_ip("keep.example") == ip
    assert again.lookup("new.example") == "198.18.0.4"  # after the highest persisted
    again.close()


def test_delayed_save_writes_soon_after_a_change(tmp_path):
    path = tmp_path / "fakeip.json"
    pool = FakeIpPool("10.0.0.0/24", str(path), save_delay=0.01)
    pool.lookup("soon.example")

    deadline = time.monotonic() + 5
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    doc = orjson.loads(path.read_bytes())
    assert doc["entries"] == [["soon.example", "10.0.0.2"]]
    pool.close()


def test_clear_persists_at_once(tmp_path):
    path = tmp_path / "fakeip.json"
    pool = FakeIpPool("10.0.0.0/24", str(path), save_delay=3600)
    pool.lookup("a.example")
    pool.lookup("b.example")
    assert pool.clear(domain="a.example") == 1
    assert orjson.loads(path.read_bytes())["entries"] == [["b.example", "10.0.0.3"]]
    pool.close()


@pytest.mark.parametrize(
    "content",
    [b"", b"{not json", b"[]", b'{"version": 99}', b'{"version": 1, "entries": [[1, 2]]}'],
)
def test_damaged_file_is_reported_set_aside_and_starts_empty(tmp_path, content):
    path = tmp_path / "fakeip.json"
    path.write_bytes(content)
    warnings: list[str] = []
    pool = FakeIpPool("10.0.0.0/24", str(path), warn=warnings.append)
    assert len(pool) == 0
    assert len(warnings) == 1 and "damaged" in warnings[0]
    assert (tmp_path / "fakeip.json.damaged").read_bytes() == content
    pool.lookup("a.example")
    pool.close()
    assert orjson.loads(path.read_bytes())["entries"] == [["a.example", "10.0.0.2"]]


def test_entries_outside_a_changed_range_are_dropped(tmp_path):
    path = tmp_path / "fakeip.json"
    doc = {
        "version": 1,
        "range": "10.0.0.0/24",
        "entries": [["a", "10.0.0.2"], ["b", "10.0.1.2"], ["a", "10.0.0.3"], ["c", "10.0.0.2"]],
    }
    path.write_bytes(orjson.dumps(doc))
    warnings: list[str] = []
    pool = FakeIpPool("10.0.0.0/25", str(path), warn=warnings.append)
    assert pool.entries() == [("a", "10.0.0.2")]
    assert "3 mapping(s)" in warnings[0]
    pool.close()


def test_thread_safe_under_concurrent_allocation():
    pool = FakeIpPool("10.0.0.0/20")
    results: dict[int, list[str]] = {}

    def work(n: int) -> None:
        results[n] = [pool.lookup(f"d{i}.example") for i in range(500)]

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r == results[0] for r in results.values())
    assert len(set(results[0])) == 500


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("lcd"), st.integers(0, 12)), max_size=60))
def test_two_way_table_stays_consistent(ops):
    pool = FakeIpPool("10.0.0.0/29")
    for op, n in ops:
        name = f"n{n}"
        if op == "l":
            ip = pool.lookup(name)
            assert pool.peek_domain(ip) == name
        elif op == "c":
            pool.clear(domain=name)
        else:
            pool.domain_of(f"10.0.0.{n}")
        entries = pool.entries()
        assert len(entries) <= pool.capacity
        assert len({d for d, _ in entries}) == len({ip for _, ip in entries}) == len(entries)
        for d, ip in entries:
            assert pool.peek_ip(d) == ip and pool.contains(ip)
