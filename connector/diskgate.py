"""The outbox's free-space gate (README, "Event sinks and the outbox").

Before each new durable write the free space of the outbox's filesystem is read.
The reserve is the larger of ``outbox_min_free_bytes`` and total times the percent; a
write that would leave less free space than the reserve is refused (the event
stays in the event log and the intake's cursor does not move). ACKs overwrite
the ledger in place and compaction unlinks files, so they need no space; dead
letters are new writes and may go down to the emergency maintenance reserve
(25 % of the reserve, at least 64 MiB, never more than the reserve).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from fractions import Fraction

MIB = 1024 * 1024
_MAINTENANCE_FLOOR = 64 * MIB


def reserves(total_bytes: int, min_free_bytes: int, min_free_percent: float) -> tuple[int, int]:
    """``(reserve, maintenance reserve)`` in bytes for a filesystem of ``total_bytes``."""
    # Exact: the percent as written (its shortest decimal form), in integers. Float
    # products lose bytes past 2**53 (a 1 TB disk at a fractional percent).
    percent = Fraction(repr(float(min_free_percent)))
    by_percent = -(-total_bytes * percent.numerator // (100 * percent.denominator))  # ceil
    reserve = max(min_free_bytes, by_percent)
    maintenance = min(reserve, max(_MAINTENANCE_FLOOR, reserve // 4))
    return reserve, maintenance


@dataclass(frozen=True, slots=True)
class Storage:
    """One reading of the outbox filesystem (``outbox_storage`` in the sinks resource)."""

    available_bytes: int
    total_bytes: int
    reserve_bytes: int
    maintenance_reserve_bytes: int

    def allows(self, size: int) -> bool:
        """Whether a new write of ``size`` bytes keeps the reserve free."""
        return self.available_bytes - size >= self.reserve_bytes

    def allows_maintenance(self, size: int) -> bool:
        """Whether a maintenance write (a dead letter) keeps the emergency reserve free."""
        return self.available_bytes - size >= self.maintenance_reserve_bytes

    def to_dict(self, write_blocked: bool) -> dict[str, int | bool]:
        """JSON shape, with the gate's current verdict."""
        return {
            "available_bytes": self.available_bytes,
            "total_bytes": self.total_bytes,
            "reserve_bytes": self.reserve_bytes,
            "maintenance_reserve_bytes": self.maintenance_reserve_bytes,
            "write_blocked": write_blocked,
        }


class DiskGate:
    """Reads the free space of one directory's filesystem against the configured reserve."""

    def __init__(self, path: str, min_free_bytes: int, min_free_percent: float) -> None:
        self.path = path
        self.min_free_bytes = min_free_bytes
        self.min_free_percent = min_free_percent

    def read(self) -> Storage:
        """Free space now (space usable by an unprivileged writer: ``f_bavail``)."""
        st = os.statvfs(self.path)
        total = st.f_blocks * st.f_frsize
        reserve, maintenance = reserves(total, self.min_free_bytes, self.min_free_percent)
        return Storage(st.f_bavail * st.f_frsize, total, reserve, maintenance)
