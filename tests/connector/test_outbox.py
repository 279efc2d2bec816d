"""The durable outbox (connector/outbox.py, ledger.py) against real files.

The oracle of every fault case: each committed record that was not durably acked is
taken again after reopen with byte-identical payload, losses are counted exactly,
and nothing raises on damaged data.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from spliceway.connector import segments
from spliceway.connector.ledger import Ledger, read_ledger
from spliceway.connector.outbox import (
    FORMAT,
    DiskOutbox,
    Item,
    MemoryOutbox,
    OutboxStore,
    sink_dir_name,
)
from spliceway.errors import ApiError
from tests.helpers.examples import examples

SIZE = 30  # payload bytes of the helper bodies
FRAMED = SIZE + segments.HEADER_SIZE
FOUR = 4 * FRAMED  # segment_bytes holding exactly four helper records


def body(n: int, size: int = SIZE) -> bytes:
    return f"{n:0{size}d}".encode()


def drain(box, limit=1000):
    out = []
    while True:
        got = box.take(limit)
        if not got:
            return out
        out.extend(got)


def pairs(items):
    return [(i.record_id, i.body) for i in items]


def seg_files(d):
    return sorted(n for n in os.listdir(d) if n.startswith("seg-"))


def seg_path(d, first):
    return os.path.join(d, segments.segment_name(first))


def fill(box, ids, *, commit_each=True):
    for n in ids:
        box.append([body(n)])
        if commit_each:
            box.commit()
    box.commit()


def ack_through(box, last):
    for item in drain(box):
        if item.record_id <= last:
            box.ack(item.record_id)
    return box.flush_acks()


def snapshot(root):
    """Every file and directory under ``root`` with its bytes and mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st_ = os.stat(p)
            data = None if os.path.isdir(p) else open(p, "rb").read()  # noqa: SIM115
            out[os.path.relpath(p, root)] = (data, st_.st_mtime_ns, st_.st_size)
    return out


