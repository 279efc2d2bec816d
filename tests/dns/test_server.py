"""The DNS server's query path (spliceway.dns.server.DnsResponder) without sockets:
Hypothesis feeds it random bytes, mutated real queries and random well-formed ones; it
never raises, and answers with a DNS response to that query or drops it. The wire-cache
fast path answers exactly what the full path would."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import dns.flags
import dns.message
import dns.opcode
import dns.rcode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spliceway.dns.cache import AnswerCache
from spliceway.dns.fakeip import FakeIpPool
from spliceway.dns.resolver import Answer, ResolveError
from spliceway.dns.server import SLOW, DnsResponder, _fast_key
from tests.helpers.examples import examples


class StubResolver:
    """Answers from a dict; ``fail.test`` fails like a dead server; no network."""

    def __init__(self) -> None:
        self.zone: dict[str, tuple[str, ...]] = {
            "a.test": ("10.0.0.1", "fd00::1"),
            "v4.test": ("10.0.0.2",),
        }
        self.cache = AnswerCache(16)
        self.upstreams: list[tuple[str, str, int]] = []
        self.asked = 0

    async def resolve_answer(self, host: str, timeout: float = 5.0) -> Answer:
        self.asked += 1
        if host == "fail.test":
            raise ResolveError("no server answered")
        found = self.zone.get(host)
        if found is None:
            return Answer((), 0, nxdomain=True)
        return Answer(found, 300)


class Responders:
    """One real-mode and one fake-ip responder, driven on a private event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.resolver = StubResolver()
        self.pool = FakeIpPool("198.18.0.0/24")
        self.real = DnsResponder(lambda: self.resolver, lambda: None)
        self.fake = DnsResponder(lambda: self.resolver, lambda: self.pool)

    def ask(self, responder: DnsResponder, data: bytes, tcp: bool = False) -> bytes | None:
        return self.loop.run_until_complete(responder.respond(data, tcp))


R = Responders()


def check_reply(query: bytes, reply: bytes | None, tcp: bool) -> None:
    """A reply is a response to ``query`` (same id, QR set) that dnspython reads, within
    the transport's size; a dropped query had no readable query header."""
    if reply is None:
        assert len(query) < 12 or query[2] & 0x80, query
        return
    assert len(query) >= 12 and not query[2] & 0x80
    assert reply[:2] == query[:2]
    assert reply[2] & 0x80
    assert len(reply) <= (65535 if tcp else 4096)
    dns.message.from_wire(reply, question_only=True)


_names = st.sampled_from(["a.test", "A.TeSt.", "v4.test", "nx.test", "fail.test", "x" * 63, "."])
_types = st.sampled_from(["A", "AAAA", "MX", "HTTPS", "PTR", "ANY", "TXT", 65280])


@st.composite
def queries(draw: Any) -> bytes:
    name = draw(_names)
    q = dns.message.make_query(name, draw(_types), use_edns=draw(st.sampled_from([None, 0, 1])))
    q.id = draw(st.integers(0, 65535))
    if draw(st.booleans()):
        q.flags &= ~dns.flags.RD
    return q.to_wire()


@st.composite
def mutated(draw: Any) -> bytes:
    data = bytearray(draw(queries()))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "cut":
            del data[pos:]
        else:
            data[pos:pos] = draw(st.binary(min_size=1, max_size=4))
    return bytes(data)


@settings(max_examples=examples(1500), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.one_of(st.binary(max_size=80), queries(), mutated()),
    tcp=st.booleans(),
    fake=st.booleans(),
)
def test_any_input_is_answered_or_dropped_never_raises(data, tcp, fake):
    responder = R.fake if fake else R.real
    reply = R.ask(responder, data, tcp)
    check_reply(data, reply, tcp)


@settings(max_examples=examples(300), deadline=None)
@given(data=queries(), tcp=st.booleans(), fake=st.booleans())
def test_the_fast_path_answers_what_the_full_path_does(data, tcp, fake):
    responder = R.fake if fake else R.real
    first = R.ask(responder, data, tcp)
    quick = responder.quick(data, tcp)
    if quick is SLOW:
        return
    # Only positive answers of cacheable queries are kept, and a cached one is the full
    # path's answer to the same query byte for byte.
    assert _fast_key(data, tcp) is not None
    assert quick == first


