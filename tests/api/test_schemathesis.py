"""Bounded property-based run of schemathesis against a live control API.

A real engine, its control app built with relaxed limits (so the run is not
all 429s) and served by Waitress on a free loopback port. Every documented
operation except the endless SSE stream gets generated requests, positive and
negative; every response must be documented (status, content type, headers)
and match its schema, and none may be a 500. The 501 of a command that is not
built yet is documented and therefore fine.

Bounded and reproducible: a fixed seed, derandomized Hypothesis, a small
``max_examples`` per operation, no example database, the coverage phase off.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.config import SchemathesisConfig

from spliceway.api.openapi import openapi_document
from spliceway.api.server import ControlServer
from tests.conftest import base_config
from tests.helpers.dnsserver import dns_server

#: Examples per operation; the command endpoint fronts 16 methods, so it gets more.
MAX_EXAMPLES = 20
COMMAND_EXAMPLES = 320
SEED = 20240229

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture
def control_api(app_for) -> Iterator[str]:
    """A throwaway engine's control app (relaxed limits, no key) on Waitress; its base URL.

    The engine resolves through a local DNS server, so generated hostnames for
    ``diagnostics.dns_lookup`` never leave the machine (NXDOMAIN at once).
    """
    with dns_server({"www.example.test": ["192.0.2.10"]}) as dns:
        config = base_config()
        config["rules"] = [
            {"domain_suffix": ["blocked.test"], "action": "block"},
            {"ip_cidr": ["127.0.0.0/8"], "outbound": "direct"},
        ]
        config["runtime"]["dns"] = {"servers": [dns.udp_url]}
        server = ControlServer(app_for(config=config), "127.0.0.1", 0)
        server.start()
        try:
            yield server.base_url
        finally:
            server.stop()


#: The document, loaded at import (it is a pure function of the code) and configured for
#: a bounded, reproducible run. Loaded eagerly rather than through
#: ``schemathesis.pytest.from_fixture``: the lazy loader rewrites a private pytest
#: attribute (``Function._nodeid``) that pytest 9.2 removed.
schema = schemathesis.openapi.from_dict(
    openapi_document(),
    config=SchemathesisConfig.from_dict(
        {
            "seed": SEED,
            "suppress-health-check": ["too_slow", "filter_too_much", "data_too_large"],
            "generation": {
                "mode": "all",
                "max-examples": MAX_EXAMPLES,
                "deterministic": True,
                "database": "none",
            },
            "phases": {"coverage": {"enabled": False}, "stateful": {"enabled": False}},
            # 501 is how a command that is not built yet answers: documented, not a crash.
            "checks": {"not_a_server_error": {"expected-statuses": ["2xx", "3xx", "4xx", "501"]}},
            "request-timeout": 10,
            "operations": [
                {
                    "include-path": "/api/v1/commands",
                    "include-method": "POST",
                    "generation": {"max-examples": COMMAND_EXAMPLES},
                }
            ],
        }
    ),
).exclude(path="/api/v1/events/stream")


@schema.parametrize()
@settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
def test_api_conforms_to_its_document(case: Any, control_api: str) -> None:
    case.call_and_validate(base_url=control_api, checks=CHECKS)
