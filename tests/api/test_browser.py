"""The keyless browser rules both HTTP listeners share (``api.browser``), as pure functions.

The listeners' own tests (tests/api/test_browser_protection.py for the control API,
tests/api/clash/test_guard.py for the Clash API) send the same headers over real
sockets; these pin the decisions themselves, case by case.
"""

from __future__ import annotations

import pytest

from spliceway.api.browser import (
    KeylessRules,
    foreign_refusal,
    host_refusal,
    is_same_origin,
    normalize_origin,
)

RULES = KeylessRules(subject="an API without a key", remedy="set a key to allow", see="the docs")
LISTEN = ("127.0.0.1", 9097)


@pytest.mark.parametrize(
    "host",
    [
        "localhost:9097",
        "LOCALHOST:9097",
        "app.localhost:9097",
        "127.0.0.1:9097",
        "127.8.9.1:9097",
        "[::1]:9097",
    ],
)
def test_loopback_hosts_on_the_bound_port_pass(host: str) -> None:
    assert host_refusal(host, LISTEN) is None


@pytest.mark.parametrize(
    ("host", "why"),
    [
        ("localhost:9090", "names port 9090, but this API listens on port 9097"),
        ("localhost", "names port 80, but this API listens on port 9097"),
        ("evil.example:9097", "is not a loopback name"),
        ("10.0.0.1:9097", "is neither this API's listen address nor a loopback address"),
        ("[127.0.0.1]:9097", "is not a valid host[:port]"),
        ("local host:9097", "is not a valid host[:port]"),
        ("", "is not a valid host[:port]"),
    ],
)
def test_foreign_hosts_are_named(host: str, why: str) -> None:
    problem = host_refusal(host, LISTEN)
    assert problem is not None and problem.startswith(why)


def test_listen_address_and_wildcard() -> None:
    assert host_refusal("10.0.0.1:80", ("10.0.0.1", 80)) is None
    assert host_refusal("10.0.0.1", ("10.0.0.1", 80)) is None
    assert host_refusal("10.0.0.2:80", ("10.0.0.1", 80)) is not None
    assert host_refusal("192.0.2.7:80", ("0.0.0.0", 80)) is None
    assert host_refusal("[2001:db8::1]:80", ("::", 80)) is None
    # A name is never taken for the wildcard's addresses: DNS rebinding uses names.
    assert host_refusal("evil.example:80", ("0.0.0.0", 80)) is not None
    # An unknown listen address: loopback only.
    assert host_refusal("10.0.0.1:80", (None, 80)) is not None
    assert host_refusal("127.0.0.1:80", (None, 80)) is None


@pytest.mark.parametrize(
    ("configured", "sent"),
    [
        ("https://Board.Example/", "https://board.example"),
        ("https://board.example:443", "https://board.example"),
        ("http://board.example:80", "http://board.example"),
        ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
    ],
)
def test_origins_compare_normalised(configured: str, sent: str) -> None:
    assert normalize_origin(configured) == normalize_origin(sent)
    rules = KeylessRules("s", "r", "d", allowed_origins=(configured,))
    assert rules.allows_origin(sent)


def test_other_ports_and_schemes_are_other_origins() -> None:
    rules = KeylessRules("s", "r", "d", allowed_origins=("https://board.example",))
    assert not rules.allows_origin("http://board.example")
    assert not rules.allows_origin("https://board.example:8443")
    assert not rules.allows_origin("https://board.example.evil")
    assert not rules.allows_origin("null")
    assert KeylessRules("s", "r", "d", allowed_origins=("*",)).allows_origin("null")


def test_same_origin_is_http_plus_host_without_case() -> None:
    assert is_same_origin("http://LocalHost:9097", "localhost:9097")
    assert not is_same_origin("https://localhost:9097", "localhost:9097")
    assert not is_same_origin("http://localhost:9097", None)


def test_plain_tools_and_own_pages_pass() -> None:
    assert foreign_refusal(RULES, LISTEN, None, None, None) is None
    assert foreign_refusal(RULES, LISTEN, "127.0.0.1:9097", None, None) is None
    own = "http://127.0.0.1:9097"
    assert foreign_refusal(RULES, LISTEN, "127.0.0.1:9097", own, "same-origin") is None
    assert foreign_refusal(RULES, LISTEN, "127.0.0.1:9097", None, "none") is None


def test_refusals_name_the_header_and_the_remedy() -> None:
    host = foreign_refusal(RULES, LISTEN, "evil.example:9097", None, None)
    assert host is not None
    assert host.startswith("request refused: Host evil.example:9097 is not a loopback name")
    assert "an API without a key answers only" in host and host.endswith(
        "set a key to allow other hosts (see the docs)"
    )
    origin = foreign_refusal(RULES, LISTEN, "127.0.0.1:9097", "https://evil.example", None)
    assert origin == (
        "cross-origin request refused: Origin https://evil.example is not this API's origin "
        "(http://127.0.0.1:9097); an API without a key accepts only same-origin requests; "
        "set a key to allow cross-origin callers (see the docs)"
    )
    site = foreign_refusal(RULES, LISTEN, "127.0.0.1:9097", None, "cross-site")
    assert site is not None and site.startswith(
        "cross-site request refused: Sec-Fetch-Site is cross-site;"
    )
    assert foreign_refusal(RULES, LISTEN, "127.0.0.1:9097", "null", None) is not None


def test_host_is_checked_before_an_allowed_origin() -> None:
    rules = KeylessRules("s", "r", "d", allowed_origins=("*",))
    problem = foreign_refusal(rules, LISTEN, "evil.example:9097", "http://evil.example:9097", None)
    assert problem is not None and "Host evil.example:9097" in problem


def test_a_configured_origin_passes_with_its_cross_site_fetch() -> None:
    rules = KeylessRules(
        "s",
        "r",
        "d",
        allowed_origins=("https://board.example",),
        origins_setting="api.clash.cors_allow_origins",
    )
    assert (
        foreign_refusal(rules, LISTEN, "127.0.0.1:9097", "https://board.example", "cross-site")
        is None
    )
    other = foreign_refusal(rules, LISTEN, "127.0.0.1:9097", "https://other.example", None)
    assert other is not None and "nor listed in api.clash.cors_allow_origins" in other
    # Without an Origin the page cannot be told apart: a cross-site fetch is refused.
    assert foreign_refusal(rules, LISTEN, "127.0.0.1:9097", None, "cross-site") is not None
