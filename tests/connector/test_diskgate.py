"""The outbox free-space gate (connector/diskgate.py): reserve math and real statvfs."""

from __future__ import annotations

import os
from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from spliceway.connector.diskgate import MIB, DiskGate, Storage, reserves

_TOTAL = st.integers(0, 2**62)
_MIN_FREE = st.integers(0, 2**50)
#: Percent as configured: 0..100 with up to three decimals.
_PERCENT = st.integers(0, 100_000).map(lambda m: m / 1000)


def _ceil(x: Fraction) -> int:
    return -(-x.numerator // x.denominator)


def test_reserve_examples():
    gib = 1024 * MIB
    # 5 % of 100 GiB beats 1 GiB; maintenance is a quarter of it.
    assert reserves(100 * gib, gib, 5) == (5 * gib, 5 * gib // 4)
    # The byte floor wins on a small disk; maintenance never drops below 64 MiB.
    assert reserves(10 * gib, gib, 5) == (gib, 256 * MIB)
    assert reserves(gib, 100 * MIB, 0) == (100 * MIB, 64 * MIB)
    # ... but never exceeds the reserve itself.
    assert reserves(gib, 10 * MIB, 0) == (10 * MIB, 10 * MIB)
    assert reserves(0, 0, 0) == (0, 0)
    # Percent rounds up to whole bytes.
    assert reserves(1001, 0, 10) == (101, 101)
    assert reserves(1000, 0, 0.1) == (1, 1)
    assert reserves(100_000, 0, 0.3) == (300, 300)
    assert reserves(3, 0, 0.001) == (1, 1)


@settings(max_examples=300, deadline=None)
@given(_TOTAL, _MIN_FREE, st.integers(0, 100_000))
@example(954_650_025_000, 0, 70_388)  # ~1 TB: float math was one byte short
@example(427_060_108_941_876, 0, 88_232)
def test_reserve_is_the_larger_of_floor_and_exact_percent(total, min_free, milli):
    reserve, maintenance = reserves(total, min_free, milli / 1000)
    assert reserve == max(min_free, _ceil(Fraction(total * milli, 100_000)))
    assert maintenance == min(reserve, max(64 * MIB, reserve // 4))


@settings(max_examples=200, deadline=None)
@given(_TOTAL, _TOTAL, _MIN_FREE, _PERCENT)
def test_reserve_properties(t1, t2, min_free, percent):
    lo, hi = sorted((t1, t2))
    r_lo, m_lo = reserves(lo, min_free, percent)
    r_hi, m_hi = reserves(hi, min_free, percent)
    assert min_free <= r_lo <= r_hi  # monotone in the disk size
    assert m_lo <= m_hi
    assert m_lo <= r_lo
    assert m_lo >= min(r_lo, 64 * MIB)
    assert r_lo <= max(min_free, lo)  # never more than the disk (or the floor)


def test_storage_allows_boundaries():
    s = Storage(
        available_bytes=1000, total_bytes=10_000, reserve_bytes=600, maintenance_reserve_bytes=100
    )
    assert s.allows(0)
    assert s.allows(400)
    assert not s.allows(401)
    assert s.allows_maintenance(900)
    assert not s.allows_maintenance(901)
    assert s.to_dict(True) == {
        "available_bytes": 1000,
        "total_bytes": 10_000,
        "reserve_bytes": 600,
        "maintenance_reserve_bytes": 100,
        "write_blocked": True,
    }
    under = Storage(
        available_bytes=50, total_bytes=10_000, reserve_bytes=600, maintenance_reserve_bytes=100
    )
    assert not under.allows(0)
    assert not under.allows_maintenance(0)


def test_diskgate_reads_a_real_filesystem(tmpfs):
    mnt = tmpfs("4m")
    gate = DiskGate(str(mnt), min_free_bytes=MIB, min_free_percent=50)
    s = gate.read()
    assert s.total_bytes == 4 * MIB
    assert s.available_bytes == 4 * MIB
    assert (s.reserve_bytes, s.maintenance_reserve_bytes) == (2 * MIB, 2 * MIB)
    assert s.allows(2 * MIB)
    assert not s.allows(2 * MIB + 1)
    fd = os.open(mnt / "fill", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"\1" * (3 * MIB))
    finally:
        os.close(fd)
    s = gate.read()
    assert s.available_bytes == MIB
    assert not s.allows(0)
    floor = DiskGate(str(mnt), min_free_bytes=3 * MIB, min_free_percent=1).read()
    assert floor.reserve_bytes == 3 * MIB


def test_diskgate_on_a_missing_directory_raises_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        DiskGate(str(tmp_path / "nope"), 0, 0).read()