def fill_disk(directory):
    """Write a filler file until the filesystem is full; returns its path."""
    path = os.path.join(directory, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                os.write(fd, b"\1" * 4096)
            except OSError as ex:
                if ex.errno != errno.ENOSPC:
                    raise
                break
    finally:
        os.close(fd)
    assert os.statvfs(directory).f_bavail == 0
    return path


# -- 1. round trip --------------------------------------------------------------------


def test_round_trip_pending_and_redelivery_after_reopen(tmp_path):
    d = str(tmp_path / "sink")
    box = DiskOutbox(d)
    assert box.recovery.state == "clean" and box.pending == 0
    box.append([body(1), body(2)])
    box.append([body(3)])
    assert box.pending == 3
    assert box.take(10) == []  # not committed: not deliverable
    assert box.commit() == 3
    assert box.commit() == 0
    assert box.pending == 3
    first = box.take(2)
    assert pairs(first) == [(1, body(1)), (2, body(2))]
    assert pairs(box.take(10)) == [(3, body(3))]
    assert box.take(10) == []
    box.ack(1)
    box.ack(2)
    assert box.pending == 3 and box.unflushed_acks == 2  # not durable yet
    assert box.flush_acks() == 2
    assert box.flush_acks() == 0
    assert box.pending == 1 and box.unflushed_acks == 0
    box.ack(3)  # acked, never flushed: at-least-once means it comes back
    box.close()

    box = DiskOutbox(d)
    assert box.recovery.to_dict()["state"] == "clean"
    assert box.recovery.recovered_records == 1
    assert box.pending == 1
    assert pairs(drain(box)) == [(3, body(3))]
    box.ack(3)
    assert box.flush_acks() == 1
    assert box.pending == 0
    box.close()

    box = DiskOutbox(d)
    assert box.pending == 0 and drain(box) == []
    box.close()


def test_records_appended_after_a_fully_acked_restart_are_delivered(tmp_path):
    """Reopen with nothing pending, then append into the existing segment."""
    d = str(tmp_path / "sink")
    box = DiskOutbox(d)
    fill(box, [1, 2])
    ack_through(box, 2)
    box.close()

    box = DiskOutbox(d)
    assert drain(box) == []
    box.append([body(3)])
    box.commit()
    assert pairs(drain(box)) == [(3, body(3))]
    box.ack(3)
    box.flush_acks()
    box.close()
    box = DiskOutbox(d)
    box.append([body(4)])
    box.commit()
    assert pairs(box.take(10)) == [(4, body(4))]
    box.close()


def test_duplicate_ack_is_not_counted_twice(tmp_path):
    box = DiskOutbox(str(tmp_path / "sink"))
    fill(box, [1, 2, 3])
    drain(box)
    box.ack(1)
    box.ack(1)
    box.flush_acks()
    assert box.pending == 2
    box.close()


# -- 2. torn tail ---------------------------------------------------------------------


def _torn_source(tmp_path):
    src = str(tmp_path / "src")
    box = DiskOutbox(src)
    fill(box, [1, 2, 3, 4])
    ack_through(box, 1)
    box.close()
    return src, seg_path(src, 1)


def test_torn_tail_at_every_offset_is_truncated_and_appends_continue(tmp_path):
    src, _ = _torn_source(tmp_path)
    last_start = 3 * FRAMED
    for cut in range(last_start, 4 * FRAMED):
        d = str(tmp_path / f"cut{cut}")
        shutil.copytree(src, d)
        path = seg_path(d, 1)
        os.truncate(path, cut)
        box = DiskOutbox(d)
        r = box.recovery
        assert r.truncated_bytes == cut - last_start, cut
        assert r.lost_records == 0 and r.damaged_regions == 0
        assert r.state == ("clean" if cut == last_start else "repaired")
        assert os.path.getsize(path) == last_start
        assert box.pending == 2
        assert pairs(drain(box)) == [(2, body(2)), (3, body(3))]
        box.append([b"new"])
        box.commit()
        assert pairs(drain(box)) == [(4, b"new")]
        box.close()

        box = DiskOutbox(d)
        assert box.recovery.state == "clean"
        assert pairs(drain(box)) == [(2, body(2)), (3, body(3)), (4, b"new")]
        box.close()


def test_torn_tail_readonly_reads_the_same_and_touches_nothing(tmp_path):
    src, _ = _torn_source(tmp_path)
    last_start = 3 * FRAMED
    for cut in range(last_start + 1, 4 * FRAMED):
        d = str(tmp_path / f"cut{cut}")
        shutil.copytree(src, d)
        os.truncate(seg_path(d, 1), cut)
        before = snapshot(d)
        box = DiskOutbox(d, readonly=True)
        assert box.recovery.truncated_bytes == cut - last_start
        assert box.recovery.lost_records == 0
        assert pairs(drain(box)) == [(2, body(2)), (3, body(3))]
        assert box.flush_acks() == 0
        box.close()
        assert snapshot(d) == before


# -- 3. bit flips ---------------------------------------------------------------------


def _flipped(tmp_path, name, offsets, n=5):
    d = str(tmp_path / name)
    box = DiskOutbox(d)
    fill(box, range(1, n + 1))
    box.close()
    path = seg_path(d, 1)
    with open(path, "r+b") as f:
        for off in offsets:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0x10]))
    return d


