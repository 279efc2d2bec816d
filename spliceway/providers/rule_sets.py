"""A rule provider's body checked before it replaces the last good copy.

The rule set itself is read by the routing layer (:mod:`spliceway.routing.ruleset`) when a
configuration is built, from the provider's file; a refresh has to know that the new body
is one (and how many entries it holds) before it replaces that file. The check's parse is
the set itself: :func:`~spliceway.routing.ruleset.parse_rule_set` gives the reload that
reads the same bytes the same object while the refresh holds it (:attr:`RuleSetCounts.data`),
so the body is parsed once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spliceway.providers.subscription import BodyError
from spliceway.routing.ruleset import RuleSetData, RuleSetError, parse_rule_set

__all__ = ["RuleSetCounts", "check"]


@dataclass(frozen=True, slots=True)
class RuleSetCounts:
    """What a good rule-set body holds: entries taken, entries skipped (and why)."""

    entries: int
    skipped: int = 0
    skip_reasons: tuple[str, ...] = ()
    #: The set read: held until the reload has read the file, so it reads this one.
    data: RuleSetData | None = field(default=None, compare=False, repr=False)


def check(body: bytes, behavior: str, fmt: str) -> RuleSetCounts:
    """``body`` read as a rule set of ``behavior`` in ``fmt``; BodyError (the reader's
    message) when it yields nothing usable."""
    try:
        data = parse_rule_set(body, behavior, fmt)  # type: ignore[arg-type]
    except RuleSetError as ex:
        raise BodyError(str(ex)) from None
    return RuleSetCounts(data.count, data.skipped, data.skip_reasons, data)
