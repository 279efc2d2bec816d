"""Hypothesis settings for the protocol parser tests.

``HYPOTHESIS_PROFILE=deep`` runs the fuzz tests with many more examples; anything else
(or nothing) runs the ``fast`` profile. The profiles are registered under names of
their own and applied per test (``@settings(settings.get_profile("protocols"))``)
rather than loaded globally, so they do not change other packages' Hypothesis tests.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("protocols-fast", max_examples=150, deadline=None)
settings.register_profile("protocols-deep", max_examples=5000, deadline=None)
settings.register_profile(
    "protocols",
    settings.get_profile(
        "protocols-deep" if os.environ.get("HYPOTHESIS_PROFILE") == "deep" else "protocols-fast"
    ),
)