@pytest.mark.parametrize(
    "where",
    [
        *(("header", i) for i in (0, 3, 4, 7, 8, 15)),
        ("crc", 16),
        ("crc", 19),
        ("payload", 20),
        ("payload", 20 + SIZE // 2),
        ("payload", FRAMED - 1),
    ],
)
def test_bit_flip_in_one_record_loses_exactly_that_record(tmp_path, where):
    _, rel = where
    d = _flipped(tmp_path, "s", [2 * FRAMED + rel])  # record 3 of 5
    size = os.path.getsize(seg_path(d, 1))
    box = DiskOutbox(d)
    r = box.recovery
    assert (r.state, r.lost_records, r.damaged_regions, r.truncated_bytes) == ("repaired", 1, 1, 0)
    assert box.pending == 4
    assert pairs(drain(box)) == [(i, body(i)) for i in (1, 2, 4, 5)]
    assert os.path.getsize(seg_path(d, 1)) == size  # mid-file damage is never truncated
    box.append([b"six"])
    box.commit()
    assert pairs(drain(box)) == [(6, b"six")]
    box.close()


def test_several_damaged_regions_are_counted_exactly(tmp_path):
    # records 2 and 3 (one region), and 5 (another), of 7
    d = _flipped(tmp_path, "s", [1 * FRAMED + 25, 2 * FRAMED + 5, 4 * FRAMED + 17], n=7)
    box = DiskOutbox(d)
    r = box.recovery
    assert (r.lost_records, r.damaged_regions) == (3, 2)
    assert pairs(drain(box)) == [(i, body(i)) for i in (1, 4, 6, 7)]
    box.close()


def test_damage_below_the_ack_is_not_a_loss(tmp_path):
    d = _flipped(tmp_path, "s", [1 * FRAMED + 25], n=5)  # record 2
    Ledger(os.path.join(d, "ledger")).write(2)
    box = DiskOutbox(d)
    assert box.recovery.lost_records == 0 and box.recovery.damaged_regions == 1
    assert [i.record_id for i in drain(box)] == [3, 4, 5]
    box.close()


# -- 4. ledger slots ------------------------------------------------------------------


def _two_acks(tmp_path):
    d = str(tmp_path / "sink")
    box = DiskOutbox(d)
    fill(box, range(1, 7))
    items = drain(box)
    for i in items[:2]:
        box.ack(i.record_id)
    box.flush_acks()  # generation 1 -> slot 1, acked 2
    for i in items[2:4]:
        box.ack(i.record_id)
    box.flush_acks()  # generation 2 -> slot 0, acked 4
    box.close()
    state = read_ledger(os.path.join(d, "ledger"))
    assert (state.acked_id, state.generation, state.damaged_slots) == (4, 2, 0)
    return d, os.path.join(d, "ledger")


def _damage(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize(
    ("offset", "data", "acked"),
    [
        (0 + 12, b"\xff", 2),  # newest slot: acked id byte flipped -> older slot
        (0 + 20, b"\x00", 2),  # newest slot: crc
        (0, b"\0" * 8, 2),  # newest slot torn (half written)
        (512 + 12, b"\xff", 4),  # older slot damaged -> newest still wins
        (512 + 4, b"\x07", 4),  # older slot generation
    ],
)
def test_one_damaged_ledger_slot_falls_back_to_the_other(tmp_path, offset, data, acked):
    d, ledger = _two_acks(tmp_path)
    _damage(ledger, offset, data)
    box = DiskOutbox(d)
    assert box.recovery.damaged_ledger_slots == 1
    assert box.recovery.state == "repaired"
    assert box.recovery.lost_records == 0
    assert pairs(drain(box)) == [(i, body(i)) for i in range(acked + 1, 7)]
    # The next ACK overwrites the damaged slot, never the good one.
    for i in range(acked + 1, 6):
        box.ack(i)
    box.flush_acks()
    box.close()
    state = read_ledger(ledger)
    assert (state.acked_id, state.damaged_slots) == (5, 0)
    box = DiskOutbox(d)
    assert box.recovery.state == "clean"
    assert pairs(drain(box)) == [(6, body(6))]
    box.close()


def test_both_ledger_slots_damaged_redelivers_everything(tmp_path):
    d, ledger = _two_acks(tmp_path)
    _damage(ledger, 12, b"\xff")
    _damage(ledger, 512 + 12, b"\xff")
    box = DiskOutbox(d)
    assert box.recovery.damaged_ledger_slots == 2
    assert box.recovery.lost_records == 0
    assert pairs(drain(box)) == [(i, body(i)) for i in range(1, 7)]
    assert box.pending == 6
    box.close()


def test_ledger_file_garbage_or_short_never_raises(tmp_path):
    path = str(tmp_path / "ledger")
    for raw in (b"", b"x", os.urandom(100), os.urandom(1024), b"\0" * 2048):
        with open(path, "wb") as f:
            f.write(raw)
        state = read_ledger(path)
        assert state.acked_id == 0
    assert read_ledger(str(tmp_path / "missing")).acked_id == 0
    lg = Ledger(path)
    lg.write(9)
    lg.write(10)
    lg.close()
    assert read_ledger(path).acked_id == 10


# -- 5. missing segments, stray files ------------------------------------------------


@pytest.mark.parametrize("missing", [1, 5])
def test_missing_segment_is_counted_exactly(tmp_path, missing):
    d = str(tmp_path / "sink")
    box = DiskOutbox(d, segment_bytes=FOUR)
    fill(box, range(1, 13))
    box.close()
    assert seg_files(d) == [segments.segment_name(f) for f in (1, 5, 9)]
    os.unlink(seg_path(d, missing))
    for stray in ("seg-1.log", "seg-00000000000000000003.log.tmp", "notes.txt"):
        with open(os.path.join(d, stray), "wb") as f:
            f.write(b"garbage")
    os.mkdir(os.path.join(d, "junk"))
    box = DiskOutbox(d, segment_bytes=FOUR)
    assert box.recovery.lost_records == 4
    assert box.recovery.state == "repaired"
    expect = [i for i in range(1, 13) if not missing <= i < missing + 4]
    assert [i.record_id for i in drain(box)] == expect
    box.append([b"13"])
    box.commit()
    assert pairs(drain(box)) == [(13, b"13")]
    box.close()
    assert os.path.exists(os.path.join(d, "notes.txt"))


# -- 6. crash between ledger write and unlink ----------------------------------------


def test_crash_between_ledger_and_unlink_redelivers_nothing_below_the_ack(tmp_path):
    d = str(tmp_path / "sink")
    box = DiskOutbox(d, segment_bytes=FOUR)
    fill(box, range(1, 13))
    box.close()
    Ledger(os.path.join(d, "ledger")).write(10)  # durable ACK, the unlinks never happened
    before = snapshot(d)

    ro = DiskOutbox(d, readonly=True, segment_bytes=FOUR)
    assert [i.record_id for i in drain(ro)] == [11, 12]
    ro.close()
    assert snapshot(d) == before

    box = DiskOutbox(d, segment_bytes=FOUR)
    assert box.recovery.state == "clean"
    assert box.pending == 2
    assert [i.record_id for i in drain(box)] == [11, 12]
    assert seg_files(d) == [segments.segment_name(9)]  # the next start deletes them
    box.close()


# -- 7. rotation and compaction ------------------------------------------------------


def test_rotation_compaction_and_reads_across_segments(tmp_path):
    d = str(tmp_path / "sink")
    box = DiskOutbox(d, segment_bytes=FOUR)
    fill(box, range(1, 11))
    assert seg_files(d) == [segments.segment_name(f) for f in (1, 5, 9)]
    got = box.take(4)  # the reader stops at the end of seg 1
    assert [i.record_id for i in got] == [1, 2, 3, 4]
    for i in got:
        box.ack(i.record_id)
    assert box.flush_acks() == 4
    assert seg_files(d) == [segments.segment_name(f) for f in (5, 9)]
    assert pairs(drain(box)) == [(i, body(i)) for i in range(5, 11)]  # moves on past the gone file
    for i in range(5, 11):
        box.ack(i)
    assert box.flush_acks() == 6
    assert seg_files(d) == [segments.segment_name(9)]  # the active segment stays
    assert box.pending == 0
    fill(box, range(11, 16))
    assert seg_files(d) == [segments.segment_name(f) for f in (9, 13)]
    assert pairs(drain(box)) == [(i, body(i)) for i in range(11, 16)]
    for i in range(11, 16):
        box.ack(i)
    box.flush_acks()
    assert seg_files(d) == [segments.segment_name(13)]
    box.close()
    box = DiskOutbox(d, segment_bytes=FOUR)
    assert drain(box) == [] and box.pending == 0
    fill(box, [16, 17])
    assert pairs(drain(box)) == [(16, body(16)), (17, body(17))]
    box.close()


def test_fully_acked_big_segment_is_closed_early_to_reclaim_space(tmp_path):
    d = str(tmp_path / "sink")
    box = DiskOutbox(d)
    big = b"b" * (600 * 1024)
    box.append([big, big])
    box.commit()
    for i in drain(box):
        box.ack(i.record_id)
    box.flush_acks()
    box.append([b"small"])
    box.commit()
    assert seg_files(d) == [segments.segment_name(1), segments.segment_name(3)]
    assert pairs(drain(box)) == [(3, b"small")]
    box.ack(3)
    box.flush_acks()
    assert seg_files(d) == [segments.segment_name(3)]
    box.close()


def test_reads_span_a_chunk_boundary(tmp_path):
    d = str(tmp_path / "sink")
    box = DiskOutbox(d)
    bodies = [bytes([i]) * (300 * 1024 + i) for i in range(1, 6)]  # > 1 MiB read chunk
    box.append(bodies)
    box.commit()
    assert [i.body for i in drain(box, limit=2)] == bodies
    box.close()


# -- 8. a real full disk -------------------------------------------------------------


def _append_commit(box, bodies):
    box.append(bodies)
    box.commit()


def test_enospc_rolls_back_and_acks_and_compaction_still_work(tmpfs):
    mnt = tmpfs("64k")
    d = os.path.join(mnt, "sink")
    big = 1000
    box = DiskOutbox(d, segment_bytes=8 * (big + segments.HEADER_SIZE))
    for n in range(1, 21):
        box.append([body(n, big)])
        box.commit()
    assert seg_files(d) == [segments.segment_name(f) for f in (1, 9, 17)]
    active = seg_path(d, 17)
    size = os.path.getsize(active)
    filler = fill_disk(mnt)

    # Fits the active segment but needs a new page: a short write, then ENOSPC.
    with pytest.raises(OSError, match="No space left") as ex:
        _append_commit(box, [body(n, big) for n in range(100, 103)])
    assert ex.value.errno == errno.ENOSPC
    assert os.path.getsize(active) == size
    # Needs a new segment.
    with pytest.raises(OSError, match="No space left") as ex:
        _append_commit(box, [body(n, big) for n in range(100, 106)])
    assert ex.value.errno == errno.ENOSPC
    assert seg_files(d) == [segments.segment_name(f) for f in (1, 9, 17)]
    assert box.pending == 20
    assert box.commit() == 0
    box.close()

    box = DiskOutbox(d, segment_bytes=8 * (big + segments.HEADER_SIZE))
    assert box.recovery.state == "clean"
    items = drain(box)
    assert pairs(items) == [(n, body(n, big)) for n in range(1, 21)]
    for i in items[:18]:
        box.ack(i.record_id)
    assert os.statvfs(mnt).f_bavail == 0
    assert box.flush_acks() == 18  # in place, on a full disk
    assert seg_files(d) == [segments.segment_name(17)]  # unlinks free space
    assert box.pending == 2
    box.append([b"21", b"22"])
    assert box.commit() == 2
    assert pairs(drain(box)) == [(21, b"21"), (22, b"22")]
    box.close()
    os.unlink(filler)

    box = DiskOutbox(d, segment_bytes=8 * (big + segments.HEADER_SIZE))
    assert box.recovery.state == "clean"
    assert [i.record_id for i in drain(box)] == [19, 20, 21, 22]
    box.close()


def test_dead_letter_enospc_leaves_no_damage(tmpfs):
    mnt = tmpfs("64k")
    d = os.path.join(mnt, "sink")
    box = DiskOutbox(d)
    bodies = [bytes([65 + i]) * 3000 for i in range(3)]
    box.append(bodies)
    box.commit()
    items = drain(box)
    box.dead_letter(items[0], {"reason": "first"})
    filler = fill_disk(mnt)
    with pytest.raises(OSError, match="No space left") as ex:
        box.dead_letter(items[1], {"reason": "second"})
    assert ex.value.errno == errno.ENOSPC
    assert box.dead_letters == 1
    os.unlink(filler)
    box.dead_letter(items[1], {"reason": "second"})
    for i in items[:2]:
        box.ack(i.record_id)
    box.flush_acks()
    box.close()

    box = DiskOutbox(d)
    assert box.recovery.state == "clean", box.recovery.to_dict()
    assert box.dead_letters == 2
    assert list(box.iter_dead_letters()) == [
        ({"reason": "first"}, bodies[0]),
        ({"reason": "second"}, bodies[1]),
    ]
    assert pairs(drain(box)) == [(3, bodies[2])]
    box.close()


# -- 9. dead letters -----------------------------------------------------------------


def test_dead_letters_are_kept_and_counted_after_reopen(tmp_path):
    d = str(tmp_path / "sink")
    box = DiskOutbox(d, segment_bytes=FOUR)
    payloads = [b"\0\xffbinary", b'{"event_id":"x"}', b""]
    box.append(payloads)
    box.commit()
    items = drain(box)
    metas = [{"reason": f"HTTP {400 + i.record_id}", "record_id": i.record_id} for i in items]
    for item, meta in zip(items, metas, strict=True):
        box.dead_letter(item, meta)
        box.ack(item.record_id)
    box.flush_acks()
    assert box.dead_letters == 3
    box.close()

    for readonly in (True, False):
        box = DiskOutbox(d, readonly=readonly, segment_bytes=FOUR)
        assert box.dead_letters == 3
        assert box.pending == 0
        assert list(box.iter_dead_letters()) == list(zip(metas, payloads, strict=True))
        box.close()
    assert os.listdir(os.path.join(d, "dead"))  # never compacted


def test_dead_letter_too_big_is_refused_without_writing(tmp_path):
    d = str(tmp_path / "sink")
    box = DiskOutbox(d)
    huge = Item(1, b"x" * segments.MAX_RECORD)
    with pytest.raises(ValueError, match="exceeds"):
        box.dead_letter(huge, {"reason": "r"})
    assert box.dead_letters == 0
    box.dead_letter(Item(2, b"ok"), {"reason": "r"})
    box.close()
    box = DiskOutbox(d)
    assert box.recovery.state == "clean"
    assert list(box.iter_dead_letters()) == [({"reason": "r"}, b"ok")]
    box.close()


# -- 11. oversized records -----------------------------------------------------------


def test_oversized_record_is_refused_without_writing_anything(tmp_path):
    d = str(tmp_path / "sink")
    box = DiskOutbox(d)
    with pytest.raises(ValueError, match="exceeds"):
        box.append([b"ok", b"x" * (segments.MAX_RECORD + 1)])
    assert box.pending == 0
    assert box.commit() == 0
    assert seg_files(d) == []
    box.append([b"a"])
    box.commit()
    assert pairs(drain(box)) == [(1, b"a")]
    with pytest.raises(ValueError, match="exceeds"):
        box.append([b"x" * (segments.MAX_RECORD + 1)])
    box.append([b"b"])
    box.commit()
    assert pairs(drain(box)) == [(2, b"b")]
    box.close()
    box = DiskOutbox(d)
    assert box.recovery.state == "clean" and box.recovery.lost_records == 0
    assert pairs(drain(box)) == [(1, b"a"), (2, b"b")]
    box.close()


# -- 10. the store -------------------------------------------------------------------


def test_second_writer_is_refused_naming_the_pid(tmp_path):
    p = str(tmp_path / "outbox")
    store = OutboxStore(p)
    with pytest.raises(ApiError) as ex:
        OutboxStore(p)
    assert ex.value.code == "conflict"
    assert f"pid {os.getpid()}" in ex.value.message
    with pytest.raises(ApiError) as ex:
        OutboxStore(p, readonly=True)
    assert ex.value.code == "conflict"
    store.close()
    OutboxStore(p).close()  # free again once released


def test_readonly_store_modifies_nothing(tmp_path):
    p = str(tmp_path / "outbox")
    store = OutboxStore(p, segment_bytes=FOUR)
    box = store.open_sink("hook")
    fill(box, range(1, 7))
    ack_through(box, 2)
    box.close()
    store.close()
    with open(os.path.join(store.sink_directory("hook"), segments.segment_name(5)), "ab") as f:
        f.write(b"SWR1torn")  # a torn tail a writer would truncate
    before = snapshot(p)
    ro = OutboxStore(p, readonly=True, segment_bytes=FOUR)
    box = ro.open_sink("hook")
    assert box.recovery.truncated_bytes == 8
    assert [i.record_id for i in drain(box)] == [3, 4, 5, 6]
    box.close()
    other = ro.open_sink("never-written")
    assert drain(other) == [] and other.pending == 0
    other.close()
    ro.close()
    assert snapshot(p) == before


def test_readonly_store_of_a_missing_outbox_is_not_found(tmp_path):
    with pytest.raises(ApiError) as ex:
        OutboxStore(str(tmp_path / "none"), readonly=True)
    assert ex.value.code == "not_found"
    assert not os.path.exists(tmp_path / "none")


@pytest.mark.parametrize("marker", [b"spliceway-outbox 2\n", b"something else", b""])
def test_unknown_format_is_refused_and_untouched(tmp_path, marker):
    p = tmp_path / "outbox"
    p.mkdir()
    (p / "FORMAT").write_bytes(marker)
    before = snapshot(str(p))
    for readonly in (False, True):
        with pytest.raises(ApiError) as ex:
            OutboxStore(str(p), readonly=readonly)
        assert ex.value.code == "unsupported"
        assert snapshot(str(p)) == before


def test_new_store_writes_the_format_marker(tmp_path):
    p = tmp_path / "outbox"
    OutboxStore(str(p)).close()
    assert (p / "FORMAT").read_bytes() == FORMAT
    assert sorted(os.listdir(p)) == ["FORMAT", "LOCK", "sinks"]
    assert (p / "LOCK").read_text().strip() == str(os.getpid())


@pytest.mark.parametrize(
    "tag",
    [
        "a/b",
        "..",
        ".",
        "../../etc",
        "ünïcødé-日本",
        "a b%2F",
        "t-x",
        "\x00nul",
        "x" * 300,
        "日" * 200,
    ],
)
def test_sink_tags_map_to_safe_distinct_directory_names(tmp_path, tag):
    name = sink_dir_name(tag)
    assert name.startswith("t-") and name.isascii()
    assert "/" not in name and "\0" not in name and name not in (".", "..")
    assert len(name.encode()) <= 255
    assert name != sink_dir_name(tag + "x")
    store = OutboxStore(str(tmp_path / "outbox"))
    box = store.open_sink(tag)
    assert os.path.dirname(store.sink_directory(tag)) == os.path.join(store.path, "sinks")
    box.append([b"x"])
    box.commit()
    box.close()
    store.close()
    assert os.listdir(tmp_path / "outbox" / "sinks") == [name]


def test_sink_dir_names_are_injective():
    tags = ["a/b", "a%2Fb", "a%2fb", "A/B", "x" * 300, "x" * 301, "x" * 299 + "y", "é", "%C3%A9"]
    names = [sink_dir_name(t) for t in tags]
    assert len(set(names)) == len(names)
    assert sink_dir_name("x" * 300) == sink_dir_name("x" * 300)  # stable


# -- 14. the memory outbox -----------------------------------------------------------


def test_memory_outbox_capacity_and_order():
    box = MemoryOutbox(capacity=3)
    assert box.has_room(3) and not box.has_room(4)
    box.append([b"a", b"b"])
    assert box.pending == 2 and box.has_room(1) and not box.has_room(2)
    assert box.commit() == 0
    assert pairs(box.take(1)) == [(1, b"a")]
    box.append([b"c"])
    assert pairs(box.take(10)) == [(2, b"b"), (3, b"c")]
    assert box.take(10) == []
    box.ack(2)  # not the head: ignored
    assert box.pending == 3
    box.ack(1)
    assert box.pending == 2 and box.has_room(1)
    box.ack(2)
    box.dead_letter(Item(3, b"c"), {"reason": "x"})
    box.ack(3)
    assert box.pending == 0 and box.dead_letters == 1
    assert box.flush_acks() == 0 and box.unflushed_acks == 0
    box.append([b"d"])
    assert pairs(box.take(10)) == [(4, b"d")]
    box.close()


def test_memory_outbox_ack_before_take_does_not_skip_or_repeat():
    box = MemoryOutbox()
    box.append([b"a", b"b"])
    box.ack(1)
    assert pairs(box.take(10)) == [(2, b"b")]
    assert box.take(10) == []


# -- 12. model test ------------------------------------------------------------------

_SEG = 160


class OutboxModel(RuleBasedStateMachine):
    """Random append/commit/take/ack/flush/crash against a list model."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="outbox-model-")
        self.box = DiskOutbox(self.dir, segment_bytes=_SEG)
        self.committed: list[tuple[int, bytes]] = []
        self.uncommitted: list[tuple[int, bytes]] = []
        self.next_id = 1
        self.durable = 0
        self.taken_upto = 0
        self.unacked: list[int] = []
        self.unflushed = 0

    def _above(self, floor):
        return [c for c in self.committed if c[0] > floor]

    @rule(bodies=st.lists(st.binary(max_size=48), min_size=1, max_size=4))
    def append(self, bodies):
        self.box.append(bodies)
        for b in bodies:
            self.uncommitted.append((self.next_id, b))
            self.next_id += 1

    @rule(bodies=st.lists(st.binary(max_size=48), min_size=1, max_size=3))
    def append_and_commit(self, bodies):
        self.append(bodies)
        self.commit()

    @rule()
    def deliver_all(self):
        """What a healthy sink does: take, ack and flush everything committed."""
        self.take(1000)
        if self.unacked:
            self.ack(len(self.unacked))
        self.flush()

    @rule()
    def commit(self):
        assert self.box.commit() == len(self.uncommitted)
        self.committed.extend(self.uncommitted)
        self.uncommitted = []

    @rule(limit=st.integers(1, 6))
    def take(self, limit):
        expect = self._above(self.taken_upto)[:limit]
        got = self.box.take(limit)
        assert pairs(got) == expect
        if got:
            self.taken_upto = got[-1].record_id
            self.unacked.extend(i.record_id for i in got)

    @precondition(lambda self: self.unacked)
    @rule(n=st.integers(1, 4))
    def ack(self, n):
        for rid in self.unacked[:n]:
            self.box.ack(rid)
            self.unflushed += 1
        self.acked = self.unacked[:n][-1]
        del self.unacked[:n]

    @rule()
    def flush(self):
        assert self.box.flush_acks() == self.unflushed
        if self.unflushed:
            self.durable = self.acked
        self.unflushed = 0

    @rule()
    def crash(self):
        """Close and drop what was never committed or flushed, as a crash would."""
        self.box.close()
        last_committed = self.committed[-1][0] if self.committed else 0
        remaining = []
        cut_from = self.next_id  # first id of the first segment holding only uncommitted ones
        for first, path in segments.list_segments(self.dir):
            if first > last_committed:
                os.unlink(path)
                cut_from = min(cut_from, first)
            else:
                remaining.append((first, path))
        if remaining:
            first, path = remaining[-1]
            extra = sum(
                len(b) + segments.HEADER_SIZE
                for rid, b in self.uncommitted
                if first <= rid < cut_from
            )
            os.truncate(path, os.path.getsize(path) - extra)
        self.uncommitted = []
        self.next_id = max(last_committed, self.durable) + 1
        self.unacked = []
        self.unflushed = 0
        self.taken_upto = self.durable

        ro = DiskOutbox(self.dir, readonly=True, segment_bytes=_SEG)
        assert pairs(drain(ro)) == self._above(self.durable)
        ro.close()
        self.box = DiskOutbox(self.dir, segment_bytes=_SEG)
        r = self.box.recovery
        assert (r.state, r.lost_records, r.truncated_bytes) == ("clean", 0, 0), r.to_dict()

    @invariant()
    def counts(self):
        assert self.box.pending == len(self._above(self.durable)) + len(self.uncommitted)
        assert self.box.unflushed_acks == self.unflushed

    def teardown(self):
        self.box.close()
        shutil.rmtree(self.dir, ignore_errors=True)


OutboxModel.TestCase.settings = settings(
    max_examples=examples(150), stateful_step_count=40, deadline=None
)
test_outbox_model = OutboxModel.TestCase
