"""How many examples a Hypothesis test runs: the count written beside it, sized by
``HYPOTHESIS_PROFILE``.

Every property test in the suite writes its full-strength count
(``@settings(max_examples=examples(1500))``); this decides how much of it a run pays:

- unset (the README's ``python -m pytest``, CI): a quarter of it, never fewer than 30
  (or the written count, when that is smaller). The differential suites are the
  suite's largest CPU cost, and most of their examples re-check what the first
  quarter already covered; the parsers are also fuzzed under ASan/UBSan in every run
  (``tests/csrc/test_fuzz_sanitized.py``) and at length by ``benchmarks/fuzz_parse.py``.
- ``full``: the written count, as before this budget existed.
- ``deep``: twenty times the written count, for a long local or nightly run.

Anything else is refused, so a misspelt profile never silently runs the small budget.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_PROFILES = {"": "ci", "ci": "ci", "full": "full", "deep": "deep"}


def profile() -> str:
    """The budget in force: ``ci``, ``full`` or ``deep`` (from ``HYPOTHESIS_PROFILE``)."""
    name = os.environ.get("HYPOTHESIS_PROFILE", "")
    if name not in _PROFILES:
        raise ValueError(f"HYPOTHESIS_PROFILE={name!r}: expected one of ci, full, deep")
    return _PROFILES[name]


def examples(written: int) -> int:
    """``max_examples`` for a test whose full-strength count is ``written``."""
    budget = profile()
    if budget == "deep":
        return written * 20
    if budget == "full":
        return written
    return max(min(written, 30), written // 4)


def diff_settings(written: int) -> settings:
    """The ``settings`` of a differential (C against Python) property test whose
    full-strength count is ``written``: budgeted examples, no deadline (a C call under
    a sanitizer or a loaded machine is slow, not wrong), large inputs allowed."""
    return settings(
        max_examples=examples(written),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


#: True when the run asked for the deep budget (tests that scale more than examples).
DEEP = profile() == "deep"