def test_cache_hit_keeps_the_clients_id_question_case_and_flags():
    responder = DnsResponder(lambda: R.resolver, lambda: None, clock=lambda: 0.0)
    asked = R.resolver.asked
    q = dns.message.make_query("a.test", "A")
    first = R.ask(responder, q.to_wire())
    assert R.resolver.asked == asked + 1
    q2 = dns.message.make_query("A.TEST", "A")
    q2.id = 4242
    q2.flags = dns.flags.CD  # RD clear, CD set: echoed as given
    hit = responder.quick(q2.to_wire(), False)
    assert hit is not SLOW
    msg = dns.message.from_wire(hit)
    assert msg.id == 4242 and msg.question[0].name.to_text() == "A.TEST."
    assert msg.flags & dns.flags.CD and not msg.flags & dns.flags.RD
    assert msg.answer == dns.message.from_wire(first).answer
    assert R.resolver.asked == asked + 1
    assert responder.counters.cache_hits == 1


def test_wire_cache_expires_and_follows_the_pool():
    now = [0.0]
    pool = FakeIpPool("10.9.0.0/30")  # four addresses: all used, no spares
    responder = DnsResponder(lambda: R.resolver, lambda: pool, clock=lambda: now[0])
    wire = dns.message.make_query("one.test", "A").to_wire()
    R.ask(responder, wire)
    assert responder.quick(wire, False) is not SLOW
    now[0] = 1.5
    assert responder.quick(wire, False) is SLOW  # older than WIRE_CACHE_SECONDS
    R.ask(responder, wire)
    assert responder.quick(wire, False) is not SLOW
    pool.clear(domain="one.test")  # a mapping went away: nothing cached is trusted
    assert responder.quick(wire, False) is SLOW


def test_answers_and_rcodes():
    ask = R.ask

    def rcode(responder: DnsResponder, name: str, qtype: str) -> tuple[str, list[str]]:
        msg = dns.message.from_wire(ask(responder, dns.message.make_query(name, qtype).to_wire()))
        return dns.rcode.to_text(msg.rcode()), [
            rr.to_text() for rrset in msg.answer for rr in rrset
        ]

    assert rcode(R.real, "a.test", "A") == ("NOERROR", ["10.0.0.1"])
    assert rcode(R.real, "a.test", "AAAA") == ("NOERROR", ["fd00::1"])
    assert rcode(R.real, "v4.test", "AAAA") == ("NOERROR", [])
    assert rcode(R.real, "nx.test", "A") == ("NXDOMAIN", [])
    assert rcode(R.real, "fail.test", "A") == ("SERVFAIL", [])
    assert rcode(R.real, "a.test", "MX") == ("NOTIMP", [])  # no udp/tcp server to ask
    assert rcode(R.real, "bad_label-.test", "A") == ("NXDOMAIN", [])
    assert rcode(R.fake, "a.test", "A")[1] == [R.pool.peek_ip("a.test")]
    assert rcode(R.fake, "a.test", "AAAA") == ("NOERROR", [])
    notify = dns.message.make_query("a.test", "SOA")
    notify.set_opcode(dns.opcode.NOTIFY)
    msg = dns.message.from_wire(ask(R.real, notify.to_wire()))
    assert msg.rcode() == dns.rcode.NOTIMP
    badvers = dns.message.make_query("a.test", "A", use_edns=1)
    assert dns.message.from_wire(ask(R.real, badvers.to_wire())).rcode() == dns.rcode.BADVERS


def test_udp_answers_too_big_are_truncated():
    many = tuple(f"10.1.{i // 250}.{i % 250}" for i in range(60))
    resolver = StubResolver()
    resolver.zone = {"big.test": many}
    responder = DnsResponder(lambda: resolver, lambda: None)
    wire = dns.message.make_query("big.test", "A").to_wire()
    udp = dns.message.from_wire(R.ask(responder, wire))
    assert udp.flags & dns.flags.TC and not udp.answer
    tcp = dns.message.from_wire(R.ask(responder, wire, tcp=True))
    assert len(tcp.answer[0]) == 60
    edns = dns.message.make_query("big.test", "A", use_edns=0, payload=4096).to_wire()
    assert len(dns.message.from_wire(R.ask(responder, edns)).answer[0]) == 60
    assert responder.counters.truncated == 1


def test_header_only_formerr():
    data = struct.pack(">HHHHHH", 77, 0x0100, 1, 0, 0, 0) + b"\x40"
    reply = R.ask(R.real, data)
    assert reply is not None and len(reply) == 12
    assert struct.unpack(">HHHHHH", reply) == (77, 0x8181, 0, 0, 0, 0)
