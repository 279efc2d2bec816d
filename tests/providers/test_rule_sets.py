"""A rule provider's body checked before it replaces the last good copy."""

from __future__ import annotations

import pytest

pytest.importorskip("spliceway.routing.ruleset", reason="the rule-set reader lands with issue 29")

from spliceway.providers.rule_sets import RuleSetCounts, check
from spliceway.providers.subscription import BodyError


def test_a_good_body_counts_its_entries_and_skips() -> None:
    counts = check(b"example.com\n+.example.org\n# a comment\nbad/entry\n", "domain", "text")
    assert counts == RuleSetCounts(2, 1, counts.skip_reasons)
    assert len(counts.skip_reasons) == 1
    assert check(b"payload:\n  - 10.0.0.0/8\n  - '::1/128'\n", "ipcidr", "yaml").entries == 2


@pytest.mark.parametrize(
    ("body", "behavior", "fmt"),
    [
        (b"<!DOCTYPE html><html><body>502</body></html>", "domain", "text"),
        (b"\x00\x01\x02\xff", "domain", "text"),
        (b"rules-but-no-payload: 1\n", "domain", "yaml"),
        (b"not/a/domain\n", "domain", "text"),
        (b"example.com\n", "domain", "mrs"),
    ],
)
def test_bodies_that_are_refused(body: bytes, behavior: str, fmt: str) -> None:
    with pytest.raises(BodyError):
        check(body, behavior, fmt)
