"""The counter sets: declared once, and what the counting code produces agrees."""

from __future__ import annotations

from spliceway.actors.tun_udp import COUNTER_NAMES as TUN_UDP_COUNTERS
from spliceway.actors.tun_udp import TunUdpCounters
from spliceway.api.openapi import openapi_document
from spliceway.dns.server import COUNTER_NAMES as DNS_COUNTERS
from spliceway.dns.server import DnsCounters
from spliceway.events.catalogue import UDP_COUNTERS as CATALOGUE_UDP_COUNTERS
from spliceway.native.udp import UDP_UPSTREAM_FIELDS
from spliceway.shapes.schema import keys
from spliceway.shapes.stats import UDP_COUNTERS, Stats


def test_udp_counters_are_the_c_relays_leading_fields() -> None:
    assert UDP_COUNTERS == UDP_UPSTREAM_FIELDS == CATALOGUE_UDP_COUNTERS
    schema = openapi_document()["components"]["schemas"]["Stats"]
    assert list(schema["properties"]) == list(keys(Stats))
    assert tuple(schema["properties"]["udp_upstream"]["properties"]) == UDP_COUNTERS


def test_dns_counters_snapshot_has_the_declared_names() -> None:
    counters = DnsCounters()
    counters.queries += 3
    counters.tcp_queries += 1
    counters.cache_hits += 2
    counters.slow_noerror += 1
    snapshot = counters.snapshot()
    assert tuple(snapshot) == DNS_COUNTERS
    assert (snapshot["udp_queries"], snapshot["noerror"], snapshot["answered"]) == (2, 3, 3)
    runtime = openapi_document()["components"]["schemas"]["Runtime"]
    dns = runtime["properties"]["dns_server"]["properties"]["counters"]
    assert tuple(dns["properties"]) == DNS_COUNTERS


def test_tun_udp_counters_snapshot_has_the_declared_names() -> None:
    counters = TunUdpCounters()
    counters.dns_send_failed += 1
    assert tuple(counters.snapshot()) == TUN_UDP_COUNTERS
    assert counters.snapshot()["dns_send_failed"] == 1
    assert TunUdpCounters() is not TunUdpCounters()  # identity, not value, equality
    assert TunUdpCounters() != TunUdpCounters()
