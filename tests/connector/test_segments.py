"""Record framing and the resynchronising scan (connector/segments.py), on real bytes."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spliceway.connector import segments
from spliceway.connector.segments import Damage, Record


def _buf(n=4, size=30, first=1):
    bodies = [bytes([65 + i]) * size for i in range(n)]
    framed = [segments.frame(first + i, b) for i, b in enumerate(bodies)]
    starts = []
    pos = 0
    for f in framed:
        starts.append(pos)
        pos += len(f)
    return b"".join(framed), bodies, starts


def _records(items):
    return [i for i in items if isinstance(i, Record)]


def _assert_partition(buf, items, start=0):
    """Records and damage tile ``buf[start:]`` exactly, in order."""
    pos = start
    for item in items:
        begin = item.offset if isinstance(item, Record) else item.start
        assert begin == pos
        pos = item.end
        assert pos > begin
    assert pos == max(start, len(buf))


def test_frame_layout_is_the_documented_header():
    raw = segments.frame(7, b"hello")
    assert raw[:4] == b"SWR1"
    magic, length, rid, crc = struct.unpack_from("<IIQI", raw)
    assert (magic, length, rid) == (segments.MAGIC, 5, 7)
    assert crc == zlib.crc32(b"hello", zlib.crc32(struct.pack("<IQ", 5, 7)))
    assert raw[segments.HEADER_SIZE :] == b"hello"
    assert segments.HEADER_SIZE == 20


def test_round_trip_including_empty_payload():
    buf = segments.frame(1, b"") + segments.frame(2, b"x" * 1000) + segments.frame(3, b"\0")
    items = list(segments.scan(buf))
    assert [(r.record_id, r.payload) for r in items] == [(1, b""), (2, b"x" * 1000), (3, b"\0")]
    _assert_partition(buf, items)


def test_scan_from_a_start_offset():
    buf, _, starts = _buf()
    items = list(segments.scan(buf, starts[2]))
    assert [r.record_id for r in items] == [3, 4]


def test_frame_refuses_oversized_payload_and_accepts_the_limit():
    with pytest.raises(ValueError, match="exceeds"):
        segments.frame(1, b"\0" * (segments.MAX_RECORD + 1))
    raw = segments.frame(1, b"\0" * segments.MAX_RECORD)
    (rec,) = segments.scan(raw)
    assert isinstance(rec, Record) and len(rec.payload) == segments.MAX_RECORD


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_every_single_byte_corruption_loses_exactly_that_record(mask):
    buf, bodies, starts = _buf(n=3)
    target = 1  # the middle record
    lo, hi = starts[target], starts[target + 1]
    for pos in range(lo, hi):
        bad = bytearray(buf)
        bad[pos] ^= mask
        items = list(segments.scan(bytes(bad)))
        _assert_partition(bad, items)
        assert [(r.record_id, r.payload) for r in _records(items)] == [
            (1, bodies[0]),
            (3, bodies[2]),
        ], pos
        assert [i for i in items if isinstance(i, Damage)] == [Damage(lo, hi)], pos


def test_truncation_at_every_offset_keeps_the_records_before_it():
    buf, _, starts = _buf(n=3)
    for cut in range(len(buf) + 1):
        data = buf[:cut]
        items = list(segments.scan(data))
        _assert_partition(data, items)
        whole = [i for i, s in enumerate(starts) if s + 50 <= cut]
        assert [r.record_id for r in _records(items)] == [i + 1 for i in whole]
        damage = [i for i in items if isinstance(i, Damage)]
        boundary = cut in (*starts, len(buf))
        assert damage == ([] if boundary else [Damage(starts[len(whole)], cut)])


def test_resync_after_garbage_before_between_and_after():
    a, b = segments.frame(1, b"one"), segments.frame(2, b"two")
    buf = b"junkSWR1junk" + a + b"SWR1" + b"\xff" * 30 + b + b"SWR"
    items = list(segments.scan(buf))
    _assert_partition(buf, items)
    assert [r.payload for r in _records(items)] == [b"one", b"two"]
    assert sum(isinstance(i, Damage) for i in items) == 3


def test_header_claiming_a_huge_length_is_damage_not_a_crash():
    raw = struct.pack("<IIQI", segments.MAGIC, 0xFFFFFFFF, 1, 0) + segments.frame(2, b"ok")
    items = list(segments.scan(raw))
    assert isinstance(items[0], Damage)
    assert [r.record_id for r in _records(items)] == [2]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_scan_never_raises_on_arbitrary_bytes_and_tiles_them(data):
    items = list(segments.scan(data))
    _assert_partition(data, items)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.binary(max_size=40), min_size=1, max_size=6),
    st.data(),
)
def test_random_damage_keeps_every_untouched_record(bodies, data):
    framed = [segments.frame(i + 1, b) for i, b in enumerate(bodies)]
    buf = bytearray(b"".join(framed))
    pos = data.draw(st.integers(0, len(buf) - 1))
    buf[pos] ^= data.draw(st.integers(1, 255))
    items = list(segments.scan(bytes(buf)))
    _assert_partition(buf, items)
    offset = 0
    expect = []
    for i, f in enumerate(framed):
        if not offset <= pos < offset + len(f):
            expect.append((i + 1, bodies[i]))
        offset += len(f)
    assert [(r.record_id, r.payload) for r in _records(items)] == expect


def test_segment_names_and_listing_ignores_strays(tmp_path):
    assert segments.segment_name(1) == "seg-00000000000000000001.log"
    for first in (10, 2, 100):
        (tmp_path / segments.segment_name(first)).write_bytes(b"")
    for stray in (
        "seg-1.log",
        "seg-00000000000000000003.log.tmp",
        "seg-0000000000000000000x.log",
        "notes.txt",
        "ledger",
    ):
        (tmp_path / stray).write_bytes(b"x")
    found = segments.list_segments(str(tmp_path))
    assert [f for f, _ in found] == [2, 10, 100]
    assert all(p == str(tmp_path / segments.segment_name(f)) for f, p in found)
    assert segments.list_segments(str(tmp_path / "missing")) == []
