"""The spellings of 127.0.0.1 that issue 26 found routed as names (and so past an
``ip_cidr: [127.0.0.0/8]`` block): the routing unit tests, the C/Python differential
test and the integration test against a real engine all check this one list."""

from __future__ import annotations

#: Every one of these reads as 127.0.0.1 to inet_aton, getaddrinfo or a browser.
LOOPBACK_SPELLINGS: tuple[str, ...] = (
    "127.0.0.1",
    "2130706433",
    "0x7f.0.0.1",
    "0x7f000001",
    "127.1",
    "0177.0.0.1",
    "127.0.0.1.",
    "0",
    "::ffff:127.0.0.1",
)
